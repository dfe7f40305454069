"""fp8 weights times a few rows on a GPU (issue #39: fp8 must decode faster than bf16): a Triton kernel that
reads the ``float8_e4m3fn`` weight once and widens it in registers (`fp8_gemv_kernel`), so a decode step of
1 to `MAX_ROWS` rows reads half of bf16's bytes and quantizes no activations.

Why: ``torch._scaled_mm`` (`fp8_ops`) needs the activations in fp8 too. At decode sizes that costs kernels
of its own (~20 us a product in a CUDA graph on an H200) and its row-wise product read 0.5-1.9 TB/s of
weights where bf16 read 2.4-3.9 TB/s: the 8B shape decoded at 0.74x bf16. A weight-only product has
neither cost; prefill (more rows) keeps ``_scaled_mm``, where fp8's tensor cores pay.

Which one runs is measured, not assumed (a kernel tuned on one GPU can lose on another): the first product
of each weight shape and row bucket (1, 2-4, 5-16 rows; `bucket`) outside a CUDA-graph capture times the
bucket's candidate tiles (`CANDIDATES`, some with K split between programs), where the GPU has fp8 products
`fp8_w8a8`'s (the rows in fp8 for cuBLAS's tensor-wise product; for one row of a weight with one scale,
`fp8_w8a8.ONE_SCALE`, two kernels) and the row-wise ``_scaled_mm`` on a random probe, each replayed in a
CUDA graph as the decode graphs run it, checks each tile against the de-quantized product
(`kernel_choice.pick`: a tile this GPU or Triton miscompiles is dropped, never served), and keeps the fastest,
logged once. The decode graphs' eager warm-up before each capture (cuda_graphs.py) is such a product, so the
graphs record the choice. The times are the GPU's alone (`kernel_choice.time_gpu`):
timed eagerly, a product of a few rows measures its launches, which do not tell the tiles apart.

A GPU without fp8 products (compute capability below 8.9: A100, A10G; `fp8_devices.native` false) has no ``_scaled_mm``
either: there the kernel widens the bytes itself (`fp8_gemv_kernel`'s doc) and serves every row count, prefill
too, with tensor-core tiles for more rows (buckets 64, 256 and 1024; `CANDIDATES`), measured against the weight
de-quantized a slice at a time (`dequantized_product`), which also serves where no tile passes. Whether an fp8
checkpoint keeps its fp8 weights on such a GPU or is de-quantized at load is `weights_kept_for`'s rule
(`weight_fit`: where bf16 would not fit; ``LMISERVE_USE_TRITON_FP8=1|0`` forces): the kernel has not yet run on
one.

Block-wise fp8 (Qwen3's and DeepSeek's ``-FP8`` releases: a scale a block of 128 x 128) takes the same rule on any
GPU where Triton runs, Hopper too: ``_scaled_mm``'s row-wise product has one scale a channel, so such weights run
this kernel at every row count (or the de-quantized product where it measures faster). Their scales are each
output row's ``[N, blocks]`` (`block_scales`: fused linears concatenate their rows as per-channel ones), the block's
inputs a power of two (`input_block` reads it from the shape); the kernel applies each block's scale to a tile's
sums, or to each weight where a tile spans several blocks.

`ENABLED` turns the kernel off (``_scaled_mm`` everywhere); `INTERPRETED_ON_CPU` lets the tests choose it
for CPU tensors under Triton's interpreter (tests/unit/test_fp8_gemv.py), and replacing `fp8_devices.native`
makes them widen as an Ampere GPU does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_w8a8, int8_w8a8, kernel_choice, weight_fit

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

log = logging.getLogger(__name__)

__all__ = [
    "CANDIDATES",
    "ENABLED",
    "MAX_ROWS",
    "USE_ON_CUDA",
    "Choice",
    "Config",
    "available",
    "block_scales",
    "bucket",
    "choose",
    "chosen",
    "dequantized_product",
    "dequantized_weight",
    "fp8_gemv",
    "input_block",
    "product",
    "scaled_mm_serves",
    "tiles_for",
    "to_scaled_mm",
    "weights_kept_for",
]

# more rows: ``_scaled_mm`` (the tensor cores' fp8 product pays), where the GPU has it; the decode rows, whose
# products `kernel_choice.pick` times in a CUDA graph
MAX_ROWS = kernel_choice.DECODE_ROWS
ENABLED = True
INTERPRETED_ON_CPU = False
SLICE = 1024  # outputs de-quantized at a time by `dequantized_product`
# fp8 checkpoints on a GPU without fp8 products (module doc): True (LMISERVE_USE_TRITON_FP8=1) fp8 weights on this
# kernel; False (=0) de-quantized at load; None (unset) kept where de-quantized they would not fit (`weight_fit`)
USE_ON_CUDA = kernel_choice.switch("LMISERVE_USE_TRITON_FP8")


Config = kernel_choice.Tile  # one tile of the kernel
# what a shape and row bucket runs on besides the product `choose` replaces (`fp8_w8a8.OneScale` is a RowsInFp8)
Choice = Config | fp8_w8a8.RowsInFp8 | int8_w8a8.RowsInInt8


def bucket(rows: int) -> int:
    """The row count a choice is measured at and kept for: 1, 4 (2-4 rows), 16 (5-16 rows), and where the GPU
    widens the bytes itself 64 (17-64), 256 (65-256) or 1024 (more)."""
    for size in (1, 4, 16, 64, 256):
        if rows <= size:
            return size
    return 1024


# the sum tiles keep at most 64 products a thread in registers (rows x outputs x inputs / threads); tiles are
# shared between buckets where they can serve both (Triton caches them). Decode rows also try: K split in 2-8 (a
# [4096 x 14336] down projection on 16-output tiles is 256 programs, too few to keep an H200's HBM busy: 1.2 TB/s
# measured), their sums added by each output tile's last program (one kernel; added after the kernel, a split
# costs two more kernels a product); each step's loads issued a step ahead (`prefetch`: Triton pipelines only
# the loads of its dots, so a per-row-sums program had one tile of bytes in flight); sums over the inputs taken
# once at the end of the loop (`late_sum`). Each compiles for Hopper and Ampere without spilling registers
# (tests/unit/test_kernels_compile_for_cuda.py)
CANDIDATES: dict[int, tuple[Config, ...]] = {
    1: (
        Config(False, 1, 16, 256),
        Config(False, 1, 32, 256),
        Config(False, 1, 16, 512),
        Config(True, 16, 32, 128),
        Config(False, 1, 16, 256, prefetch=True),
        Config(False, 1, 16, 512, prefetch=True),
        Config(False, 1, 16, 256, split_k=4, adds_in_kernel=True, prefetch=True),
        Config(False, 1, 16, 512, num_warps=8, split_k=4, adds_in_kernel=True, prefetch=True),
        Config(False, 1, 16, 512, num_warps=8, split_k=8, adds_in_kernel=True),
        Config(True, 16, 32, 128, split_k=4, adds_in_kernel=True),
        Config(False, 1, 16, 256, late_sum=True),
        Config(False, 1, 16, 256, num_warps=8, split_k=4, adds_in_kernel=True, late_sum=True, prefetch=True),
        Config(False, 1, 32, 256, num_warps=8, split_k=8, adds_in_kernel=True, late_sum=True),
    ),
    4: (
        Config(False, 4, 16, 128),
        Config(False, 4, 16, 256, num_warps=8),
        Config(True, 16, 32, 128),
        Config(True, 16, 32, 256),
        Config(False, 4, 16, 128, split_k=4, adds_in_kernel=True),
        Config(True, 16, 32, 128, split_k=4, adds_in_kernel=True),
        Config(False, 4, 16, 128, split_k=4, adds_in_kernel=True, prefetch=True),
        Config(False, 4, 16, 128, split_k=4, adds_in_kernel=True, late_sum=True),
    ),
    16: (
        Config(True, 16, 16, 128),
        Config(True, 16, 32, 128),
        Config(True, 16, 32, 256),
        Config(True, 16, 64, 128),
        Config(True, 16, 32, 128, split_k=4, adds_in_kernel=True),
        Config(True, 16, 32, 256, split_k=2, adds_in_kernel=True),
    ),
    # tensor-core tiles for the more rows that only a GPU without fp8 products gives this kernel
    64: (
        Config(True, 32, 64, 64),
        Config(True, 64, 64, 64),
        Config(True, 32, 128, 64),
        Config(True, 64, 128, 64),
    ),
    256: (
        Config(True, 64, 64, 64),
        Config(True, 64, 128, 64),
        Config(True, 128, 64, 64, num_warps=8),
        Config(True, 128, 128, 32, num_warps=8),
    ),
    1024: (
        Config(True, 64, 128, 64),
        Config(True, 128, 64, 64, num_warps=8),
        Config(True, 128, 128, 32, num_warps=8),
        Config(True, 128, 128, 64, num_warps=8),
    ),
}

# (device, N, K, bucket, dtype, blocks (0: per channel), one scale) -> a tile, `fp8_w8a8`'s product, None
_chosen: dict[tuple[Any, ...], Choice | None] = {}


def available() -> bool:
    return triton is not None


def weights_kept_for(model: torch.nn.Module, device: torch.device, name: str, blocks: bool = False) -> bool | None:
    """On a GPU without fp8 products where Triton runs (compute capability 8.0 to 8.8), or for block-wise scales
    (`blocks`) on any GPU where Triton runs, whether the fp8 linears of `model` (on the meta device in the compute
    dtype, or already on the GPU: a whole model's, or a tensor-parallel rank's) keep their fp8 weights on this
    kernel (`weight_fit.kept_for`), logged for `name`; None elsewhere (per-channel fp8 products where the GPU has
    them, de-quantized on a CPU)."""
    if not weight_fit.triton_gpu(device) or scaled_mm_serves(device, blocks):
        return None
    kept_as = (
        "fp8 weights (block-wise scales) on the Triton kernel"
        if blocks
        else "fp8 weights on the widening Triton kernel"
    )
    return weight_fit.kept_for(log, model, device, name, USE_ON_CUDA, "LMISERVE_USE_TRITON_FP8", kept_as)


@functools.cache
def _kernel() -> Any:
    from lmiserve.engine.model.fp8_gemv_kernel import fp8_gemv_kernel

    return triton.jit(fp8_gemv_kernel)


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, config: Config, widen: bool = False
) -> torch.Tensor:
    """``x @ (weight * scales).T`` in `x`'s dtype, for a 2-D `x` ``[M, K]``, a contiguous ``float8_e4m3fn``
    (or ``int8``: 8-bit integer codes, `int8_weights`) `weight` ``[N, K]`` and fp32 `scales`: ``[N]`` (one per
    output channel) or ``[N, blocks]`` (each row's scales by blocks of inputs, `input_block`). `widen`: the bytes
    widened as on a GPU without fp8 conversions even where the GPU has them (a benchmark times that path on a
    Hopper GPU)."""
    if triton is None:
        raise RuntimeError("the fp8 Triton kernel needs triton")
    x = x.contiguous()
    rows, inputs = x.shape
    native = fp8_devices.native(x.device) and not widen
    group = input_block(inputs, scales)

    def launch(
        y: torch.Tensor,
        parts: torch.Tensor,
        counters: torch.Tensor,
        grid: tuple[int, int, int],
        k_share: int,
        split: int,
    ) -> None:
        _kernel()[grid](
            x, weight.view(torch.uint8), scales, y, rows, weight.shape[0], inputs, x.stride(0), y.stride(0),
            k_share, parts, counters, parts.stride(0) if split else 0, scales.stride(0),
            EVEN_K=inputs % config.block_k == 0, USE_DOT=config.use_dot, NATIVE=native,
            INT8=weight.dtype == torch.int8,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP=group, SCALE_PER_TILE=group > 0 and group % config.block_k == 0, SPLIT=split,
            LATE_SUM=config.late_sum and not config.use_dot, PREFETCH=config.prefetch and not config.use_dot,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip

    return kernel_choice.split_k_product(config, x, weight, launch)


def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, choice: Choice) -> torch.Tensor:
    """``(x @ weight.T) * scales`` in `x`'s dtype on `choice`: a tile of this kernel, `fp8_w8a8`'s or `int8_w8a8`'s."""
    if isinstance(choice, Config):
        return fp8_gemv(x, weight, scales, choice)
    return choice.run(x, weight, scales)


def chosen() -> dict[tuple[Any, ...], Choice | None]:
    """The choices made so far (the GPU check reports them)."""
    return dict(_chosen)


def choose(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    other: Callable[[torch.Tensor], torch.Tensor],
    int8_rows: bool = False,
) -> Choice | None:
    """The kernel's tile for ``x @ weight.T``, or for decode rows where the GPU has fp8 products `fp8_w8a8`'s
    product, or with `int8_rows` (W8A8's int8 codes) `int8_w8a8`'s (`product` runs any; None: `other`, the row-wise
    ``_scaled_mm`` product or where the GPU has none the de-quantized one, runs), measured the first time a shape and
    row bucket comes (module doc); inside a CUDA-graph capture, an unmeasured shape gets `other` (nothing is timed)."""
    rows = x.shape[0]
    if not ENABLED or triton is None or not weight.is_contiguous():
        return None
    if not (x.is_cuda or INTERPRETED_ON_CPU) or (rows > MAX_ROWS and to_scaled_mm(weight, scales, x.device)):
        return None
    blocks = scales.shape[1] if scales.dim() == 2 else 0
    one = rows == 1 and not blocks and fp8_w8a8.applies(weight, x.device) and fp8_w8a8.one_scale(scales)
    key = (x.device, *weight.shape, bucket(rows), x.dtype, blocks, one, weight.dtype, int8_rows)
    if key in _chosen:
        return _chosen[key]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    try:
        choice = _measure(key, weight, scales, other)
    except Exception as exc:  # noqa: BLE001 - measuring failed (memory, the GPU): the product serves regardless
        log.warning(
            "measuring the %s Triton kernel for [%d x %d] failed (%s): %s serves",
            _what(weight),
            *weight.shape,
            exc,
            _other(weight, scales, x.device),
        )
        choice = None
    _chosen[key] = choice
    return choice


def _measure(
    key: tuple[Any, ...], weight: torch.Tensor, scales: torch.Tensor, other: Callable[[torch.Tensor], torch.Tensor]
) -> Choice | None:
    device, outputs, inputs, rows, dtype, blocks, one, _, int8_rows = key
    generator = torch.Generator(device=device).manual_seed(0)
    probe = torch.randn(rows, inputs, generator=generator, device=device).to(dtype)
    candidates: tuple[Choice, ...] = tiles_for(rows, weight, scales)
    if rows <= MAX_ROWS and not blocks and fp8_w8a8.applies(weight, device):
        candidates += (fp8_w8a8.ONE_SCALE, fp8_w8a8.W8A8) if one else (fp8_w8a8.W8A8,)
    if int8_rows and int8_w8a8.applies(weight, scales, device):
        candidates += (int8_w8a8.INT8_ROWS,)
    plain = _reference(probe, weight, scales)

    def want(choice: Choice) -> torch.Tensor:
        """The probe's product in fp32 as `choice` computes it: of the probe's rows as it quantizes them."""
        return plain if isinstance(choice, Config) else _reference(choice.quantized(probe.float()), weight, scales)

    return kernel_choice.pick(
        log,
        _what(weight),
        (outputs, inputs, rows),
        candidates,
        lambda choice: product(probe, weight, scales, choice),
        want,
        device,
        (_other(weight, scales, device), lambda: other(probe)),
    )


def tiles_for(bucket: int, weight: torch.Tensor, scales: torch.Tensor) -> tuple[Config, ...]:
    """The bucket's `CANDIDATES` for `weight` with `scales`: all of them, but for 8-bit integer codes by groups
    those that load a step ahead and add their splits in the kernel (they spill registers on Hopper there:
    tests/unit/test_kernels_compile_for_cuda.py)."""
    tiles = CANDIDATES[bucket]
    if weight.dtype == torch.int8 and scales.dim() == 2:
        return tuple(t for t in tiles if not (t.prefetch and t.adds_in_kernel))
    return tiles


def _what(weight: torch.Tensor) -> str:
    """The weights' kind, for the log lines: fp8, or int8 (8-bit integer codes)."""
    return "int8" if weight.dtype == torch.int8 else "fp8"


def _other(weight: torch.Tensor, scales: torch.Tensor, device: torch.device) -> str:
    """What serves where the kernel does not, for the log lines."""
    return "torch._scaled_mm" if to_scaled_mm(weight, scales, device) else "the de-quantized product"


def to_scaled_mm(weight: torch.Tensor, scales: torch.Tensor, device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` serves the products of `weight` with `scales` that this kernel does not
    (`scaled_mm_serves`): fp8 weights only (8-bit integer codes never: the de-quantized product serves)."""
    return weight.dtype == torch.float8_e4m3fn and scaled_mm_serves(device, scales.dim() == 2)


def scaled_mm_serves(device: torch.device, blocks: bool) -> bool:
    """Whether ``torch._scaled_mm`` serves the fp8 products this kernel does not, on `device` (a GPU with fp8
    products) for weights whose scales are per channel; block-wise scales (`blocks`) never go to it (its row-wise
    product takes one scale a channel): there the de-quantized product serves."""
    return fp8_devices.native(device) and not blocks


def input_block(inputs: int, scales: torch.Tensor) -> int:
    """The inputs of a block of block-wise `scales` ``[N, blocks]`` over `inputs` inputs (0: scales per channel,
    ``[N]``): the power of two that gives that many blocks (the loader keeps only such blocks: `block_scales`)."""
    if scales.dim() == 1:
        return 0
    return _power_of_2_over(-(-inputs // scales.shape[1]))


def _power_of_2_over(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_scales(scale: torch.Tensor, outputs: int, inputs: int, block: tuple[int, int]) -> torch.Tensor | None:
    """A block-wise fp8 checkpoint's `scale` ``[cdiv(outputs, rows a block), cdiv(inputs, inputs a block)]``
    (``weight_scale_inv``) as each output row's scales (``[outputs, blocks]`` fp32, what `fp8_gemv` reads: fused
    linears concatenate their rows), or ``[outputs]`` where one block spans the inputs; None where a block's
    inputs are not a power of two (`input_block` could not tell them from the shape: de-quantized at load)."""
    rows, width = block
    if width & (width - 1) or scale.shape[1] != -(-inputs // width):
        return None
    per_row = scale.float().repeat_interleave(rows, dim=0)[:outputs].contiguous()
    return per_row[:, 0].contiguous() if per_row.shape[1] == 1 else per_row


def dequantized_weight(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``weight * scales`` in fp32: per output channel, or each row's block scales over their inputs."""
    group = input_block(weight.shape[1], scales)
    if not group:
        return weight.float() * scales.float()[:, None]
    return weight.float() * scales.float().repeat_interleave(group, dim=1)[:, : weight.shape[1]]


def dequantized_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales).T`` in `x`'s dtype (`scales` per channel or by blocks, `fp8_gemv`), the weight
    de-quantized `SLICE` outputs at a time (no copy of a large weight in `x`'s dtype): where a GPU without fp8
    products, or a block-wise weight, has no tile of this kernel."""
    parts = []
    for start in range(0, weight.shape[0], SLICE):
        w = dequantized_weight(weight[start : start + SLICE], scales[start : start + SLICE])
        parts.append(x @ w.to(x.dtype).t())
    return torch.cat(parts, dim=1)


def _reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales).T`` in fp32 (`dequantized_product` of fp32 rows)."""
    return dequantized_product(x.float(), weight, scales)
