"""The quantized products on a GPU (issue 39, item 2): time and error of one linear of an 8B shape in
bf16 (`F.linear`), fp8 (`quant_formats.Fp8Linear` as the engine runs it: `fp8_gemv`'s choice at up to 16
rows, else `torch._scaled_mm` with activations to fp8 per row), the fastest tile of `fp8_gemv`'s weight-only
Triton kernel (`fp8_gemv`, up to 16 rows; every row count on a GPU without fp8 products, A100 or A10G, where it
widens the bytes itself; on a GPU with them `fp8_gemv_widened` times that widening on the same tile), the
rows quantized to fp8 for cuBLAS's tensor-wise product (`fp8_w8a8`, up to 16 rows: the engine's third
candidate, its three kernels together; at one row of a weight of one scale, `fp8_w8a8_one_scale`: its two kernels,
cuBLAS applying both scales), block-wise fp8 (`fp8_block`: scales by blocks of 128 x 128, as Qwen3's
FP8 releases, on `fp8_gemv`'s kernel or the de-quantized product as the engine chooses at every row count) and
4-bit (`int4_triton.Int4TritonLinear`, groups of 128, on the tile the engine measures fastest for the row
bucket: `int4_tile`; GPTQ's act-order codes whole, `int4_act_order`, and a tensor-parallel rank's part of them, each
group padded to one size, `int4_act_order_rank`), compressed-tensors' 8-bit codes kept on a GPU
(`int8_weights.Int8WeightLinear`: `int8_w8a8` a scale a channel, its activations int8 as W8A8's are, `int8_w8a16`
groups of 128; `fp8_gemv`'s kernel, cuBLAS's
int8 product with the rows in int8 (`int8_w8a8`, W8A8 only) or the de-quantized product as the engine
chooses, `int8_tiles`; `int8_w8a8_rows` times the int8 rows' product alone), at a few row counts; on a GPU with fp8,
where `_scaled_mm`'s time goes (`fp8_variants`). Run on an H200 on 2026-11-29 (before the 4-bit kernel's
rewrite of 2026-11-30: benchmarks/results/gpu-check-2026-11-29-h200/round2/kernels.log; benchmarks/README.md
has the table).

    .venv/bin/python benchmarks/quantized_kernels.py [--rows 1,16,128] [--out DIR]   # CUDA
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/quantized_kernels.py --smoke      # CPU: checks it runs

Per shape (Llama-3-8B's q/o projection 4096x4096, gate+up 4096->28672, down 14336->4096) and row count:
the median time of `--iters` calls (CUDA events: eager, each call's launches included), the same call
replayed from a CUDA graph as the decode graphs run it (`graph_us`: the GPU's time alone), the bytes of
weights read per call and the bandwidth each makes, and the error against the bf16 product of the
de-quantized weight (max |diff| / max |ref|).
Prints a table; with --out writes ``quantized_kernels.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_gemv, fp8_w8a8, int4_triton, int8_w8a8, kernel_choice
from lmiserve.engine.model.fp8_ops import fp8_linear, rows_to_fp8
from lmiserve.engine.model.packed_codes import unpack_int8
from lmiserve.engine.model.quant_formats import (
    Fp8Linear,
    Int4Parts,
    fp8_module,
    fp8_scaled_mm_supported,
    int8_module,
    quantize_fp8,
)
from lmiserve.engine.model.quantize import quantize_weight
from lmiserve.engine.model.shard_quantized import cut_codes
from lmiserve.models.quant_pack import fp8_block_tensors, rtn_int4

SHAPES = {"qo_4096x4096": (4096, 4096), "gate_up_4096x28672": (28672, 4096), "down_14336x4096": (4096, 14336)}
SMOKE_SHAPES = {"smoke_256x128": (256, 128)}


def timed(fn: Callable[[], torch.Tensor], iters: int, cuda: bool) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_timed(fn: Callable[[], torch.Tensor], iters: int) -> float | None:
    """On CUDA, one call of `fn` as the decode graphs run it: `iters` calls captured in one CUDA graph and
    replayed 5 times, the replays' time over the calls (the GPU's time alone: no launches, no host;
    `kernel_choice.time_in_graph`, as the engine times its kernels); None where the capture fails."""
    try:
        return kernel_choice.time_in_graph(fn, torch.device("cuda", torch.cuda.current_device()), iters, replays=5)
    except Exception as exc:  # noqa: BLE001 - reported as not captured
        print(f"capture failed: {type(exc).__name__}: {exc}", flush=True)
        return None


def fp8_variants(
    x: torch.Tensor,
    fp8: Fp8Linear,
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    want: torch.Tensor,
) -> dict[str, tuple[Callable[[], torch.Tensor], int, torch.Tensor | None]]:
    """Where `Fp8Linear`'s time goes (issue 39: fp8 decoded at 0.74x bf16 on an H200): its activation
    quantization compiled (`fp8_compiled_quant`), and the product alone on activations quantized beforehand,
    with row-wise scales as `Fp8Linear` runs it (`fp8_gemm_rowwise`) and with one scale each
    (`fp8_gemm_tensorwise`, cuBLAS's fp8 path; its output is unscaled, so no error is reported)."""
    weight_bytes = fp8.weight.numel()
    rows = x.shape[0]
    xq, x_scale = rows_to_fp8(x.float())
    pad = (-rows) % 16
    xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
    x_scale = torch.nn.functional.pad(x_scale, (0, 0, 0, pad), value=1.0)
    one = torch.ones((), device=x.device)
    w, scales = fp8.weight, fp8.scales.view(1, -1)

    def compiled() -> torch.Tensor:
        return fp8_linear(x, fp8.weight, fp8.scales, quantize_rows)

    def rowwise() -> torch.Tensor:
        return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scales, out_dtype=torch.bfloat16)[:rows]

    def tensorwise() -> torch.Tensor:
        return torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)[:rows]

    return {
        "fp8_compiled_quant": (compiled, weight_bytes, want),
        "fp8_gemm_rowwise": (rowwise, weight_bytes, want),
        "fp8_gemm_tensorwise": (tensorwise, weight_bytes, None),
    }


