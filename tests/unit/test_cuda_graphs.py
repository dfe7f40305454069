"""Decode steps replayed as CUDA graphs (engine/attention/cuda_graphs.py).

The capture itself needs a GPU (benchmarks/gpu_check.py runs these tests on CUDA, where `DecodeGraphs`
captures); on a CPU the same padded step runs from the same fixed buffers without capturing
(``capture=False``): the padding, the buffers, the attention plan and the graph-shaped forward are what is
checked here, against transformers' logits and generate()'s greedy tokens. The Triton attention runs under
Triton's interpreter on a CPU (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from helpers.decode_graphs import graphs_on_the_test_device  # noqa: E402
from helpers.llama_variants import ARCHS, PROMPTS, build, greedy_tokens, serve_prompts  # noqa: E402
from lmiserve.engine.attention import cuda_graphs  # noqa: E402
from lmiserve.engine.attention.backends import TorchBackend  # noqa: E402
from lmiserve.engine.attention.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache  # noqa: E402
from lmiserve.engine.core.async_engine import EngineConfig  # noqa: E402
from lmiserve.engine.model.fast_llama import (
    FastLlama,  # noqa: E402
    StepInputs,
)

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
CAPTURE = DEVICE.type == "cuda"


def test_capture_sizes_cover_the_batch_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(10_000)[-1] == cuda_graphs.MAX_CAPTURE_SIZE


SCRATCH = 64  # the block past the 64 the sequences may hold: where padding rows write


def _fast(monkeypatch, arch: str = "llama"):
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    model = build(*ARCHS[arch]).to(DEVICE)
    cfg = model.config
    head_dim = AttentionShape.of(cfg).head_dim
    cache = PagedKVCache(cfg.num_hidden_layers, SCRATCH + 1, 4, cfg.num_key_value_heads, head_dim, model.dtype, DEVICE)
    return model, FastLlama(model, cache, 256)


@pytest.mark.parametrize(
    "arch",
    [
        "llama", "qwen2_bias", "qwen3", "phi3_window", "smollm3_nope", "granite", "gemma", "gemma3_window", "olmo2",
        "olmo3_window", "exaone4_window", "starcoder2_window", "phi4_mini_longrope", "glm4", "gemma2_window", "gpt_oss",
    ],
)  # fmt: skip
@torch.inference_mode()
def test_padded_decode_steps_give_each_rows_transformers_logits(monkeypatch, arch: str):
    """Five sequences prefilled, then decode steps of 5, 3 and 1 rows (padded to 8, 4 and 1 rows that write
    into the scratch block) from the fixed buffers: every row's logits are those of its whole sequence run
    alone, and the scratch block holds the padding rows' keys (token 0 at position 0)."""
    model, fast = _fast(monkeypatch, arch)
    fast.graphs = DecodeGraphs(fast, 8, SCRATCH, capture=CAPTURE)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(4, 512, (n,), generator=gen).tolist() for n in (9, 30, 5, 17, 12)]
    reference = [model(torch.tensor([s], device=DEVICE)).logits[0] for s in seqs]
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(5)]  # 12 blocks of 4 each: 48 positions
    prompt = 4  # every sequence's first 4 tokens as a prompt; the rest decoded
    fast.forward(StepInputs(chunks=[(tables[i], 0, seqs[i][:prompt]) for i in range(5)]))
    for step in range(prompt, 9):
        rows = [i for i in range(5) if step < len(seqs[i])]
        rows = rows[: (5, 3, 1, 5, 3)[step - prompt]]
        ids = [seqs[i][step] for i in rows]
        out = fast.forward(
            StepInputs(
                decode_ids=ids,
                decode_positions=[step] * len(rows),
                decode_tables=[tables[i] for i in rows],
                keep=list(range(len(rows))),
            )
        )
        for row, i in enumerate(rows):
            torch.testing.assert_close(out[row], reference[i][step], rtol=1e-4, atol=1e-4)
        if len(rows) < 5:  # the rows left out catch up eagerly (a step of several positions a row)
            for i in set(range(5)) - set(rows):
                if step < len(seqs[i]):
                    fast.forward(StepInputs(chunks=[(tables[i], step, [seqs[i][step]])]))
    assert fast.graphs.sizes == [1, 2, 4, 8]
    first_layer_keys = fast.cache.keys[0]
    assert first_layer_keys[SCRATCH, :, 0].abs().sum() > 0
    assert fast.cache.zeroed_blocks <= SCRATCH  # the scratch block never counts as in use


