"""The CUDA path's paged attention kernel (engine/attention/triton_ops.py): one Triton launch a layer for every
token of a step, reading keys and values in place through the block tables.

On a CPU the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with
LMISERVE_TEST_DEVICE=cuda (benchmarks/gpu_check.py) the same tests run it compiled on the GPU. Each result
is checked against attention computed directly over each token's positions, and through the fast forward
against transformers' logits and generate()'s greedy tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from helpers.llama_variants import ARCHS, PROMPTS, build, generic_model, greedy_tokens, serve_prompts  # noqa: E402
from lmiserve.engine.attention import triton_ops as triton_attention  # noqa: E402
from lmiserve.engine.attention.paged import PagedKVCache  # noqa: E402
from lmiserve.engine.core.async_engine import EngineConfig  # noqa: E402
from lmiserve.engine.model import fast_llama  # noqa: E402
from lmiserve.engine.model.fast_llama import (
    FastLlama,  # noqa: E402
    StepInputs,
)

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))


def _tables(counts: list[int], num_blocks: int, gen: torch.Generator) -> list[list[int]]:
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for count in counts:
        tables.append(order[taken : taken + count])
        taken += count
    return tables


def _reference(query, key_cache, value_cache, sequences, scale):
    """Each token over its sequence's positions ``0..its own``, in fp32, read block by block."""
    block_size = key_cache.shape[2]
    kv_heads = key_cache.shape[1]
    groups = query.shape[1] // kv_heads
    out, row = [], 0
    for table, start, count in sequences:
        end = start + count
        blocks = torch.tensor(table, device=key_cache.device)[: -(-end // block_size)]
        keys = key_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, key_cache.shape[-1])[:, :end].float()
        values = value_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, key_cache.shape[-1])[:, :end].float()
        for i in range(count):
            visible = start + i + 1
            q = query[row + i].float().view(kv_heads, groups, -1)
            scores = torch.einsum("hgd,hld->hgl", q, keys[:, :visible]) * scale
            out.append(torch.einsum("hgl,hld->hgd", scores.softmax(-1), values[:, :visible]).reshape(-1, q.shape[-1]))
        row += count
    return torch.stack(out)


