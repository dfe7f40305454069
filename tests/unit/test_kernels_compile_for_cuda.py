"""The quantized products' Triton kernels compile for the GPUs they serve, checked on a CPU (issue #39): every
candidate tile `fp8_gemv` and `int4_triton` measure at start, for Hopper (compute capability 9.0: the fp8
conversions; scales per channel and by blocks) and Ampere (8.0: the fp8 bytes widened), through Triton's NVIDIA
backend and ``ptxas`` (`helpers.cuda_compile`). A GPU session is rare: a kernel source a GPU's Triton cannot
compile would have every tile refused there and the slower product served, found only then. No tile may spill
registers."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import cuda_compile
from lmiserve.engine.model import fp8_gemv, int4_triton, kernel_choice

pytestmark = pytest.mark.skipif(not cuda_compile.available(), reason="needs Triton's NVIDIA backend (ptxas)")

HOPPER, AMPERE = 90, 80
BLOCK = 128  # the block-wise fp8 releases' blocks of inputs
INT4_GROUP = 128


def split(tile: kernel_choice.Tile) -> int:
    """`split_k_kernel.store_sums`'s SPLIT where the tile's K splits."""
    return 0 if tile.split_k == 1 else 2 if tile.adds_in_kernel else 1


def job(kernel: str, pointers: dict[str, str], constexprs: dict[str, Any], arch: int, tile: Any) -> dict[str, Any]:
    """A compile of `kernel` as a launch at a model's widths specializes it: its widths and strides multiples
    of 16."""
    return {
        "kernel": kernel,
        "pointers": pointers,
        "constexprs": constexprs,
        "aligned": ["N", "K", "stride_xm", "stride_ym", "k_split", "stride_ps", "stride_s"],
        "arch": arch,
        "num_warps": tile.num_warps,
        "num_stages": tile.num_stages,
    }


FP8 = "lmiserve.engine.model.fp8_gemv_kernel:fp8_gemv_kernel"
FP8_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16", "p_ptr": "*fp32", "c_ptr": "*i32"}
INT4 = "lmiserve.engine.model.int4_triton_kernel:int4_gemm_kernel"
INT4_POINTERS = {
    "x_ptr": "*bf16",
    "q_ptr": "*i32",
    "s_ptr": "*fp32",
    "z_ptr": "*fp32",
    "o_ptr": "*i32",
    "y_ptr": "*bf16",
    "p_ptr": "*fp32",
    "c_ptr": "*i32",
}


def cases() -> list[tuple[str, int, kernel_choice.Tile, dict[str, Any]]]:
    """(what, bucket, tile, job) for every candidate: fp8 per channel on Hopper (decode buckets: the GPU's own
    products serve more rows) and Ampere (every bucket), fp8 by blocks on Hopper (every bucket), int4 on both."""
    found = []
    for bucket, tiles in fp8_gemv.CANDIDATES.items():
        for tile in tiles:
            for what, arch, native, group in (
                ("fp8 hopper", HOPPER, True, 0),
                ("fp8 ampere", AMPERE, False, 0),
                ("fp8 blocks hopper", HOPPER, True, BLOCK),
            ):
                if what == "fp8 hopper" and bucket > fp8_gemv.MAX_ROWS:
                    continue
                constexprs = fp8_gemv.constants(tile, True, native, group, split(tile))
                found.append((what, bucket, tile, job(FP8, FP8_POINTERS, constexprs, arch, tile)))
    for bucket, tiles in int4_triton.CANDIDATES.items():
        for tile in {t.fitted(INT4_GROUP) for t in tiles}:
            for what, arch in (("int4 hopper", HOPPER), ("int4 ampere", AMPERE)):
                constexprs = int4_triton.constants(tile, INT4_GROUP, False, split(tile))
                found.append((what, bucket, tile, job(INT4, INT4_POINTERS, constexprs, arch, tile)))
    return found


@pytest.fixture(scope="module")
def compiled() -> list[tuple[str, int, kernel_choice.Tile, dict[str, Any]]]:
    found = cases()
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
    assert kinds == {"fp8 hopper", "fp8 ampere", "fp8 blocks hopper", "int4 hopper", "int4 ampere"}
    assert sum(1 for what, *_ in compiled if what == "fp8 hopper") >= 20


def test_no_tile_spills_registers(compiled: list[Any]) -> None:
    """Every candidate keeps its registers (a tile that spills reads its own stack besides the weight), on both
    GPUs, at a model's widths (`job`: compiled without them, Triton loads the weight a byte at a time)."""
    spilled = [
        f"{what} bucket {bucket} {tile}: {result['spilled']} bytes spilled ({result['registers']} registers)"
        for what, bucket, tile, result in compiled
        if result["spilled"]
    ]
    assert not spilled, "\n".join(spilled)