@torch.inference_mode()
def test_steps_a_graph_does_not_cover_run_eagerly(monkeypatch):
    """Prompt chunks, a subset of rows kept, more rows than the largest graph: the eager forward."""
    _, fast = _fast(monkeypatch)
    graphs = fast.graphs = DecodeGraphs(fast, 2, SCRATCH, capture=CAPTURE)
    runs = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda *a, **k: runs.append(len(a[0])) or real_run(*a, **k))
    tables = [[0, 1], [2, 3], [4, 5]]
    fast.forward(StepInputs(chunks=[(t, 0, [5, 6, 7]) for t in tables]))
    fast.forward(
        StepInputs(decode_ids=[8, 9, 10], decode_positions=[3, 3, 3], decode_tables=tables, keep=[0, 1, 2])
    )  # 3 rows > 2
    fast.forward(
        StepInputs(decode_ids=[8, 9], decode_positions=[4, 4], decode_tables=tables[:2], keep=[1])
    )  # row 0's logits not kept
    fast.forward(
        StepInputs(
            decode_ids=[8], decode_positions=[5], decode_tables=tables[:1], chunks=[(tables[1], 5, [4, 4])], keep=[0, 2]
        )
    )  # with a chunk
    assert runs == []
    fast.forward(StepInputs(decode_ids=[8, 9], decode_positions=[6, 6], decode_tables=tables[:2], keep=[0, 1]))
    assert runs == [2]


@torch.inference_mode()
def test_a_capture_that_fails_leaves_decode_steps_eager(monkeypatch, caplog):
    """On a CPU the capture fails (no CUDA): the step is computed eagerly from the same buffers, logged,
    and later steps take the eager forward."""
    if CAPTURE:
        pytest.skip("a capture on CUDA succeeds; its failure path is checked on CPU")
    model, fast = _fast(monkeypatch)
    graphs = fast.graphs = DecodeGraphs(fast, 4, SCRATCH, capture=False)
    graphs.capture = True  # as on CUDA: the first step of a size captures (and here fails)
    seq = [5, 6, 7, 8, 9]
    reference = model(torch.tensor([seq])).logits[0]
    fast.forward(StepInputs(chunks=[([0, 1], 0, seq[:4])]))
    with caplog.at_level("ERROR"):
        out = fast.forward(StepInputs(decode_ids=[seq[4]], decode_positions=[4], decode_tables=[[0, 1]], keep=[0]))
    torch.testing.assert_close(out[0], reference[4], rtol=1e-4, atol=1e-4)
    assert graphs.failed and not graphs.covers(1)
    assert "capturing a CUDA graph of 1 decode rows (greedy) failed" in caplog.text


@torch.inference_mode()
def test_every_graph_writes_its_outputs_into_the_same_two_buffers(monkeypatch):
    """Steps of 1 and 3 rows (graphs of 1 and 4 rows), greedy and sampled of both kinds: each step's logits
    and pick are views of the graphs' two output buffers, so the graphs' memory pool holds no graph's
    outputs (on CUDA, every captured graph's outputs are those views too); the logits are transformers'."""
    from lmiserve.core.request import SamplingParams
    from lmiserve.engine.runner import graph_sampling, seeded_draw

    monkeypatch.setattr(seeded_draw, "usable", lambda device: True)  # the graphs sample (the kernel: interpreted)
    model, fast = _fast(monkeypatch)
    graphs = fast.graphs = DecodeGraphs(fast, 4, SCRATCH, capture=CAPTURE)
    tables = [[0, 1], [2, 3], [4, 5]]
    seq = [5, 6, 7, 8]
    reference = model(torch.tensor([seq], device=DEVICE)).logits[0]
    fast.forward(StepInputs(chunks=[(t, 0, seq[:3]) for t in tables]))
    same = graphs._logits_out.untyped_storage().data_ptr(), graphs._pick_out.untyped_storage().data_ptr()
    plain, top_p = SamplingParams(do_sample=True, seed=1), SamplingParams(do_sample=True, top_p=0.9, seed=1)
    for rows, sampled in ((1, None), (3, None), (3, plain), (1, top_p)):
        if sampled is not None:
            assert graphs.sample([(sampled, 1, 3, None, ())] * rows)
        step = StepInputs(decode_ids=[8] * rows, decode_positions=[3] * rows, decode_tables=tables[:rows])
        logits = fast.forward(dataclasses.replace(step, keep=list(range(rows))))
        torch.testing.assert_close(logits[0], reference[3], rtol=1e-4, atol=1e-4)
        assert graphs._last is not None
        pick = graphs._last[1]
        assert (logits.untyped_storage().data_ptr(), pick.untyped_storage().data_ptr()) == same
        assert pick.shape == (rows, 2 if sampled is None else 3)
    for captured in graphs._graphs.values():  # (on CUDA)
        assert (captured.logits.untyped_storage().data_ptr(), captured.pick.untyped_storage().data_ptr()) == same
    if CAPTURE:
        assert {kind for _, kind in graphs._graphs} == {"greedy", graph_sampling.SAMPLED, graph_sampling.FILTERED}


