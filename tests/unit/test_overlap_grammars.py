"""Overlap scheduling with grammars and thinking budgets (`StepBatch.mask_later`): a step is planned and
launched while the step before it runs even when some of its rows may be masked. The runner holds those
rows' logits; once the step before is applied, the engine core masks them from their matchers as they
stand and the runner samples them (engine/core/step_masks.py, runner/eager_sampling.py). Every token, text
and finish is the serial loop's: on each runner, with the decode graphs, with gated grammars opening and
thinking budgets forcing their end mid-stream, and when the mask fails; and most steps are planned ahead.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from fakes import make_seq
from test_thinking_budget import budget, ids, prompt, thinking_model  # noqa: F401 - its fixtures

from helpers.decode_graphs import graphs_on_the_test_device
from helpers.engines import running_engine
from lmiserve.core.events import StepEvent
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.kv_blocks import BlockPool
from lmiserve.engine.core.step import PENDING_TOKEN
from lmiserve.engine.runner.eager_sampling import EagerSampling
from lmiserve.engine.text.token_mask import TokenMask

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Deep learning is a subfield of", "Numbers 1, 2, 3"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[a-z]{2,6}"
GATED = "[0-9]{2,4}"  # once the text holds an "e"


def mix() -> list[SamplingParams]:
    """Constrained rows (greedy, seeded sampled, gated) beside plain ones (greedy, sampled, penalized with a
    stop string)."""
    return [
        SamplingParams(max_new_tokens=40, grammar=Grammar("json_schema", json.dumps(SCHEMA))),
        SamplingParams(max_new_tokens=30, grammar=Grammar("regex", REGEX), do_sample=True, seed=7, temperature=0.9),
        SamplingParams(max_new_tokens=24, ignore_eos_token=True),
        SamplingParams(max_new_tokens=24, do_sample=True, seed=3, top_k=30, ignore_eos_token=True),
        SamplingParams(max_new_tokens=30, grammar=Grammar("regex", GATED, after="e"), ignore_eos_token=True),
        SamplingParams(max_new_tokens=20, stop_sequences=[" the"], repetition_penalty=1.2),
        SamplingParams(max_new_tokens=12, grammar=Grammar("choice", json.dumps(["yes", "no", "maybe"]))),
    ]


def summary(events: list[StepEvent]):
    finish = events[-1].finish
    assert finish is not None
    return [e.token.id for e in events if e.token is not None], finish.reason, finish.generated_text, finish.error


async def everything(
    loaded, params: list[SamplingParams], prompts: list[str] = PROMPTS, abort: int | None = None, **config
):
    """Every request at once; each one's events by sequence (`index`): its summary, or its tokens if it has
    no finish. `abort`: that request's client goes away after its third token. Also the engine's steps,
    steps planned ahead and preemptions; its blocks all back."""
    config = {"max_running": 8, "max_prefill_tokens": 8, **config}
    async with running_engine(loaded, **config) as engine:

        async def one(i: int) -> dict[int, tuple]:
            request = GenerationRequest(prompts[i % len(prompts)], params[i])
            by_index: dict[int, list[StepEvent]] = {}
            async for event in engine.generate(request):
                by_index.setdefault(event.index, []).append(event)
                if i == abort and sum(len(e) for e in by_index.values()) == 3:
                    break
            return {
                index: summary(events) if events[-1].finish else [e.token.id for e in events]
                for index, events in sorted(by_index.items())
            }

        results = await asyncio.gather(*(one(i) for i in range(len(params))))
        for _ in range(100):
            if engine.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_running == 0 and engine.num_waiting == 0 and engine.pool.num_used_blocks == 0
        return results, (engine.steps, engine.steps_ahead, engine.scheduler.num_preemptions)


async def serve(loaded, params: list[SamplingParams], prompts: list[str] = PROMPTS, **config):
    """Every request at once (one sequence each): their summaries and the engine's (steps, steps ahead)."""
    results, (steps, ahead, _) = await everything(loaded, params, prompts, **config)
    return [result[0] for result in results], (steps, ahead)


