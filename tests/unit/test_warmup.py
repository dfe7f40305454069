"""The warm-up before serving (engine/core/warmup.py): on a GPU by default, run here on the CPU with
`warmup=True` through the same engine: every prompt length and decode row count it promises is run, the
observers see none of it, and the engine is left as it was (counters at zero, no blocks held, output
unchanged)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.greedy import greedy_reference
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.stats import EngineObserver
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.core.warmup import PROMPT_LENGTHS, warm_up
from lmiserve.engine.factory import _for_device, create_engine, decode_rows


class Recorder(EngineObserver):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_submitted(self, prompt_tokens: int, sequences: int) -> None:
        self.calls.append("submitted")

    def on_step(self, step) -> None:
        self.calls.append("step")

    def on_finished(self, request) -> None:
        self.calls.append("finished")


async def test_warm_up_runs_every_shape_unseen_and_leaves_the_engine_as_it_was(tiny_model):
    engine = create_engine(tiny_model, EngineConfig(max_running=8, warmup=True, max_prefill_tokens=128))
    runner = engine.runner
    assert runner is not None
    seen: list[tuple[int, int]] = []  # (decode rows, prompt tokens) of each step
    original = runner.launch_batch

    def recording(batch):
        prompt = sum(len(row.token_ids) for row in batch.rows[batch.num_decode :])
        seen.append((batch.num_decode, prompt))
        return original(batch)

    runner.launch_batch = recording  # type: ignore[method-assign]
    recorder = Recorder()
    engine.add_observer(recorder)
    engine.start()
    try:
        done = await warm_up(engine)
        assert done is not None
        # (on a GPU with CUDA graphs: each graph size, 1, 2, 4, 8)
        assert done.decode_rows == decode_rows(runner, 8)
        assert done.decode_rows == ((1, 2, 4, 8) if getattr(runner.fast, "graphs", None) is not None else (1, 8))
        assert done.prompt_lengths == tuple(n for n in PROMPT_LENGTHS if n + 3 <= tiny_model.max_context)
        # every prompt length prefilled (in chunks of the prompt budget), every row count decoded in one step
        prompt_steps = {p for _, p in seen}
        for length in done.prompt_lengths:
            assert min(length, 128) in prompt_steps
        assert set(done.decode_rows) <= {rows for rows, _ in seen}
        assert recorder.calls == []
        assert engine.steps == engine.generated_tokens == engine.steps_ahead == 0
        assert engine.num_running == engine.num_waiting == 0 and engine.pool.num_used_blocks == 0
        # serving after it: the observers see the requests, the output is generate()'s
        prompt = "The quick brown fox"
        ids = list(tiny_model.tokenizer(prompt)["input_ids"])
        events = [e async for e in engine.generate(GenerationRequest(prompt, SamplingParams(max_new_tokens=12)))]
        assert [e.token.id for e in events if e.token is not None] == greedy_reference(tiny_model)(ids, 12)
        assert "submitted" in recorder.calls and "finished" in recorder.calls
    finally:
        await engine.stop()


async def test_no_warm_up_unless_asked(tiny_model):
    assert create_engine(tiny_model, EngineConfig()).config.warmup is (tiny_model.device.type == "cuda")
    engine = create_engine(tiny_model, EngineConfig(warmup=False))
    engine.start()
    try:
        assert await warm_up(engine) is None
        assert engine.steps == 0
    finally:
        await engine.stop()


def test_a_gpu_warms_up_and_overlaps_by_default_a_cpu_does_neither():
    gpu, cpu = _for_device(EngineConfig(), torch.device("cuda")), _for_device(EngineConfig(), torch.device("cpu"))
    assert gpu.warmup is True and gpu.async_scheduling is True
    assert cpu.warmup is False and cpu.async_scheduling is False
    given = _for_device(EngineConfig(warmup=False, async_scheduling=False), torch.device("cuda"))
    assert given.warmup is False and given.async_scheduling is False


def test_decode_rows_are_the_graph_sizes_up_to_the_batch_limit():
    graphs = SimpleNamespace(sizes=[1, 2, 4, 8, 16, 24, 32, 40])
    runner = SimpleNamespace(fast=SimpleNamespace(graphs=graphs))
    assert decode_rows(runner, 33) == (1, 2, 4, 8, 16, 24, 32, 33)  # type: ignore[arg-type]
    assert decode_rows(SimpleNamespace(), 32) == (1, 16, 32)  # type: ignore[arg-type]
    assert decode_rows(SimpleNamespace(), 4) == (1, 4)  # type: ignore[arg-type]


async def test_a_vision_language_model_warms_up_on_ordinary_words(tiny_vlm_dir):
    """The warm-up's prompts are ordinary words: never the image token (a prompt that holds it without
    an image is refused), so a VLM warms up whole."""
    from lmiserve.models.load import load_causal_lm

    loaded = load_causal_lm(tiny_vlm_dir("qwen2_vl"), dtype="fp32", device="cpu")
    engine = create_engine(loaded, EngineConfig(max_running=4, warmup=True))
    seen: list[int] = []
    new: list = []
    original = engine.executor.launch

    def recording(batch):
        seen.extend(token for row in batch.rows[batch.num_decode :] for token in row.token_ids)  # prompts
        new.extend(batch.new)
        return original(batch)

    engine.executor.launch = recording  # type: ignore[method-assign]
    engine.start()
    try:
        done = await warm_up(engine)
    finally:
        await engine.stop()
    assert done is not None and done.prompt_lengths and done.decode_rows == (1, 4)
    special = engine.codec.special_token_ids
    assert seen and not special & set(seen)  # the prompts: words only
    assert len(new) == len(done.prompt_lengths) + sum(done.decode_rows)  # every request ran


@pytest.mark.parametrize("prompt_rows", [0, 4])
async def test_after_the_warm_up_no_step_launches_the_attention_kernel_in_a_kind_it_did_not_run(
    tiny_model, monkeypatch, prompt_rows
):
    """No request pays for a compilation: on a GPU Triton compiles the attention kernel once for each kind of
    launch (each argument's specialization: an int equal to 1, divisible by 16 or neither; a pointer 16-byte
    aligned or not), so every launch of a busy server's steps (decode rows joined by prompts of any length,
    decode graphs and eager steps) must be of a kind the warm-up ran. Computed here, under the interpreter,
    with Triton's own function (tests/helpers/triton_launches.py). With prompt rows in the graphs too
    (`graph_prompt_tokens` 4: chunks of up to 4 tokens replay the graphs, longer ones run eagerly, those of
    5 to 8 tokens with the decode tiles, which the warm-up's steps of 2-token prompts launch)."""
    import asyncio
    import random

    from helpers.decode_graphs import graphs_on_the_test_device
    from helpers.triton_launches import record_launch_keys
    from lmiserve.engine import kernel_compiles
    from lmiserve.engine.attention import triton_ops

    graphs_on_the_test_device(monkeypatch)
    launches = record_launch_keys(monkeypatch, [(triton_ops, "_kernel")])
    config = EngineConfig(max_running=16, warmup=True, max_prefill_tokens=64, graph_prompt_tokens=prompt_rows)
    engine = create_engine(tiny_model, config)
    rng = random.Random(0)
    engine.start()
    try:
        await warm_up(engine)
        warmed = launches.seen()
        count = len(launches.launches)
        compiled = kernel_compiles.after_warm_up()  # on CUDA, Triton's own count (0 here: nothing compiles)

        async def one(i: int) -> None:
            await asyncio.sleep(0.02 * i)  # each joins a running batch
            ids = [rng.randrange(3, 200) for _ in range(rng.randint(1, 100))]  # (past max_prefill_tokens: chunks)
            params = SamplingParams(max_new_tokens=rng.randint(1, 16), ignore_eos_token=True)
            async for _ in engine.generate(GenerationRequest("", params, prompt_ids=ids)):
                pass

        await asyncio.gather(*(one(i) for i in range(16)))
    finally:
        await engine.stop()
    # (on CUDA the decode graphs' replays launch the kernel without a Python call: the eager steps are seen)
    assert len(launches.launches) > count + (60 if tiny_model.device.type == "cpu" else 20)
    assert 2 <= len(warmed) <= 4  # the graphs' decode rows, eager decode tiles, prefill tiles
    assert launches.seen() - warmed == set()
    assert kernel_compiles.after_warm_up() == compiled


async def test_with_prompt_rows_in_the_graphs_the_warm_up_captures_the_sizes_past_the_batch_limit(
    tiny_model, monkeypatch
):
    """`graph_prompt_tokens`: the graphs' sizes reach the batch limit plus it; no batch of requests reaches
    those past the limit, so the warm-up captures them from padding rows (on CUDA; on a CPU nothing is
    captured) and the engine still serves generate()'s tokens."""
    from helpers.decode_graphs import CAPTURE, graphs_on_the_test_device

    made = graphs_on_the_test_device(monkeypatch).made
    engine = create_engine(tiny_model, EngineConfig(max_running=6, warmup=True, graph_prompt_tokens=8))
    engine.start()
    try:
        done = await warm_up(engine)
        graphs = made[-1]
        assert graphs.sizes == [1, 2, 4, 8, 16] and done is not None and done.decode_rows == (1, 2, 4, 6)
        assert done.graph_sizes == ((16,) if CAPTURE else ())
        if CAPTURE:
            assert {size for size, kind in graphs._graphs if kind == "greedy"} == set(graphs.sizes)
        prompt = "The quick brown fox"
        ids = list(tiny_model.tokenizer(prompt)["input_ids"])
        events = [e async for e in engine.generate(GenerationRequest(prompt, SamplingParams(max_new_tokens=8)))]
        assert [e.token.id for e in events if e.token is not None] == greedy_reference(tiny_model)(ids, 8)
    finally:
        await engine.stop()


async def test_where_the_graphs_sample_the_warm_up_runs_each_size_in_both_sampled_kinds(
    tiny_model, monkeypatch, gpu_sampler
):
    """A GPU's graphs sample (runner/graph_sampling.py): each decode row count's graph is run greedy, sampled
    without top_k, top_p and min_p, and sampled with them, each of those with a penalty too: the first request
    of each kind captures nothing, and the penalties' rows a penalized graph reads hold the batch limit."""
    from helpers.decode_graphs import graphs_on_the_test_device
    from lmiserve.engine.runner import graph_sampling

    record = graphs_on_the_test_device(monkeypatch)
    engine = create_engine(tiny_model, EngineConfig(max_running=4, warmup=True))
    engine.start()
    try:
        done = await warm_up(engine)
        assert done is not None and done.decode_rows == (1, 2, 4)
        kinds = ["greedy", graph_sampling.SAMPLED, graph_sampling.FILTERED]
        kinds += [kind + graph_sampling.PENALIZED for kind in kinds[1:]]
        assert {(rows, kind) for rows in done.decode_rows for kind in kinds} <= record.kinds
        book = engine.runner.penalties  # type: ignore[attr-defined]
        assert book.pinned and book.slots >= 4 + 1
    finally:
        await engine.stop()


async def test_a_shape_the_engine_refuses_stops_the_warm_up_and_the_model_serves(tiny_model, monkeypatch, caplog):
    """A request the engine refuses during the warm-up (its first prompt length here) ends the warm-up with a
    warning, not the start-up; the rest of it is skipped and the engine serves."""
    from lmiserve.core.errors import InvalidRequest
    from lmiserve.engine.core import warmup

    engine = create_engine(tiny_model, EngineConfig(max_running=4, warmup=True, max_prefill_tokens=128))

    def refused(request, *args, **kwargs):  # noqa: ANN001, ANN202
        raise InvalidRequest("refused here")

    engine.start()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(engine, "submit", refused)
            with caplog.at_level("WARNING", logger=warmup.__name__):
                done = await warm_up(engine)
        assert done is not None and "warm-up stopped (refused here)" in caplog.text
        params = SamplingParams(max_new_tokens=3, ignore_eos_token=True)
        tokens = [e async for e in engine.generate(GenerationRequest("Hello", params)) if e.token]
        assert len(tokens) == 3
    finally:
        await engine.stop()