@torch.inference_mode()
def test_a_step_with_prompt_chunks_replays_the_graphs_each_token_a_row(monkeypatch):
    """`cuda_graph_prompt_tokens`: a step's prompt chunks (up to that many tokens) join its decode rows in
    the graph, each token a row at its position over its sequence's table (all the step's keys and values
    written before any row attends): transformers' logits for the kept rows; more tokens run eagerly."""
    model, fast = _fast(monkeypatch)
    graphs = fast.graphs = DecodeGraphs(fast, 2, SCRATCH, capture=CAPTURE, prompt_tokens=6)
    assert graphs.sizes == [1, 2, 4, 8]  # 2 decode rows and 6 prompt rows at most
    runs, eager = [], []
    real_run, real_plan = graphs.run, fast.attention.plan
    monkeypatch.setattr(graphs, "run", lambda *a, **k: runs.append(len(a[0])) or real_run(*a, **k))
    monkeypatch.setattr(fast.attention, "plan", lambda *a: eager.append(a) or real_plan(*a))
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]
    ref_a, ref_b = model(torch.tensor([a], device=DEVICE)).logits[0], model(torch.tensor([b], device=DEVICE)).logits[0]
    # a prompt alone (its last token's logits kept), then a decode row with another prompt joining
    out = fast.forward(StepInputs(chunks=[([0, 1], 0, a[:5])], keep=[4]))
    torch.testing.assert_close(out[0], ref_a[4], rtol=1e-4, atol=1e-4)
    out = fast.forward(
        StepInputs(
            decode_ids=[a[5]], decode_positions=[5], decode_tables=[[0, 1]], chunks=[([2, 3], 0, b[:3])], keep=[0, 3]
        )
    )
    torch.testing.assert_close(out, torch.stack([ref_a[5], ref_b[2]]), rtol=1e-4, atol=1e-4)
    # two chunks at once, one after a prefix: every row kept
    out = fast.forward(StepInputs(chunks=[([2, 3], 3, [b[3]]), ([4, 5], 0, a[:2])], keep=[0, 1, 2]))
    torch.testing.assert_close(out, torch.stack([ref_b[3], ref_a[0], ref_a[1]]), rtol=1e-4, atol=1e-4)
    assert runs == [5, 4, 3] and eager == []
    fast.forward(StepInputs(chunks=[([6, 7], 0, a)], keep=[5]))  # 6 tokens: still folded
    fast.forward(StepInputs(decode_ids=[1], decode_positions=[6], decode_tables=[[6, 7]], chunks=[([8, 9], 0, a)]))
    assert runs == [5, 4, 3, 6, 7] and eager == []
    fast.forward(StepInputs(chunks=[([10, 11], 0, [*a, 1])], keep=[6]))  # 7 prompt tokens: eager
    assert runs == [5, 4, 3, 6, 7] and len(eager) == 1


