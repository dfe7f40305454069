"""Overlap scheduling (`async_scheduling`): a step planned while the step before it runs.

First the block scheduler alone, driven as the engine core drives it with overlap (plan N, hand it to
the executor, plan N+1 ahead, then apply N's results while N+1 runs) against an executor that sees only
the plain-data batches (block_harness.BatchMirror: it resolves `PENDING_TOKEN` from its own view and
checks every position a row reads against it): the tokens, the stops and the pool are those of the
serial loop. Then the engine on the tiny Llama: stops, seeded sampling, aborts, grammars.
"""

from __future__ import annotations

import asyncio

import pytest
from block_harness import BatchMirror, expected_tokens, next_token, prompt
from fakes import EOS, make_seq

from helpers.engines import running_engine
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.kv_blocks import BlockPool
from lmiserve.engine.core.scheduler import StepPlan
from lmiserve.engine.core.step import PENDING_TOKEN, SampleResult, StepOutput

# --- the scheduler, overlapped --------------------------------------------------------------------------


def run(mirror: BatchMirror, plan: StepPlan) -> StepOutput:
    """The executor's side of a step: its samples, as `StepOutput`."""
    sampled = mirror.execute(plan.batch)
    return StepOutput(samples={seq_id: [SampleResult(token, -0.25)] for seq_id, token in sampled.items()})


def drive(sched: BlockScheduler, mirror: BatchMirror, overlap: bool, limit: int = 5000) -> dict[str, int]:
    """Step until no work is left, as `EngineCore` does (with `overlap`, `_step_overlapped`); counts of
    the steps, those planned ahead, and ahead plans with a pending token."""
    counts = {"steps": 0, "ahead": 0, "pending_rows": 0}
    inflight: tuple[StepPlan, StepOutput] | None = None
    for _ in range(limit):
        if inflight is None:
            if not sched.has_work():
                assert not mirror.requests, "the executor was not told every request finished"
                return counts
            plan, _ = sched.schedule(0.0)
            inflight = (plan, run(mirror, plan))
        plan, output = inflight
        ahead = None
        if overlap and plan.has_model_work and sched.can_plan_ahead():
            planned, _ = sched.schedule(0.0, ahead=True)
            assert not planned.batch.preempted  # never a preemption while a step runs
            counts["ahead"] += planned.has_model_work
            counts["pending_rows"] += sum(row.token_ids == [PENDING_TOKEN] for row in planned.batch.rows)
            ahead = (planned, run(mirror, planned))  # it runs after `plan`: the executor's order
        if plan.has_model_work:
            counts["steps"] += 1
            sched.update(plan, output)
        sched.pool.check([s.block_table for s in sched.running if s.block_table is not None])
        inflight = ahead
    raise AssertionError("the scheduler did not finish")


def stopping_rule(seq_id: int, generated: int) -> int:
    """`next_token`, but every third sequence samples EOS at its 5th token (a stop nobody can foresee)."""
    return EOS if seq_id % 3 == 0 and generated == 4 else next_token(seq_id, generated)


@pytest.mark.parametrize(
    ("blocks", "block_size", "max_running", "prefill"),
    [(256, 4, 6, 16), (40, 4, 6, 8), (12, 4, 8, 64)],
    ids=["roomy", "tight", "preempting"],
)
def test_overlapped_steps_give_the_serial_tokens_stops_and_pool(blocks, block_size, max_running, prefill):
    results = {}
    for overlap in (False, True):
        sched = BlockScheduler(BlockPool(blocks, block_size), max_running=max_running, max_prefill_tokens=prefill)
        mirror = BatchMirror(sched.pool, stopping_rule)
        seqs = [
            make_seq(prompt(3 + 5 * (i % 4), 10 + i), max_new_tokens=3 + (7 * i) % 13, seq_id=9000 + i)
            for i in range(14)
        ]
        for seq in seqs:
            sched.add(seq)
        counts = drive(sched, mirror, overlap)
        assert sched.pool.num_used_blocks == 0 and not sched.running and not sched.waiting
        assert all(s.inflight_tokens == 0 and s.inflight_samples == 0 for s in seqs)
        results[overlap] = ([(s.output_ids, s.finish_reason) for s in seqs], counts, sched.num_preemptions)
    (serial, _, _), (overlapped, counts, preemptions) = results[False], results[True]
    assert overlapped == serial
    for seq, (ids, reason) in zip(seqs, overlapped):
        stops = seq.seq_id % 3 == 0 and seq.params.max_new_tokens > 4
        assert reason is (FinishReason.EOS_TOKEN if stops else FinishReason.LENGTH)
        assert ids[: len(ids) - stops] == expected_tokens(seq, len(ids) - stops)
    assert counts["ahead"] > counts["steps"] // 2 and counts["pending_rows"] > 0
    if blocks == 24:
        assert preemptions > 0  # in the steps planned when nothing ran