def count_held(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on (in this test), each `mask_later` batch's count of held rows (`EagerSampling._hold`)."""
    held: list[int] = []
    hold = EagerSampling._hold

    def counted(runner, batch, sampling, rows):  # noqa: ANN001, ANN202 - EagerSampling._hold's
        kept = hold(runner, batch, sampling, rows)
        held.append(len(sampling) - len(kept[0]))
        return kept

    monkeypatch.setattr(EagerSampling, "_hold", counted)
    return held


def check_constrained(results) -> None:
    """The constrained rows' texts follow their grammars (the gated one after its marker)."""
    schema, regex, gated, choice = results[0][2], results[1][2], results[4][2], results[6][2]
    if results[0][1].value != "length":
        json.loads(schema)
    if results[1][1].value != "length":
        assert re.fullmatch(REGEX, regex), regex
    assert "e" in gated, gated  # (the gate opens mid-stream: the tiny model writes an "e" early)
    if results[4][1].value == "eos_token":  # (the grammar complete: nothing may follow)
        assert re.fullmatch(r".*?\s*[0-9]{2,4}", gated.split("e", 1)[1], re.S), gated
    assert choice in ("yes", "no", "maybe"), choice


# --- the scheduler ---------------------------------------------------------------------------------------


def test_a_step_planned_ahead_lists_the_rows_that_may_be_masked_for_later():
    sched = BlockScheduler(BlockPool(64, 4))
    constrained, plain = make_seq([5, 6, 7, 8, 9]), make_seq([5, 6, 7])
    constrained._forcing = object()  # a thinking budget forcing its closing tokens (a mask a token)
    for seq in (constrained, plain):
        sched.add(seq)
    assert not sched.can_plan_ahead()  # (an executor that samples every row at launch)
    sched.masks_later = True
    assert sched.can_plan_ahead()
    first, _ = sched.schedule(0.0)
    assert not first.batch.mask_later  # planned when nothing ran: its masks come with it
    ahead, _ = sched.schedule(0.0, ahead=True)
    rows = {row.seq_id: n for n, row in enumerate(ahead.batch.rows)}
    assert ahead.batch.mask_later and ahead.batch.grammar_rows == [rows[constrained.seq_id]]
    assert ahead.batch.rows[rows[constrained.seq_id]].token_ids == [PENDING_TOKEN]


# --- the engine ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", [{}, {"fast_path": False}], ids=["fast", "transformers"])
async def test_grammars_planned_ahead_give_the_serial_loops_output(tiny_model, runner):
    serial, (steps, ahead) = await serve(tiny_model, mix(), async_scheduling=False, **runner)
    assert ahead == 0
    overlapped, (steps, ahead) = await serve(tiny_model, mix(), async_scheduling=True, **runner)
    assert overlapped == serial
    check_constrained(overlapped)
    assert all(error is None for *_, error in overlapped)
    assert ahead > steps * 2 // 3, (ahead, steps)  # (the rest: steps planned when nothing ran)


async def test_grammars_planned_ahead_with_the_decode_graphs(tiny_model, monkeypatch, gpu_sampler):
    """The decode graphs (their step played on the CPU) sample the plain rows, chain nothing while a row is
    held, and the held rows' logits are copies that the next replay leaves alone: the eager serial engine's
    tokens."""
    eager, _ = await serve(tiny_model, mix(), async_scheduling=False, enforce_eager=True)
    record = graphs_on_the_test_device(monkeypatch)
    held = count_held(monkeypatch)
    graphed, (steps, ahead) = await serve(tiny_model, mix(), async_scheduling=True)
    assert [r[:3] for r in graphed] == [r[:3] for r in eager]
    assert record.steps and sum(held) > 20 and ahead > steps // 2, (len(record.steps), held, ahead, steps)


async def test_thinking_budgets_planned_ahead_force_their_end_as_the_serial_loop(thinking_model, prompt, ids):  # noqa: F811
    _, end = ids
    params = [SamplingParams(max_new_tokens=16, ignore_eos_token=True, thinking=budget(n)) for n in (0, 2, 5)] + [
        SamplingParams(max_new_tokens=30, grammar=Grammar("regex", "[0-9]{4}", after="</think>"), thinking=budget(4)),
        SamplingParams(max_new_tokens=16, ignore_eos_token=True, do_sample=True, seed=5, thinking=budget(3)),
        SamplingParams(max_new_tokens=16, ignore_eos_token=True),
    ]
    serial, _ = await serve(thinking_model, params, [prompt], async_scheduling=False)
    overlapped, (steps, ahead) = await serve(thinking_model, params, [prompt], async_scheduling=True)
    assert overlapped == serial
    for n, (tokens, *_) in zip((0, 2, 5, 4, 3), overlapped):
        assert tokens[n] == end and end not in tokens[:n]
    assert re.fullmatch(r"[ \t\r\n]*[0-9]{4}", overlapped[3][2].split("</think>", 1)[1])
    assert ahead > steps // 2, (ahead, steps)


async def test_a_mask_that_fails_after_the_step_before_fails_its_rows_alone(tiny_model, monkeypatch):
    serial, _ = await serve(tiny_model, mix(), async_scheduling=False)
    fill, calls = TokenMask.fill, []

    def failing(mask, matchers):  # noqa: ANN001, ANN202 - TokenMask.fill's
        calls.append(len(matchers))
        if len(calls) > 3:  # (the first steps' masks come with them: then the held rows')
            raise RuntimeError("no mask")
        return fill(mask, matchers)

    monkeypatch.setattr(TokenMask, "fill", failing)
    overlapped, (_, ahead) = await serve(tiny_model, mix(), async_scheduling=True)
    assert ahead > 0
    for n, (ours, theirs) in enumerate(zip(overlapped, serial)):
        if mix()[n].grammar is None:
            assert ours == theirs
        elif n != 4:  # (the gated one may end unconstrained before its marker)
            assert ours[3] == "exception occurred during sampling: no mask", (n, ours)
            assert ours[0] == theirs[0][: len(ours[0])]  # its tokens before, the serial loop's
    monkeypatch.setattr(TokenMask, "fill", fill)
    again, _ = await serve(tiny_model, mix()[:2], async_scheduling=True)
    assert again == serial[:2]


async def test_n_best_of_preemption_prompt_logprobs_and_an_abort_with_grammars_planned_ahead(tiny_model):
    """Several sequences of one request (each its own matcher, `n` and `best_of`), a pool that preempts, a
    constrained request with prompt logprobs, and a constrained request whose client leaves mid-stream: the
    serial loop's output, its blocks back."""
    schema = Grammar("json_schema", json.dumps(SCHEMA))
    params = [
        SamplingParams(max_new_tokens=24, grammar=schema, do_sample=True, seed=4, n=3),
        SamplingParams(max_new_tokens=20, grammar=Grammar("regex", REGEX), do_sample=True, seed=9, n=2, best_of=3),
        SamplingParams(max_new_tokens=24, ignore_eos_token=True),
        SamplingParams(max_new_tokens=16, grammar=schema, decoder_input_details=True, prompt_top_n=2),
        SamplingParams(max_new_tokens=30, grammar=Grammar("regex", "[a-z ]{10,60}"), ignore_eos_token=True),
    ]
    # 24 blocks of 4 tokens for 9 sequences of prompts of ~8 and up to 24 new tokens: preemption
    pool = {"kv_cache_memory_bytes": 24 * 4 * 2 * 2 * 16 * 2 * 4, "block_size": 4}
    serial, (_, _, preempted) = await everything(tiny_model, params, async_scheduling=False, **pool)
    for _ in range(3):  # (whether the overlapped loop preempts depends on when the requests arrive: up to 3 runs)
        overlapped, (_, ahead, preempted_ahead) = await everything(tiny_model, params, async_scheduling=True, **pool)
        assert overlapped == serial
        if preempted_ahead:
            break
    assert preempted > 0 and preempted_ahead > 0 and ahead > 0, (preempted, preempted_ahead, ahead)
    assert [len(r) for r in overlapped] == [3, 2, 1, 1, 1]
    left, (_, ahead, _) = await everything(tiny_model, params, abort=4, async_scheduling=True)
    assert len(left[4][0]) == 3 and ahead > 0  # (its tokens until the client left)
    alone, _ = await everything(tiny_model, params, async_scheduling=False)
    assert left[:4] == alone[:4]


async def test_a_thinking_budget_holds_its_row_only_where_it_may_run_out(thinking_model, prompt, ids, monkeypatch):  # noqa: F811
    """A budget's row is held for its mask only from the step whose token in flight may spend the budget,
    and while its end is forced: its other rows sample with the step (in a decode graph, chained, on a GPU),
    not once the step before is applied."""
    _, end = ids
    held = count_held(monkeypatch)
    params = [
        SamplingParams(max_new_tokens=30, ignore_eos_token=True, thinking=budget(10)),
        SamplingParams(max_new_tokens=30, ignore_eos_token=True),
    ]
    serial, _ = await serve(thinking_model, params, [prompt], async_scheduling=False)
    overlapped, (steps, ahead) = await serve(thinking_model, params, [prompt], async_scheduling=True)
    assert overlapped == serial and overlapped[0][0][10] == end
    assert ahead > steps * 2 // 3 and 1 <= sum(held) <= 3, (held, ahead, steps)  # (of 29 decode rows)


def test_a_budget_may_run_out_only_with_the_tokens_that_reach_it(thinking_model, prompt):  # noqa: F811
    from lmiserve.engine.text.thinking import BudgetTracker

    tokenizer = thinking_model.tokenizer
    prompt_ids = tokenizer.encode(prompt)
    inside = BudgetTracker(budget(2), tokenizer, prompt_ids)  # (the template opened the block)
    assert [inside.may_spend(k) for k in (0, 1, 2)] == [False, False, True]
    inside.feed(tokenizer.encode("a")[-1])
    assert [inside.may_spend(k) for k in (0, 1)] == [False, True]
    before = BudgetTracker(budget(1, inside=False), tokenizer, prompt_ids)  # (the model may open it)
    assert [before.may_spend(k) for k in (0, 1, 2)] == [False, False, True]  # (the opener, then one counted)
    assert BudgetTracker(budget(0, inside=False), tokenizer, prompt_ids).may_spend(1)