def fastest_gemv_tile(
    x: torch.Tensor, fp8: Fp8Linear, iters: int, cuda: bool, times_us: dict[str, float]
) -> fp8_gemv.Config | None:
    """The fastest of `fp8_gemv.CANDIDATES` for `x`'s rows (replayed in a CUDA graph where one captures),
    None where none runs; each tile's microseconds written in `times_us` (the split tiles against the others)."""
    best: tuple[float, fp8_gemv.Config] | None = None
    for config in fp8_gemv.CANDIDATES[fp8_gemv.bucket(x.shape[0])]:

        def call(c: fp8_gemv.Config = config) -> torch.Tensor:
            return fp8_gemv.fp8_gemv(x, fp8.weight, fp8.scales, c)

        try:
            seconds = (graph_timed(call, iters) if cuda else None) or timed(call, iters if cuda else 1, cuda)
        except Exception as exc:  # noqa: BLE001 - a tile this GPU or Triton refuses: the others compete
            print(f"fp8_gemv {config} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        times_us[str(config)] = round(seconds * 1e6, 1)
        if best is None or seconds < best[0]:
            best = (seconds, config)
    return None if best is None else best[1]


def int8_layer(weight: torch.Tensor, group: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """`weight` as compressed-tensors' symmetric 8-bit codes (a scale a channel, `group` 0, with int8 activations as
    W8A8's; or a group of `group` inputs: each group's run quantized as a row), read as a checkpoint's are
    (`packed_codes.unpack_int8`) and kept on the GPU as the loader keeps them where bf16 would not fit
    (`int8_weights`)."""
    out, inputs = weight.shape
    q, scale = quantize_weight(weight.reshape(-1, inputs if group == 0 else group))
    stored = {"weight": q.reshape(out, inputs), "weight_scale": scale.reshape(out, -1)}
    parts = unpack_int8(stored, group, int8_rows=group == 0)
    return int8_module(parts, None, dtype, device, keep_codes=True)


def act_order_layers(
    weight: torch.Tensor, group: int, dtype: torch.dtype, device: torch.device
) -> dict[str, tuple[int4_triton.Int4TritonLinear, torch.Tensor, int]]:
    """GPTQ's act-order codes of `weight` (groups of `group` in a random order of the inputs) on the int4 kernel:
    whole (`int4_act_order`: the activations gathered in group order), and rank 1 of 2's part of its inputs, as a
    row-parallel linear's (`int4_act_order_rank`: each group's part padded to one size, `int4_triton.padded_layout`),
    each with its de-quantized weight and its first input."""
    inputs = weight.shape[1]
    g_idx = (torch.arange(inputs) // group)[torch.randperm(inputs, generator=torch.Generator().manual_seed(0))]
    codes, scale, zero = rtn_int4(weight, g_idx, inputs // group)
    whole = Int4Parts(codes.to(torch.uint8), scale.float(), zero, g_idx)
    half = cut_codes(whole, None, slice(inputs // 2, inputs))
    made = {}
    for kind, parts, first in (("int4_act_order", whole, 0), ("int4_act_order_rank", half, inputs // 2)):
        layer = int4_triton.Int4TritonLinear.from_parts(
            parts.codes, parts.scale, parts.zero, parts.g_idx, None, dtype, device
        )
        made[kind] = (layer, parts.dequantize().to(device, dtype), first)
    return made


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return round(((got.float() - want.float()).abs().max() / want.float().abs().max()).item(), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,128")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (fp8 via CPU _scaled_mm)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("needs a CUDA GPU (or --smoke on CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    int4_triton.MEASURED_ON_CPU = args.smoke  # the rehearsal measures the 4-bit tiles as a GPU does
    dtype = torch.bfloat16 if cuda else torch.float32
    results = []
    for name, (out, inputs) in (SHAPES if cuda else SMOKE_SHAPES).items():
        torch.manual_seed(0)
        weight = torch.randn(out, inputs) * 0.02
        group = 128
        g_idx = torch.arange(inputs) // group
        codes, scale, zero = rtn_int4(weight, g_idx, inputs // group)
        parts = Int4Parts(codes.to(torch.uint8), scale.float(), zero, g_idx)
        int4_dense = parts.dequantize().to(device, dtype)
        q, s = quantize_fp8(weight)
        fp8 = Fp8Linear(q.to(device), s.to(device), None)
        fp8_dense = fp8.dequantized().to(dtype)
        q1, s1 = quantize_fp8(weight, per_tensor=True)
        per_tensor = Fp8Linear(q1.to(device), s1.expand(out).contiguous().to(device), None)
        block = 128 if cuda else 64  # (the smoke shape's 128 inputs: two blocks)
        stored = fp8_block_tensors(weight, block)
        fp8_block = fp8_module(
            stored["weight"], stored["weight_scale_inv"], None, dtype, device, keep_fp8=True, block=(block, block)
        )
        block_dense = fp8_block.dequantized().to(dtype)
        int4 = int4_triton.Int4TritonLinear.from_parts(codes, scale.float(), zero, g_idx, None, dtype, device)
        act_order = act_order_layers(weight, 128 if cuda else 32, dtype, device)
        int8s = {kind: int8_layer(weight, g, dtype, device) for kind, g in (("int8_w8a8", 0), ("int8_w8a16", group))}
        int8_dense = {kind: layer.dequantized().to(dtype) for kind, layer in int8s.items()}
        dense = weight.to(device, dtype)
        # the activations' quantization compiled into fused kernels (one variant below)
        quantize_rows = torch.compile(rows_to_fp8, dynamic=False) if cuda else rows_to_fp8
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, inputs, device=device, dtype=dtype)
            row: dict[str, object] = {"shape": name, "rows": rows}
            kinds: dict[str, tuple[Callable[[], torch.Tensor], int, torch.Tensor | None]] = {
                "bf16": (lambda x=x, w=dense: torch.nn.functional.linear(x, w), out * inputs * 2, x @ dense.t()),
                "fp8": (lambda x=x, m=fp8: m(x), out * inputs, x @ fp8_dense.t()),
                "int4_triton": (lambda x=x, m=int4: m(x), out * inputs // 2, x @ int4_dense.t()),
            }
            for kind, (layer, part_dense, first) in act_order.items():  # (a rank's part: its own columns of x)
                own = x[:, first : first + layer.in_features].contiguous()
                stored = layer.weight.shape[1] * 4  # (bytes of codes a row, pads included)
                kinds[kind] = (lambda x=own, m=layer: m(x), out * stored, own @ part_dense.t())
            if fp8_gemv.available():
                kinds["fp8_block"] = (lambda x=x, m=fp8_block: m(x), out * inputs, x @ block_dense.t())
                for kind, layer in int8s.items():
                    kinds[kind] = (lambda x=x, m=layer: m(x), out * inputs, x @ int8_dense[kind].t())
                w8a8 = int8s["int8_w8a8"]
                if int8_w8a8.applies(w8a8.weight, w8a8.scales.scales, device):  # the rows in int8, whatever is chosen
                    rows_int8 = functools.partial(int8_w8a8.product, x, w8a8.weight, w8a8.scales.scales)
                    kinds["int8_w8a8_rows"] = (rows_int8, out * inputs, x @ int8_dense["int8_w8a8"].t())
            native = fp8_devices.native(device)
            if (rows <= fp8_gemv.MAX_ROWS or not native) and fp8_gemv.available():
                tiles_us: dict[str, float] = {}
                tile = fastest_gemv_tile(x, fp8, 20, cuda, tiles_us)
                row["fp8_gemv_tiles_us"] = tiles_us
                if tile is not None:
                    row["fp8_gemv_tile"] = str(tile)
                    gemv = functools.partial(fp8_gemv.fp8_gemv, x, fp8.weight, fp8.scales, tile)
                    kinds["fp8_gemv"] = (gemv, out * inputs, x @ fp8_dense.t())
                    if native:  # the bytes widened as an A100 or A10G does, on this GPU's tile
                        kinds["fp8_gemv_widened"] = (
                            functools.partial(gemv, widen=True),
                            out * inputs,
                            kinds["fp8_gemv"][2],
                        )
            if rows <= fp8_gemv.MAX_ROWS and fp8_w8a8.applies(fp8.weight, device):  # the engine's third candidate
                w8a8 = functools.partial(fp8_w8a8.product, x, fp8.weight, fp8.scales)
                kinds["fp8_w8a8"] = (w8a8, out * inputs, x @ fp8_dense.t())
                if rows == 1:  # a weight of one scale (quantize=fp8 on such a GPU): cuBLAS applies both scales
                    one = functools.partial(fp8_w8a8.product_one_scale, x, per_tensor.weight, per_tensor.scales)
                    kinds["fp8_w8a8_one_scale"] = (one, out * inputs, x @ per_tensor.dequantized().to(dtype).t())
            if cuda and fp8_scaled_mm_supported(device):
                kinds.update(fp8_variants(x, fp8, quantize_rows, x @ fp8_dense.t()))
            for kind, (fn, weight_bytes, want) in kinds.items():
                if (
                    kind.startswith("fp8")
                    and cuda
                    and not (native or torch.cuda.get_device_capability(device) >= (8, 0))
                ):
                    row[kind] = "not supported on this GPU (compute capability < 8.0)"
                    continue
                try:
                    seconds = timed(fn, args.iters if cuda else 2, cuda)
                except Exception as exc:  # noqa: BLE001 - a variant this torch or GPU refuses: said so
                    row[kind] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                    continue
                row[kind] = {
                    "us": round(seconds * 1e6, 1),
                    "GB_per_s": round(weight_bytes / seconds / 1e9, 1),
                    "error": error(fn(), want) if want is not None else None,
                }
                graphed = graph_timed(fn, 20) if cuda else None
                if graphed is not None:  # the GPU's time alone ("us" above: eager, its launches included)
                    graph_gbs = round(weight_bytes / graphed / 1e9, 1)
                    row[kind].update(graph_us=round(graphed * 1e6, 1), graph_GB_per_s=graph_gbs)
            key = (x.device, out, inputs, group, False, int4_triton.bucket(rows), dtype)
            tile = int4_triton.chosen().get(key, "unmeasured")  # the engine's choice (None: de-quantized slices)
            row["int4_tile"] = str(tile) if tile is not None else "de-quantized slices"
            row["int8_tiles"] = {
                ("groups" if k[5] else "channel, int8 rows" if k[8] else "channel"): (
                    str(v) if v else "the de-quantized product"
                )
                for k, v in fp8_gemv.chosen().items()
                if k[7] == torch.int8 and k[1:4] == (out, inputs, fp8_gemv.bucket(rows))
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "torch": torch.__version__,
        "fp8_gemv_chosen": {
            f"{k[1]}x{k[2]} rows {k[3]} {k[4]} {k[7]}{' blocks' if k[5] else ''}{' one scale' if k[6] else ''}"
            f"{' int8 rows' if k[8] else ''}": str(v)
            if v
            else ("the de-quantized product" if k[5] or k[7] == torch.int8 else "_scaled_mm")
            for k, v in fp8_gemv.chosen().items()
        },
        "int4_chosen": {
            f"{k[1]}x{k[2]} group {k[3]} rows {k[5]} {k[6]}": str(v) if v else "de-quantized slices"
            for k, v in int4_triton.chosen().items()
        },
        "results": results,
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "quantized_kernels.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