CASES = {
    # kv heads, query heads a kv head, head_dim, block size, dtype
    "mha-small-blocks": (2, 1, 16, 4, torch.float32),
    "gqa3-smollm": (3, 3, 64, 16, torch.float32),  # groups not a power of two
    "gqa8-dim80": (1, 8, 80, 32, torch.float32),  # head_dim not a power of two
    "gqa2-fp16": (2, 2, 32, 8, torch.float16),
}
if DEVICE.type == "cuda":
    # Triton's interpreter multiplies bf16 operands wrongly (tl.dot reads numpy's stand-in for bf16 as
    # integers), so the bf16 kernel is checked on the GPU only (benchmarks/gpu_check.py)
    CASES["gqa4-bf16"] = (2, 4, 64, 16, torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_every_token_attends_over_its_own_positions_through_the_block_table(case: str):
    """Decode rows and prefill chunks (one shorter than a tile, one over several tiles, one starting
    after a cached prefix) in one launch; the padding rows after the step's tokens stay zero, and so do
    the launch's empty tiles."""
    kv_heads, groups, dim, block_size, dtype = CASES[case]
    gen = torch.Generator().manual_seed(3)
    starts_counts = [(70, 1), (5, 1), (0, 37), (150, 20), (33, 3)]  # decode, decode, prompt, chunk, draft
    needed = [-(-(s + c) // block_size) for s, c in starts_counts]
    num_blocks = sum(needed) + 3
    tables = _tables(needed, num_blocks, gen)
    sequences = [(t, s, c) for t, (s, c) in zip(tables, starts_counts)]
    tokens = sum(c for _, c in starts_counts)
    shape = (num_blocks, kv_heads, block_size, dim)
    key_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    value_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    query = torch.randn(tokens + 5, kv_heads * groups, dim, generator=gen).to(DEVICE, dtype)
    new_keys = torch.randn(tokens, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    new_values = torch.randn(tokens, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    plan = triton_attention.step_tiles(sequences, groups, kv_heads, block_size, DEVICE, tile_capacity=64)
    triton_attention.write_step(key_cache, value_cache, new_keys, new_values, plan)
    # the step's keys and values are where the block tables put them
    row = 0
    for table, start, count in sequences:
        for i in range(count):
            p = start + i
            torch.testing.assert_close(key_cache[table[p // block_size], :, p % block_size], new_keys[row])
            torch.testing.assert_close(value_cache[table[p // block_size], :, p % block_size], new_values[row])
            row += 1
    scale = dim**-0.5
    out = triton_attention.paged_attention(query, key_cache, value_cache, plan, scale)
    expected = _reference(query, key_cache, value_cache, sequences, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:tokens].float(), expected, rtol=tol, atol=tol)
    assert not out[tokens:].any()


def _graph_step(
    case: str, positions: list[int], counts: list[int], gen: torch.Generator
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, triton_attention.StepTiles]:
    """A decode graph's step of `CASES[case]`'s shape (`TritonBackend.graph_plan`: each row a tile of its own, a
    padding row's count 0): the rows' block tables, random key and value caches of 40 blocks, the plan."""
    kv_heads, groups, dim, block_size, dtype = CASES[case]
    tables = _tables([-(-(p + 1) // block_size) for p in positions], 40, gen)
    width = max(len(t) for t in tables)
    shape = (40, kv_heads, block_size, dim)
    key_cache, value_cache = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(2))
    rows = torch.arange(len(positions), device=DEVICE)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    at = torch.tensor(positions, device=DEVICE)
    tile, size = triton_attention.tile_tokens(groups, 1), len(positions)
    plan = triton_attention.StepTiles(
        rows, rows, torch.tensor(counts, device=DEVICE), at, table, at, tile, size, size, rows_tiled=True
    )
    return tables, key_cache, value_cache, plan


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_a_decode_graphs_plan_writes_every_row_its_padding_rows_zeros(case: str):
    """A decode graph's plan (`TritonBackend.graph_plan`: each row a tile of its own, padding rows tiles of no
    token): the output is not zeroed beforehand (an output of NaNs here), so the kernel writes each row, the
    padding rows' zeros too; the decode rows as `_reference` attends them."""
    kv_heads, groups, dim, _, dtype = CASES[case]
    gen = torch.Generator().manual_seed(4)
    tables, key_cache, value_cache, plan = _graph_step(case, [9, 0, 30, 0], [1, 0, 1, 0], gen)  # rows 1, 3: padding
    query = torch.randn(4, kv_heads * groups, dim, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(query, key_cache, value_cache, plan, dim**-0.5, out=out)
    want = _reference(query[[0, 2]], key_cache, value_cache, [(tables[0], 9, 1), (tables[2], 30, 1)], dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[[0, 2]].float(), want, rtol=tol, atol=tol)
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_a_decode_graphs_plan_writes_its_rows_in_fp8_too_as_the_products_quantizer_does(case: str):
    """`fp8_rows`: the program of a row that finishes last also writes the row (all its kv heads' programs') in fp8
    over its own range with its scale, the bytes and scales of `fp8_w8a8`'s quantizing kernel on the output, the
    padding rows past the step's zero (a padding row inside it: a row of zeros); the output as without; each
    row's count left zero for the next launch (run twice)."""
    from lmiserve.engine.model import fp8_w8a8

    kv_heads, groups, dim, _, dtype = CASES[case]
    gen = torch.Generator().manual_seed(5)
    _, key_cache, value_cache, plan = _graph_step(case, [9, 0, 30], [1, 0, 1], gen)  # row 1: padding
    key_cache, value_cache = key_cache * 4, value_cache * 4
    done = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    for seed in (6, 7):
        query = torch.randn(3, kv_heads * groups, dim, generator=gen.manual_seed(seed)).to(DEVICE, dtype)
        plain = triton_attention.paged_attention(query, key_cache, value_cache, plan, dim**-0.5)
        q8, scales = fp8_w8a8.row_buffers(3, kv_heads * groups * dim, DEVICE)
        q8.fill_(7)
        scales.fill_(float("nan"))
        out = torch.full_like(query, float("nan"))  # (a row quantized before each of its heads is written: NaN)
        rows_in_fp8 = (q8, scales, done)
        triton_attention.paged_attention(query, key_cache, value_cache, plan, dim**-0.5, out, fp8_rows=rows_in_fp8)
        assert torch.equal(out, plain)
        want_q, want_scales = fp8_w8a8._rows_in_fp8(out.reshape(3, -1).clone())
        assert torch.equal(q8, want_q.view(torch.uint8)) and torch.equal(scales, want_scales)
        assert not q8[1:2].any() and not q8[3:].any() and q8[0].any() and q8[2].any()
        assert not done.any()
    with pytest.raises(ValueError, match="decode graph"):  # (a plan of tiles of several tokens)
        triton_attention.paged_attention(
            query, key_cache, value_cache, plan._replace(rows_tiled=False), dim**-0.5, fp8_rows=(q8, scales, done)
        )


def test_a_step_of_more_tiles_than_its_launch_is_refused():
    with pytest.raises(ValueError, match="3 tiles do not fit a launch of 2"):
        triton_attention.step_tiles([([0], 0, 1), ([1], 0, 1), ([2], 0, 1)], 1, 1, 4, DEVICE, tile_capacity=2)


@pytest.mark.parametrize("decode_only", [True, False])
def test_a_tile_holds_at_least_sixteen_query_rows(decode_only: bool):
    """tl.dot's smallest shape: decode steps pack up to 16 rows (tokens x groups), prefill steps 64."""
    count = 1 if decode_only else 40
    for groups in (1, 3, 4, 8, 32):
        plan = triton_attention.step_tiles([([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 0, count)], groups, 1, 4, DEVICE)
        rows = plan.block_q * (1 << (groups - 1).bit_length())
        assert rows >= 16
        assert plan.tiles == -(-count // plan.block_q)


@torch.inference_mode()
def test_the_fast_forward_over_the_kernel_gives_transformers_logits(monkeypatch):
    """The paged fast forward with the Triton backend: prompt chunks after a long prefix beside a decode
    row, each position's logits those of the whole prompt run alone."""
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    for arch in ("llama", "qwen2_bias"):
        model = build(*ARCHS[arch]).to(DEVICE)
        cfg = model.config
        gen = torch.Generator().manual_seed(1)
        long, short = (torch.randint(4, 512, (n,), generator=gen).tolist() for n in (70, 9))
        ref_long, ref_short = (model(torch.tensor([s], device=DEVICE)).logits[0] for s in (long, short))
        cache = PagedKVCache(cfg.num_hidden_layers, 24, 4, cfg.num_key_value_heads, 16, model.dtype, DEVICE)
        fast = FastLlama(model, cache, 256)
        assert fast.triton
        long_table = [3, 7, 1, 12, 0, 9, 5, 14, 2, 11, 6, 8, 10, 16, 17, 18, 19, 20]
        short_table = [23, 13, 4]
        out = fast.forward(
            StepInputs(chunks=[(short_table, 0, short[:-1]), (long_table, 0, long[:40])], keep=[7, 8 + 39])
        )
        torch.testing.assert_close(out[0], ref_short[7], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[1], ref_long[39], rtol=1e-4, atol=1e-4)
        for start in range(40, len(long), 15):
            chunk = long[start : start + 15]
            keep = list(range(1 + len(chunk)))
            out = fast.forward(
                StepInputs(
                    decode_ids=[short[-1]],
                    decode_positions=[len(short) - 1],
                    decode_tables=[short_table],
                    chunks=[(long_table, start, chunk)],
                    keep=keep,
                )
            )
            torch.testing.assert_close(out[0], ref_short[-1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out[1:], ref_long[start : start + len(chunk)], rtol=1e-4, atol=1e-4)


def test_the_engine_over_the_kernel_gives_generates_greedy_tokens(tiny_model, monkeypatch):
    """Continuous batching (requests joining a running batch, prompts in chunks) with every step's
    attention in the kernel: generate()'s greedy tokens."""
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    engine, results = asyncio.run(serve_prompts(tiny_model, EngineConfig(max_prefill_tokens=6), 10))
    assert engine.runner.fast.triton
    for prompt, events in zip(PROMPTS, results):
        assert [e.token.id for e in events if e.token] == greedy_tokens(tiny_model, prompt, 10)


def test_the_backend_is_chosen_by_the_environment(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("LMISERVE_ATTENTION_BACKEND", raising=False)
    assert not triton_attention.chosen(cpu)  # auto: CUDA only, never the interpreter
    monkeypatch.setattr(triton_attention, "available", lambda device: device.type == "cuda")
    assert triton_attention.chosen(cuda)
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "torch")
    assert not triton_attention.chosen(cuda)
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="LMISERVE_ATTENTION_BACKEND='flash': expected one of auto, triton, torch"):
        triton_attention.chosen(cuda)
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(triton_attention, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA device and the triton package"):
        triton_attention.chosen(cpu)


@pytest.mark.parametrize("arch", ["qwen3", "phi", "gpt2"])
def test_other_architectures_attend_through_the_kernel_with_generates_greedy_tokens(tiny_model, monkeypatch, arch):
    """The generic runner (transformers' forward) with lmiserve's attention implementation: every layer's
    keys and values written into the blocks and read in place by the kernel, no mask, no gather; the
    model's own attention implementation is left as it was."""
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    model = generic_model(arch).to(DEVICE)
    before = model.config._attn_implementation
    loaded = dataclasses.replace(tiny_model, model=model, max_context=256)
    config = EngineConfig(max_prefill_tokens=5, fast_path=False)  # (qwen3: the fast forward's otherwise)
    engine, results = asyncio.run(serve_prompts(loaded, config, 8))
    assert engine.runner.path == "generic" and engine.runner.kernel
    for prompt, events in zip(PROMPTS, results):
        assert [e.token.id for e in events if e.token] == greedy_tokens(loaded, prompt, 8)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("fault", ["wrong", "raises"])
def test_a_model_the_kernel_does_not_fit_keeps_the_gather(tiny_model, monkeypatch, caplog, fault):
    """The runner's probe at start: logits that differ from the gathered path's, or an attention call the
    kernel cannot take, keep the model off the Triton backend (on transformers' attention over the gathered
    blocks, or the compiled CPU kernel where that one agrees)."""
    from lmiserve.engine.attention.backends import TritonBackend
    from lmiserve.engine.runner import generic as paged_generic

    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")

    def broken(query, key_cache, value_cache, plan, scale, out=None):
        if fault == "raises":
            raise ValueError("lmiserve's paged attention kernel does not take softcap")
        return torch.zeros_like(query)

    monkeypatch.setattr(triton_attention, "paged_attention", broken)
    loaded = dataclasses.replace(tiny_model, model=generic_model("qwen3").to(DEVICE), max_context=256)
    with caplog.at_level("WARNING", logger=paged_generic.__name__):
        runner = paged_generic.PagedGenericRunner(loaded.model, eos_token_ids=[2], num_blocks=16, block_size=4)
    assert not isinstance(runner.attention, TritonBackend)
    assert "gathering" in caplog.text


def test_the_kernel_checks_itself_once_a_shape_before_the_fast_forward_takes_it(monkeypatch, caplog):
    """`self_check` runs the kernel on the model's shape and device against attention position by position:
    agreeing, the fast forward takes it; failing to run (a compile error on some GPU) or off the reference,
    the forward keeps the torch attention, with a warning."""
    assert triton_attention.self_check(3, 3, 64, 16, torch.float32, str(DEVICE)) is None
    assert triton_attention.self_check(2, 2, 32, 8, torch.float16, str(DEVICE)) is None
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    model = build(*ARCHS["llama"]).to(DEVICE)
    cfg = model.config
    real = triton_attention.paged_attention
    for fault in ("raises", "wrong"):

        def broken(query, key_cache, value_cache, plan, scale, out=None, fault=fault):
            if fault == "raises":
                raise RuntimeError("PTX compilation failed")
            return real(query, key_cache, value_cache, plan, scale * 2, out)

        monkeypatch.setattr(triton_attention, "paged_attention", broken)
        triton_attention.self_check.cache_clear()
        try:
            cache = PagedKVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, 16, model.dtype, DEVICE)
            with caplog.at_level("WARNING", logger=fast_llama.__name__):
                assert not FastLlama(model, cache, 256).triton
        finally:
            triton_attention.self_check.cache_clear()
    assert "PTX compilation failed" in caplog.text
    assert "off the reference" in caplog.text