def test_the_engine_with_prompt_rows_in_the_graphs_gives_generates_greedy_tokens(tiny_model, monkeypatch):
    """The engine with `graph_prompt_tokens`: requests joining a running batch (prompt chunks of up to 8
    tokens) replay the graphs with its decode rows; generate()'s greedy tokens, no step eager."""
    from lmiserve.engine import factory
    from lmiserve.engine.attention.backends import TritonBackend

    graphs_on_the_test_device(monkeypatch)
    folded, eager = [], []
    real_folded, real_plan = DecodeGraphs.run_folded, TritonBackend.plan

    def counting_folded(self, step):  # noqa: ANN001, ANN202 - DecodeGraphs.run_folded's
        logits = real_folded(self, step)
        if logits is not None:
            folded.append(len(step.chunks))
        return logits

    def counting_plan(self, seqs, decode_rows, pad):  # noqa: ANN001, ANN202 - the eager forward's plan
        if not profiling:  # (on CUDA the start's profile of the largest step, eager by design, is no serving step)
            eager.append(len(seqs))
        return real_plan(self, seqs, decode_rows, pad)

    profiling: list[bool] = []
    real_profile = factory.run_profile_step

    def profile(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - factory.run_profile_step's
        profiling.append(True)
        try:
            return real_profile(*args, **kwargs)
        finally:
            profiling.pop()

    monkeypatch.setattr(factory, "run_profile_step", profile)
    monkeypatch.setattr(DecodeGraphs, "run_folded", counting_folded)
    monkeypatch.setattr(TritonBackend, "plan", counting_plan)
    config = EngineConfig(max_prefill_tokens=8, graph_prompt_tokens=16)
    engine, results = asyncio.run(serve_prompts(tiny_model, config, 10))
    assert engine.runner.fast.graphs.prompt_tokens == 16
    for prompt, events in zip(PROMPTS, results):
        assert [e.token.id for e in events if e.token] == greedy_tokens(tiny_model, prompt, 10)
    assert len(folded) >= len(PROMPTS) and eager == []  # every prompt's chunks went through the graphs


def test_the_engine_replays_decode_steps_with_generates_greedy_tokens(tiny_model, monkeypatch):
    """Continuous batching with decode steps through the graphs' buffers (captured on CUDA):
    generate()'s greedy tokens; `enforce_eager` leaves them out."""
    made = graphs_on_the_test_device(monkeypatch).made
    engine, results = asyncio.run(serve_prompts(tiny_model, EngineConfig(max_prefill_tokens=8), 10))
    assert engine.runner.fast.graphs is made[-1] is not None
    assert engine.runner.fast.cache.num_blocks == engine.runner.num_blocks + 1  # the scratch block
    for prompt, events in zip(PROMPTS, results):
        assert [e.token.id for e in events if e.token] == greedy_tokens(tiny_model, prompt, 10)
    engine, _ = asyncio.run(serve_prompts(tiny_model, EngineConfig(enforce_eager=True), 2))
    assert engine.runner.fast.graphs is None
    assert engine.runner.fast.cache.num_blocks == engine.runner.num_blocks


async def test_graphs_with_overlap_scheduling_after_a_warm_up_give_generates_greedy_tokens(tiny_model, monkeypatch):
    """The GPU's defaults together: decode steps through the graphs' buffers, each planned while the step
    before it runs (its rows' tokens `PENDING_TOKEN`, resolved by the runner before the graph's inputs are
    filled), after a warm-up that ran every graph size up to the batch limit (captured there on CUDA)."""
    from lmiserve.core.request import GenerationRequest, SamplingParams
    from lmiserve.engine.core.warmup import warm_up
    from lmiserve.engine.factory import create_engine

    record = graphs_on_the_test_device(monkeypatch)
    made, steps = record.made, record.steps
    config = EngineConfig(max_running=6, max_prefill_tokens=8, async_scheduling=True, warmup=True)
    engine = create_engine(tiny_model, config)
    engine.start()
    try:
        done = await warm_up(engine)
        assert done is not None and set(done.decode_rows) == {1, 2, 4, 6}
        assert {size for size, _ in steps} == set(made[-1].sizes) == {1, 2, 4, 8}  # 6 rows: size 8
        steps.clear()

        async def one(i: int, prompt: str) -> list[int]:
            await asyncio.sleep(0.01 * i)  # later requests join a running batch
            params = SamplingParams(max_new_tokens=10, ignore_eos_token=True)
            return [e.token.id async for e in engine.generate(GenerationRequest(prompt, params)) if e.token]

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    finally:
        await engine.stop()
    assert steps and engine.steps_ahead > engine.steps // 2
    for prompt, tokens in zip(PROMPTS, results, strict=True):
        assert tokens == greedy_tokens(tiny_model, prompt, 10), prompt


def test_graphs_apply_on_cuda_alone(monkeypatch):
    """`wanted` on CUDA unless enforce_eager; `for_model`: none without the Triton attention; the scratch
    block must be in the pool."""
    assert not cuda_graphs.wanted(torch.device("cpu"), enforce_eager=False)
    assert cuda_graphs.wanted(torch.device("cuda"), enforce_eager=False)
    assert not cuda_graphs.wanted(torch.device("cuda"), enforce_eager=True)
    _, fast = _fast(monkeypatch)
    with pytest.raises(ValueError, match="scratch block 65 is not in the pool's 65 blocks"):
        DecodeGraphs(fast, 4, SCRATCH + 1)
    fast.attention = TorchBackend(fast.cache, fast.heads, fast.windows)
    assert cuda_graphs.for_model(fast, 4, SCRATCH) is None
    with pytest.raises(ValueError, match="need the Triton attention"):
        DecodeGraphs(fast, 4, SCRATCH)


def test_prompt_rows_in_graphs_without_graphs_say_so(tiny_model, caplog):
    """`cuda_graph_prompt_tokens` where no graphs are made (here: a CPU, no Triton backend asked): one
    warning line at start, not silence."""
    from lmiserve.engine.factory import create_engine

    if CAPTURE:
        pytest.skip("on CUDA the graphs are made")
    with caplog.at_level("WARNING", logger="lmiserve.engine.factory"):
        create_engine(tiny_model, EngineConfig(graph_prompt_tokens=8))
    assert "cuda_graph_prompt_tokens=8 has no effect here: no CUDA graphs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmiserve.engine.factory"):
        create_engine(tiny_model, EngineConfig())
    assert "cuda_graph_prompt_tokens" not in caplog.text