def test_a_step_planned_ahead_never_decodes_a_token_past_max_new_tokens():
    """A sequence whose last token (by length) is in flight is not in the step planned ahead: no row is
    computed in vain for it, only for a stop nobody could foresee."""
    sched = BlockScheduler(BlockPool(64, 4), max_running=4, max_prefill_tokens=16)
    mirror = BatchMirror(sched.pool)
    seq = make_seq(prompt(5), max_new_tokens=3, ignore_eos_token=True)
    sched.add(seq)
    plan, _ = sched.schedule(0.0)
    output = run(mirror, plan)
    decoded = []
    while plan.has_model_work:
        ahead, _ = sched.schedule(0.0, ahead=True)
        decoded += [s.seq_id for s in ahead.decode]
        ahead_output = run(mirror, ahead)
        sched.update(plan, output)
        plan, output = ahead, ahead_output
    assert seq.finished and len(seq.output_ids) == 3
    assert decoded == [seq.seq_id] * 2  # tokens 2 and 3: the prompt's step sampled the first


def test_no_step_is_planned_ahead_while_a_token_may_be_masked_unless_the_executor_takes_masks_later():
    """An executor that samples every row when it launches a step (the tensor-parallel one) plans steps after
    the step before them while a token may be masked; one that takes the masks later: test_overlap_grammars.py."""
    sched = BlockScheduler(BlockPool(64, 4))
    plain = make_seq(prompt(5))
    sched.add(plain)
    assert sched.can_plan_ahead()
    constrained = make_seq(prompt(6))
    constrained._forcing = object()  # a thinking budget forcing its closing tokens (a mask a token)
    sched.add(constrained)
    assert not sched.can_plan_ahead()


# --- the engine -----------------------------------------------------------------------------------------

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Deep learning is a subfield of", "Numbers 1, 2, 3"]


async def _outputs(loaded, overlap: bool, params: list[SamplingParams], abort_first: bool = False):
    async with running_engine(loaded, max_running=8, async_scheduling=overlap) as engine:
        return await _run_all(engine, params, abort_first), engine.steps_ahead


async def _run_all(engine, params: list[SamplingParams], abort_first: bool) -> list[list[StepEvent]]:
    async def one(i: int) -> list[StepEvent]:
        events = []
        async for event in engine.generate(GenerationRequest(PROMPTS[i % len(PROMPTS)], params[i])):
            events.append(event)
            if abort_first and i == 0 and len(events) == 3:
                break  # the client goes away: the request is aborted
        return events

    results = await asyncio.gather(*(one(i) for i in range(len(params))))
    for _ in range(200):  # the aborted request leaves within a step or two
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.pool.num_used_blocks == 0
    return results


def _summary(events: list[StepEvent]):
    tokens = [e.token.id for e in events if e.token is not None]
    finish = events[-1].finish
    return tokens, finish and (finish.reason, finish.generated_text, finish.stop_reason)


async def test_stops_and_seeded_sampling_are_the_serial_loop_s(tiny_model):
    params = [
        SamplingParams(max_new_tokens=24, stop_sequences=[" the", "e"]),
        SamplingParams(max_new_tokens=24, do_sample=True, seed=11, temperature=0.8),
        SamplingParams(max_new_tokens=17, do_sample=True, seed=5, top_k=20, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=30, stop_token_ids=[300, 301, 302, 303, 304, 305]),
        SamplingParams(max_new_tokens=9, include_stop_str_in_output=True, stop_sequences=["a"]),
        SamplingParams(max_new_tokens=20, min_new_tokens=10),
    ]
    serial, _ = await _outputs(tiny_model, False, params)
    overlapped, ahead = await _outputs(tiny_model, True, params)
    assert [_summary(e) for e in overlapped] == [_summary(e) for e in serial]
    assert ahead > 0


async def test_an_abort_mid_stream_frees_its_blocks(tiny_model):
    params = [SamplingParams(max_new_tokens=40, ignore_eos_token=True) for _ in range(3)]
    results, ahead = await _outputs(tiny_model, True, params, abort_first=True)
    assert len([e for e in results[0] if e.token is not None]) == 3
    assert [len([e for e in r if e.token is not None]) for r in results[1:]] == [40, 40]
    assert ahead > 0


def test_async_scheduling_with_speculative_decoding_is_named_at_start_up(caplog):
    """Speculative decoding plans each step after the one before it: `async_scheduling=true` beside it is
    named in the start-up log, not dropped silently."""
    from lmiserve.config import Settings
    from lmiserve.models.compose import engine_config

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    with caplog.at_level("WARNING", logger="lmiserve.models.compose"):
        config = engine_config(Settings.from_options({"async_scheduling": "true", "speculative_config": spec}))
        engine_config(Settings.from_options({"async_scheduling": "true"}))
        engine_config(Settings.from_options({"speculative_config": spec}))
    assert config.async_scheduling is True
    assert [r.message.split(":")[0] for r in caplog.records] == ["async_scheduling=true with speculative_config"]
