"""The engine's Triton kernels compile for the GPUs they serve, checked on a CPU (issue #39): every candidate tile
`fp8_gemv` and `int4_triton` measure at start, for Hopper (compute capability 9.0: the fp8 conversions; scales per
channel and by blocks) and Ampere (8.0: the fp8 bytes widened), and every other kernel (the fused element-wise
kernels, the fp8 activations', the seeded draw, the paged attention) as its wrapper launches it at the 8B shape's
widths (`helpers.cuda_compile.recording`), through Triton's NVIDIA backend and ``ptxas`` (`helpers.cuda_compile`).
A GPU session is rare: a kernel source a GPU's Triton cannot compile (the interpreter the other tests use runs
any Python) would have every tile refused there and the slower product served, or the engine fall back to torch,
found only then. No kernel may spill registers."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import cuda_compile
from lmiserve.engine.model import fp8_gemv, int4_triton, kernel_choice

pytestmark = pytest.mark.skipif(not cuda_compile.available(), reason="needs Triton's NVIDIA backend (ptxas)")

HOPPER, AMPERE = 90, 80
WIDTH = 4096  # a weight of the 8B shape: 4096 x 4096
BLOCK = 128  # the block-wise fp8 releases' blocks of inputs
INT4_GROUP = 128


def cases(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, kernel_choice.Tile, dict[str, Any]]]:
    """(what, bucket, tile, job) for every candidate, as `fp8_gemv` and `int4_triton` launch it on a weight of
    the 8B shape at the bucket's rows (`cuda_compile.recording`): fp8 per channel on Hopper (decode buckets: the
    GPU's own products serve more rows), fp8 widened as on Ampere (every bucket), fp8 by blocks on Hopper (every
    bucket), 8-bit integer codes by channel and by groups on Hopper (every bucket: they never go to the GPU's own
    products; their conversion is the same on Ampere; by groups the tiles `fp8_gemv.tiles_for` tries), int4 on both."""
    import torch

    fp8_launches = cuda_compile.recording(monkeypatch, fp8_gemv, "_kernel")
    int4_launches = cuda_compile.recording(monkeypatch, int4_triton, "_kernel")
    weight = torch.zeros(WIDTH, WIDTH, dtype=torch.float8_e4m3fn)
    int8_codes = torch.zeros(WIDTH, WIDTH, dtype=torch.int8)  # compressed-tensors' 8-bit codes (`int8_weights`)
    per_channel, by_blocks = torch.ones(WIDTH), torch.ones(WIDTH, WIDTH // BLOCK)
    codes = torch.zeros(WIDTH, WIDTH // 8, dtype=torch.int32)
    groups = torch.ones(WIDTH // INT4_GROUP, WIDTH)
    int4_parts = int4_triton.Int4Scales(groups, groups, None, INT4_GROUP)
    found = []
    for bucket, tiles in fp8_gemv.CANDIDATES.items():
        x = torch.zeros(bucket, WIDTH, dtype=torch.bfloat16)
        int8_groups = fp8_gemv.tiles_for(bucket, int8_codes, by_blocks)
        for tile in tiles:
            for what, arch, widen, scales, codes_of in (
                ("fp8 hopper", HOPPER, False, per_channel, weight),
                ("fp8 ampere", AMPERE, True, per_channel, weight),
                ("fp8 blocks hopper", HOPPER, False, by_blocks, weight),
                ("int8 hopper", HOPPER, False, per_channel, int8_codes),
                ("int8 groups hopper", HOPPER, False, by_blocks, int8_codes),
            ):
                if what == "fp8 hopper" and bucket > fp8_gemv.MAX_ROWS:
                    continue
                if what == "int8 groups hopper" and tile not in int8_groups:  # (never tried there)
                    continue
                fp8_gemv.fp8_gemv(x, codes_of, scales, tile, widen=widen)
                found.append((what, bucket, tile, cuda_compile.job_of(fp8_launches[-1], arch)))
    for bucket, tiles in int4_triton.CANDIDATES.items():
        x = torch.zeros(bucket, WIDTH, dtype=torch.bfloat16)
        for tile in {t.fitted(INT4_GROUP) for t in tiles}:
            int4_triton.int4_gemm(x, codes, int4_parts, tile)
            for what, arch in (("int4 hopper", HOPPER), ("int4 ampere", AMPERE)):
                found.append((what, bucket, tile, cuda_compile.job_of(int4_launches[-1], arch)))
    return found


@pytest.fixture(scope="module")
def compiled() -> list[tuple[str, int, kernel_choice.Tile, dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        found = cases(monkeypatch)
    results = cuda_compile.compile_all([j for *_, j in found])
    return [(what, bucket, tile, result) for (what, bucket, tile, _), result in zip(found, results, strict=True)]


def test_every_candidate_tile_compiles_for_hopper_and_ampere(compiled: list[Any]) -> None:
    failed = [
        f"{what} bucket {bucket} {tile}: {result['error']}"
        for what, bucket, tile, result in compiled
        if result["error"]
    ]
    assert not failed, "\n".join(failed)
    kinds = {what for what, *_ in compiled}
    assert kinds == {
        "fp8 hopper",
        "fp8 ampere",
        "fp8 blocks hopper",
        "int8 hopper",
        "int8 groups hopper",
        "int4 hopper",
        "int4 ampere",
    }
    assert sum(1 for what, *_ in compiled if what == "fp8 hopper") >= 20


def test_no_tile_spills_registers(compiled: list[Any]) -> None:
    """Every candidate keeps its registers (a tile that spills reads its own stack besides the weight), on both
    GPUs, at a model's widths (`cuda_compile.job_of`: compiled without them, Triton loads the weight a byte at a time)."""
    spilled = [
        f"{what} bucket {bucket} {tile}: {result['spilled']} bytes spilled ({result['registers']} registers)"
        for what, bucket, tile, result in compiled
        if result["spilled"]
    ]
    assert not spilled, "\n".join(spilled)