async def test_a_fused_step_run_again_in_parts_keeps_each_parts_picks(tiny_model, monkeypatch):
    """A step of decode rows and two one-token prompts, each replayed from the graphs (`graph_prompt_tokens`),
    whose fused forward fails once: run again in parts, each part's pick is sent to the host, and each
    part's tokens are its own (the picks' two host buffers never hold a third part's), generate()'s."""
    from lmiserve.core.request import GenerationRequest, SamplingParams
    from lmiserve.engine.factory import create_engine
    from lmiserve.engine.runner.fast import PagedFastRunner

    graphs_on_the_test_device(monkeypatch)
    forward, failed = PagedFastRunner._forward_rows, []

    def failing_once(self, batch, part):  # noqa: ANN001, ANN202 - the first fused step of decode and prompt rows
        if not failed and batch.num_decode and len(part) == len(batch.rows) > batch.num_decode + 1:
            failed.append(len(part))
            raise RuntimeError("fused forward failed")
        return forward(self, batch, part)

    monkeypatch.setattr(PagedFastRunner, "_forward_rows", failing_once)
    engine = create_engine(tiny_model, EngineConfig(max_prefill_tokens=8, graph_prompt_tokens=16))
    engine.start()
    ids = tiny_model.tokenizer(PROMPTS[2]).input_ids

    decoding = asyncio.Event()  # the first request has decoded a token: the two prompts join its decode row

    async def one(prompt_ids: list[int], new: int, after: asyncio.Event | None = None) -> list[int]:
        if after is not None:
            await after.wait()
        params = SamplingParams(max_new_tokens=new, ignore_eos_token=True)
        request = GenerationRequest("", params, prompt_ids=prompt_ids)
        tokens = []
        async for event in engine.generate(request):
            if event.token:
                tokens.append(event.token.id)
                if len(tokens) == 2:  # (the first came from its prompt's step)
                    decoding.set()
        return tokens

    try:  # (the first request long enough to be decoding still when a GPU has run the other two)
        results = await asyncio.gather(one(ids, 48), one(ids[:1], 8, decoding), one(ids[1:2], 8, decoding))
    finally:
        await engine.stop()
    assert failed, "no fused step of decode rows and two prompts ran"
    with torch.inference_mode():
        for prompt_ids, tokens in zip((ids, ids[:1], ids[1:2]), results, strict=True):
            expected = tiny_model.model.generate(
                torch.tensor([prompt_ids], device=tiny_model.model.device), max_new_tokens=len(tokens), do_sample=False
            )[0, len(prompt_ids) :].tolist()
            assert tokens == expected