# Llama-3.1-8B's widths: hidden 4096, MLP 14336, 32 query heads and 8 kv heads of 128
LAYER = {"hidden": 4096, "intermediate": 14336, "rotated_heads": 40, "v_heads": 8, "head_dim": 128, "eps": 1e-5}


def other_launches(monkeypatch: pytest.MonkeyPatch, native: bool) -> list[cuda_compile.Launch]:
    """The other Triton kernels as their wrappers launch them at the 8B shape's widths on a GPU with fp8
    conversions (`native`) or without (an A100): the fused element-wise kernels of a layer (`fused_choice`'s
    fused work, bf16, 1 and 16 rows, the rotation storing the keys and values in a bf16 cache, and in an e4m3 one,
    Qwen3's heads normed first; the norm and SiLU writing a row in fp8 too; the rotation alone), the fp8 activations' quantization
    and scaling (`fp8_w8a8`), W8A8's rows in int8 (`int8_w8a8`), the seeded
    draw over Llama 3's vocabulary, and the paged attention's (`triton_ops.self_check`'s launches: a decode row,
    a chunk after a prefix, a prompt) over a bf16 cache and over e4m3 and e5m2 caches, and a decode graph's
    step (each row a tile: padding rows' zeros written by the kernel; its rows in fp8 too). (`fp8_w8a8` and the
    attention's rows in fp8 only where
    the GPU has fp8 conversions: elsewhere it never serves.)"""
    import torch

    from lmiserve.engine import fp8_devices
    from lmiserve.engine.attention import triton_ops
    from lmiserve.engine.attention.backend_base import KvStore
    from lmiserve.engine.model import fp8_w8a8, fused_choice, fused_norm, int8_w8a8
    from lmiserve.engine.runner import seeded_draw

    monkeypatch.setattr(fp8_devices, "native", lambda device: native)
    launches = cuda_compile.recording(monkeypatch, fused_norm, "_kernels")
    launches_w8a8 = cuda_compile.recording(monkeypatch, fp8_w8a8, "_kernels")
    launches_draw = cuda_compile.recording(monkeypatch, seeded_draw, "_kernel")
    launches_attention = cuda_compile.recording(monkeypatch, triton_ops, "_kernel")
    shape = fused_choice.LayerShape(**LAYER)
    for rows in (1, 16):
        fused_choice._fused(shape, fused_choice._inputs(shape, torch.bfloat16, torch.device("cpu"), rows))()
    weight = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn)
    if native:  # (only there: `fp8_w8a8.applies`; an A100 has neither fp8 conversions nor fp8 products)
        fp8_w8a8.product(torch.randn(1, 4096, dtype=torch.bfloat16), weight, torch.ones(4096))
        row, norm = torch.randn(1, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
        fused_norm.add_rms_norm(row, row, norm, 1e-5, fp8_rows=True)  # the norm writing its row in fp8 too
        fused_norm.silu_mul(torch.randn(1, 2 * 14336, dtype=torch.bfloat16), 14336, fp8_rows=True)  # and SiLU's
    codes = torch.zeros(4096, 4096, dtype=torch.int8)  # W8A8's rows in int8 (any GPU from compute capability 8.0)
    int8_w8a8.product(torch.randn(1, 4096, dtype=torch.bfloat16), codes, torch.ones(4096))
    qkv, cos = torch.randn(1, 48 * 128, dtype=torch.bfloat16), torch.ones(1, 128, dtype=torch.bfloat16)
    fused_norm.rope(qkv, cos, cos, 40, 128)  # (the rotation alone: a cache the fused store does not serve)
    for cache in (torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.float8_e4m3fn)):
        fused_norm.rope_store(qkv, cos, cos, 32, 8, KvStore(cache, cache, torch.arange(8), (1.0, 1.0), 1))
    qwen3 = (torch.ones(40, 128, dtype=torch.bfloat16), 1e-6)  # (Qwen3's heads' norms too)
    fused_norm.rope_store(qkv, cos, cos, 32, 8, KvStore(cache, cache, torch.arange(8), (1.0, 1.0), 1), qwen3)
    probs = torch.full((4, 128256), 1 / 128256)
    seeded_draw.draw_keyed(probs, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    for kv_dtype in (None, torch.float8_e4m3fn, torch.float8_e5m2):
        triton_ops.self_check.__wrapped__(8, 4, 128, 16, torch.bfloat16, "cpu", kv_dtype)
    rows, cache = torch.arange(4), torch.zeros(2, 8, 16, 128, dtype=torch.bfloat16)  # a decode graph's plan
    at, table = torch.zeros(4, dtype=torch.int64), torch.zeros(4, 1, dtype=torch.int32)
    plan = triton_ops.StepTiles(rows, rows, torch.tensor([1, 1, 0, 0]), at, table, at, 1, 4, 4, rows_tiled=True)
    triton_ops.paged_attention(torch.randn(4, 32, 128, dtype=torch.bfloat16), cache, cache, plan, 0.1)
    if native:  # the step's output rows in fp8 too, for o's product (`fused_norm.attend`)
        q8, scales = fp8_w8a8.row_buffers(4, 32 * 128, torch.device("cpu"))
        done = torch.zeros(4, dtype=torch.int32)
        triton_ops.paged_attention(
            torch.randn(4, 32, 128, dtype=torch.bfloat16), cache, cache, plan, 0.1, fp8_rows=(q8, scales, done)
        )
    every = launches + launches_w8a8 + launches_draw + launches_attention
    made = {launch.kernel.__name__ for launch in every}
    assert made == {"add_rms_norm_kernel", "silu_mul_kernel", "rope_store_kernel", "draw_kernel"} | {
        "paged_attention_kernel",
        "quantize_rows_kernel",
        "scale_rows_kernel",
    }
    int8 = {launch.kwargs["INT8"] for launch in launches_w8a8 if "INT8" in launch.kwargs}
    assert int8 == ({False, True} if native else {True})  # fp8 rows where the GPU has fp8; W8A8's int8 rows on any
    assert any(launch.kwargs["QUANT"] for launch in launches if "QUANT" in launch.kwargs) == native
    assert {launch.kwargs["FP8"] for launch in launches if "FP8" in launch.kwargs} == {False, True}  # (any GPU)
    assert any(launch.kwargs.get("HEAD_NORM") for launch in launches)
    kv = {launch.kwargs.get("KV_WIDEN") for launch in launches_attention if launch.kwargs["KV_CAST"]}
    assert kv == ({0} if native else {1, 2})  # fp8 caches (all the cast ones here): the GPU's conversions, or widened
    assert any(launch.kwargs["ZERO_EMPTY"] for launch in launches_attention)  # (a padding row's zeros written)
    assert any(launch.kwargs["FP8_ROWS"] for launch in launches_attention) == native
    return every


@pytest.mark.parametrize("arch", [HOPPER, AMPERE], ids=["hopper", "ampere"])
def test_the_other_kernels_compile_as_their_wrappers_launch_them(monkeypatch: pytest.MonkeyPatch, arch: int) -> None:
    """Every other Triton kernel of the engine, with the arguments its wrapper passes (`other_launches`): each
    compiles, none spills."""
    launches = other_launches(monkeypatch, native=arch >= 89)
    assert_compiled(launches, arch)


# Qwen3-30B-A3B's experts: 128 of them, hidden 2048, 768 inputs to down_proj, 8 a token
EXPERTS = {"experts": 128, "hidden": 2048, "intermediate": 768, "top_k": 8}


@pytest.mark.parametrize("arch", [HOPPER, AMPERE], ids=["hopper", "ampere"])
def test_the_fp8_experts_kernel_compiles_as_its_wrapper_launches_it(monkeypatch: pytest.MonkeyPatch, arch: int) -> None:
    """`fp8_experts`' grouped product at Qwen3-30B-A3B's widths, as a decode step of one and of 16 tokens and a
    prompt of 2048 launch it (16 rows a tile, then 64), gate/up's and down's products, scales per channel and by
    blocks of 128 inputs, converting fp8 (Hopper) or widening it (Ampere), and int8 codes (`int8_experts`): each
    compiles, none spills."""
    import torch

    from lmiserve.engine import fp8_devices
    from lmiserve.engine.model import fp8_experts

    monkeypatch.setattr(fp8_devices, "native", lambda device: arch >= 89)
    monkeypatch.setattr(fp8_experts, "INTERPRETED_ON_CPU", True)  # (the wrapper's CPU tensors go to the kernel)
    launches = cuda_compile.recording(monkeypatch, fp8_experts, "_kernel")
    e, hidden, inter = EXPERTS["experts"], EXPERTS["hidden"], EXPERTS["intermediate"]
    for outputs, inputs in ((2 * inter, hidden), (hidden, inter)):
        for dtype in (torch.float8_e4m3fn, torch.int8):
            weight = torch.empty(e, outputs, inputs, dtype=dtype)
            for scales in (torch.ones(e, outputs), torch.ones(e, outputs, inputs // BLOCK)):
                for tokens in (1, 16, 2048):
                    rows = tokens * EXPERTS["top_k"]
                    counts = torch.full((e,), rows // e) + (torch.arange(e) < rows % e)
                    x = torch.zeros(rows, inputs, dtype=torch.bfloat16)
                    fp8_experts.grouped_product(x, weight, scales, counts)
    assert {launch.kwargs["BLOCK_M"] for launch in launches} == {16, 64}
    assert {launch.kwargs["GROUP"] for launch in launches} == {0, BLOCK}
    assert {launch.kwargs["NATIVE"] for launch in launches} == {arch >= 89}
    assert {launch.kwargs["INT8"] for launch in launches} == {False, True}
    assert_compiled(launches, arch)


@pytest.mark.parametrize("arch", [HOPPER, AMPERE], ids=["hopper", "ampere"])
def test_the_int4_experts_kernel_compiles_as_its_wrapper_launches_it(
    monkeypatch: pytest.MonkeyPatch, arch: int
) -> None:
    """`int4_experts`' grouped product at Qwen3-30B-A3B's widths, as a decode step of one and of 16 tokens and a
    prompt of 2048 launch it (16 rows a tile, then 64), gate/up's and down's products, groups of 128 inputs (AWQ's
    and GPTQ's, with and without act-order) and of 32: each compiles, none spills."""
    import torch

    from lmiserve.engine.model import int4_experts

    monkeypatch.setattr(int4_experts, "INTERPRETED_ON_CPU", True)  # (the wrapper's CPU tensors go to the kernel)
    launches = cuda_compile.recording(monkeypatch, int4_experts, "_kernel")
    e, hidden, inter = EXPERTS["experts"], EXPERTS["hidden"], EXPERTS["intermediate"]
    for outputs, inputs in ((2 * inter, hidden), (hidden, inter)):
        words = torch.empty(e, outputs, inputs // 8, dtype=torch.int32)
        for group in (INT4_GROUP, 32):
            scales = torch.ones(e, inputs // group, outputs)
            for tokens in (1, 16, 2048):
                rows = tokens * EXPERTS["top_k"]
                counts = torch.full((e,), rows // e) + (torch.arange(e) < rows % e)
                x = torch.zeros(rows, inputs, dtype=torch.bfloat16)
                int4_experts.grouped_product(x, words, scales, scales, counts)
                if group == INT4_GROUP:  # (GPTQ's act-order: each expert's order of the rows' columns)
                    order = torch.zeros(e, inputs, dtype=torch.int32)
                    int4_experts.grouped_product(x, words, scales, scales, counts, order)
    assert {launch.kwargs["BLOCK_M"] for launch in launches} == {16, 64}
    assert {launch.kwargs["BLOCK_K"] for launch in launches} == {128, 64, 32}  # (64: act-order prompts)
    assert {launch.kwargs["HAS_ORDER"] for launch in launches} == {False, True}
    assert_compiled(launches, arch)


@pytest.mark.parametrize("arch", [HOPPER, AMPERE], ids=["hopper", "ampere"])
def test_the_mxfp4_experts_kernel_compiles_as_its_wrapper_launches_it(
    monkeypatch: pytest.MonkeyPatch, arch: int
) -> None:
    """`mxfp4_experts`' grouped product at gpt-oss's widths (hidden and intermediate 2880: 64 inputs a step; 32
    experts, 4 a token), as a decode step of one and of 16 tokens and a prompt of 2048 launch it, gate/up's and
    down's products, and at widths of 32 inputs a step: each compiles, none spills."""
    import torch

    from lmiserve.engine.model import mxfp4_experts

    monkeypatch.setattr(mxfp4_experts, "INTERPRETED_ON_CPU", True)  # (the wrapper's CPU tensors go to the kernel)
    launches = cuda_compile.recording(monkeypatch, mxfp4_experts, "_kernel")
    e, width = 32, 2880
    for outputs, inputs in ((2 * width, width), (width, width), (width, 2 * width - 32)):
        blocks = torch.zeros(e, outputs, inputs // 2, dtype=torch.uint8)
        scales = torch.full((e, outputs, inputs // 32), 127, dtype=torch.uint8)
        for tokens in (1, 16, 2048):
            rows = tokens * 4
            counts = torch.full((e,), rows // e) + (torch.arange(e) < rows % e)
            mxfp4_experts.grouped_product(torch.zeros(rows, inputs, dtype=torch.bfloat16), blocks, scales, counts)
    assert {launch.kwargs["BLOCK_M"] for launch in launches} == {16, 64}
    assert {launch.kwargs["BLOCK_K"] for launch in launches} == {64, 32}
    assert_compiled(launches, arch)


def assert_compiled(launches: list[Any], arch: int) -> None:
    """Every launch in `launches` compiles for `arch` (``ptxas`` included) without spilling registers; else the
    failures, each with its kernel and constexprs."""
    results = cuda_compile.compile_all([cuda_compile.job_of(launch, arch) for launch in launches])
    failed = [
        f"{launch.kernel.__name__} {cuda_compile.job_of(launch, arch)['constexprs']}: "
        f"{result['error'] or str(result['spilled']) + ' bytes spilled'}"
        for launch, result in zip(launches, results, strict=True)
        if result["error"] or result["spilled"]
    ]
    assert not failed, "\n".join(failed)
