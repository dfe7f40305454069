"""A mixture of experts' fp8, 8-bit and 4-bit experts on a GPU (issue 39, item 2): time and error of one experts
layer of Qwen3-30B-A3B's shape (128 experts, 8 a token, hidden 2048, 768 inputs to down_proj) in bf16 (transformers'
grouped forward, `torch._grouped_mm`: what the engine runs where the experts are de-quantized), kept fp8
(`engine/model/fp8_experts.py`'s Triton kernel: a scale a channel, by blocks of 128 as Qwen3-30B-A3B-FP8 stores them,
and widened as an A100 does on this GPU), kept as 8-bit integer codes (`engine/model/int8_experts.py`'s, on the fp8
kernel: a scale a group of 128 inputs, as Qwen's GPTQ-Int8 releases store them), kept 4-bit
(`engine/model/int4_experts.py`'s: codes with a scale and a zero a group of 128 inputs, as Qwen3-30B-A3B's AWQ and
GPTQ releases store them) and kept MXFP4 (`engine/model/mxfp4_experts.py`'s: 4-bit floats and a power of two a block
of 32, gpt-oss's format, on this layer's shape), at a few token counts: decode steps (1, 16, 64 tokens) and a
prompt's chunk (2048).

    .venv/bin/python benchmarks/fp8_experts.py [--tokens 1,16,64,2048] [--out DIR]   # CUDA
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/fp8_experts.py --smoke            # CPU: checks it runs
    .venv/bin/python benchmarks/fp8_experts.py --cpu [--experts 64] [--out DIR]      # the CPU's kernels
    .venv/bin/python benchmarks/fp8_experts.py --cpu --shape gpt-oss-20b --formats mxfp4 --tokens 1,4,16,64

``--cpu``: the same layer on a CPU in fp32 (the server's dtype there), its experts kept on the CPU's q8 and q4
kernels (`engine/model/cpu_experts.py`: fp8 by channel and by blocks, 8-bit codes, MXFP4 on the f4 kernel, 4-bit
codes) against transformers' grouped forward over the de-quantized fp32 weights (what the CPU ran before
2026-12-07), timed eagerly with the process's threads; `--experts` of them (at most 64 by default: the layer's
per-expert shape and top k, in less memory than 128 experts' five fp32 copies). `--shape gpt-oss-20b`: gpt-oss-20b's
experts layer (32 experts, top 4, 2880 by 2880; its biases and clamped activation left out), `--formats` the kept
formats timed (each holds a de-quantized fp32 copy too).

Per token count: the median time of `--iters` calls replayed from a CUDA graph (as the decode graphs run them: the
GPU's time alone; eager where the capture fails), the bytes of the experts hit (each routed expert's weights, read
once) and the bandwidth that makes, the error against the bf16 layer of the de-quantized weights (max |diff| / max
|ref|), and `over_bf16` (bf16's time over this one's: above 1, the fp8 experts are faster). Prints each row; with
--out writes ``fp8_experts.json``. The engine keeps quantized experts only where de-quantized they would not fit
(`fp8_experts.kept_for`, `int8_experts.kept_for`, `int4_experts.kept_for`); these figures say whether to keep them
always.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from quantized_kernels import graph_timed  # benchmarks/quantized_kernels.py: the script's folder is on sys.path
from quantized_kernels import timed as eager_timed

from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_experts, fp8_gemv, int4_experts, int4_triton, mxfp4_experts
from lmiserve.engine.model.fp8_ops import quantize_fp8
from lmiserve.models.quant_pack import fp8_block_tensors, rtn_int4

SHAPES = {
    "qwen3-30b-a3b": {"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768},
    "gpt-oss-20b": {"experts": 32, "top_k": 4, "hidden": 2880, "intermediate": 2880},  # (its biases and gate left out)
}
SMOKE = {"experts": 8, "top_k": 2, "hidden": 128, "intermediate": 64}
BLOCK = 128
FORMATS = ("fp8_channel", "fp8_block", "int4", "int8", "mxfp4")


def experts_module(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Qwen3-MoE's experts module of `shape`, random weights (std 0.02), grouped products (transformers')."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=shape["hidden"], moe_intermediate_size=shape["intermediate"], num_experts=shape["experts"]
    )
    config._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module.to(device, dtype)


def fp8_twin(module: torch.nn.Module, block: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`module`'s experts kept fp8 (`fp8_experts.keep`; on a CPU its q8 kernel's): a scale a channel, or by blocks of
    `block` x `block` (`block` 0: a channel's); and the module of the same de-quantized weights in `module`'s dtype
    (the reference)."""
    import copy

    kept, dense = copy.deepcopy(module), copy.deepcopy(module)
    weights = {}
    for kind in ("gate_up_proj", "down_proj"):
        full = getattr(module, kind).detach().float()
        if block:  # (each row's scales by blocks of inputs, as the loader keeps them: `fp8_gemv.block_scales`)
            made = [fp8_block_tensors(matrix.cpu(), block) for matrix in full]
            rows = [fp8_gemv.block_scales(m["weight_scale_inv"], *m["weight"].shape, (block, block)) for m in made]
            q, scales = torch.stack([m["weight"] for m in made]), torch.stack([cast(torch.Tensor, r) for r in rows])
        else:
            pairs = [quantize_fp8(matrix) for matrix in full]
            q, scales = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        q, scales = q.to(full.device), scales.to(full.device)
        weights[kind] = (q, scales)
        dequantized = torch.stack([fp8_gemv.dequantized_weight(w, s) for w, s in zip(q, scales, strict=True)])
        setattr(dense, kind, torch.nn.Parameter(dequantized.to(full.dtype), requires_grad=False))
    fp8_experts.keep(kept, weights)
    return kept, dense


def int8_twin(module: torch.nn.Module, group: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`module`'s experts kept as 8-bit codes (`engine/model/int8_experts.py`, on `fp8_experts`' kernel): symmetric
    codes with a scale a group of `group` inputs (each group's largest magnitude over 127, as GPTQ-Int8 stores
    them); and the bf16 module of the same de-quantized weights (the reference)."""
    import copy

    kept, dense = copy.deepcopy(module), copy.deepcopy(module)
    weights = {}
    for kind in ("gate_up_proj", "down_proj"):
        full = getattr(module, kind).detach()
        experts, outputs, _ = full.shape
        scales = (full.float().abs().reshape(experts, outputs, -1, group).amax(-1) / 127).clamp(min=1e-8)
        codes = torch.round(full.float() / scales.repeat_interleave(group, -1)).clamp(-128, 127).to(torch.int8)
        weights[kind] = (codes, scales)
        dequantized = codes.float() * scales.repeat_interleave(group, -1)
        setattr(dense, kind, torch.nn.Parameter(dequantized.to(full.dtype), requires_grad=False))
    fp8_experts.keep(kept, weights)
    return kept, dense


def int4_twin(module: torch.nn.Module, group: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`module`'s experts kept 4-bit (`int4_experts.keep`): each expert's matrices rounded to 4-bit codes with a
    scale and a zero a group of `group` inputs (`quant_pack.rtn_int4`, AutoAWQ's rounding); and the bf16 module of
    the same de-quantized weights (the reference)."""
    import copy

    kept, dense = copy.deepcopy(module), copy.deepcopy(module)
    weights = {}
    for kind in ("gate_up_proj", "down_proj"):
        full = getattr(module, kind).detach().float()
        g_idx = torch.arange(full.shape[2], device=full.device) // group
        made = [rtn_int4(matrix, g_idx, full.shape[2] // group, include_zero=False) for matrix in full]
        words = torch.stack([int4_triton.pack_nibbles(codes.reshape(codes.shape[0], -1, 8)) for codes, _, _ in made])
        scales = torch.stack([scale.float().t() for _, scale, _ in made])
        zeros = torch.stack([zero.float().t() for _, _, zero in made])
        weights[kind] = (words, scales, zeros)
        dequantized = torch.stack([int4_experts.dequantized_weight(*parts) for parts in zip(words, scales, zeros)])
        setattr(dense, kind, torch.nn.Parameter(dequantized.to(full.dtype), requires_grad=False))
    int4_experts.keep(kept, weights)
    return kept, dense


def mxfp4_twin(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`module`'s experts kept MXFP4 (`mxfp4_experts.keep`, as gpt-oss's are; on a CPU on its f4
    kernel): each block of 32 inputs a power of two (the block's largest magnitude over 6, rounded up) and each value
    the nearest 4-bit float; and the module of the same de-quantized weights in `module`'s dtype (the reference)."""
    import copy

    kept, dense = copy.deepcopy(module), copy.deepcopy(module)
    table = torch.tensor(mxfp4_experts.FP4[:8])
    weights = {}
    for kind in ("gate_up_proj", "down_proj"):
        full = getattr(module, kind).detach()
        experts, outputs, inputs = full.shape
        blocks = torch.empty(experts, outputs, inputs // 2, dtype=torch.uint8)
        scales = torch.empty(experts, outputs, inputs // 32, dtype=torch.uint8)
        dequantized = torch.empty(experts, outputs, inputs, dtype=full.dtype, device=full.device)
        for e in range(experts):  # (an expert at a time: the nearest-value search takes 8 floats a weight)
            blocked = full[e].float().cpu().reshape(outputs, inputs // 32, 32)
            powers = torch.ceil(torch.log2(blocked.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
            scaled = blocked / torch.exp2(powers)[..., None]
            codes = (scaled.abs()[..., None] - table).abs().argmin(-1) + 8 * (scaled < 0)  # (the sign: code + 8)
            codes = codes.reshape(outputs, inputs)
            blocks[e] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
            scales[e] = (powers + 127).to(torch.uint8)
            dequantized[e] = mxfp4_experts.dequantized_weight(blocks[e], scales[e]).to(full.device, full.dtype)
        weights[kind] = (blocks, scales)
        setattr(dense, kind, torch.nn.Parameter(dequantized, requires_grad=False))
    device = module.gate_up_proj.device
    mxfp4_experts.keep(kept, {kind: (b.to(device), s.to(device)) for kind, (b, s) in weights.items()})
    return kept, dense


def held_bytes(experts: torch.nn.Module) -> int:
    """The bytes of `experts`' matrices as it holds them: float parameters, or a kept format's codes, scales, zeros
    and orders (`grouped_experts.keep`'s attributes)."""
    held = [v for v in vars(experts).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*held, *experts.parameters()])


def timed(fn: Callable[[], torch.Tensor], iters: int, cuda: bool) -> float:
    """One call's seconds: replayed from a CUDA graph on a GPU, else (or where the capture fails) eagerly
    (`quantized_kernels`' timers)."""
    return (graph_timed(fn, iters) if cuda else None) or eager_timed(fn, iters, cuda)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,64,2048")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a tiny layer on a CPU, the kernel interpreted")
    parser.add_argument("--cpu", action="store_true", help="on a CPU in fp32: the CPU's kernels (cpu_experts)")
    parser.add_argument("--experts", type=int, default=None, help="the layer's experts (--cpu's default: 64)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="the layer's shape")
    parser.add_argument("--formats", default=",".join(FORMATS), help="the kept formats timed, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    unknown = sorted(set(args.formats.split(",")) - set(FORMATS))
    if unknown:
        parser.error(f"--formats: unknown {', '.join(unknown)} (known: {', '.join(FORMATS)})")
    cuda = torch.cuda.is_available() and not args.smoke and not args.cpu
    if not cuda and not args.smoke and not args.cpu:
        raise SystemExit("needs a CUDA GPU (or --cpu, or --smoke on CPU under TRITON_INTERPRET=1)")
    fp8_experts.INTERPRETED_ON_CPU = int4_experts.INTERPRETED_ON_CPU = mxfp4_experts.INTERPRETED_ON_CPU = args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32 if args.cpu else torch.float16  # (the interpreter: no bf16 dot)
    base = "fp32" if args.cpu else "bf16"  # (the de-quantized layer's key)
    shape = {**(SMOKE if args.smoke else SHAPES[args.shape])}
    shape["experts"] = args.experts or (min(64, shape["experts"]) if args.cpu else shape["experts"])
    iters = 2 if args.smoke else args.iters  # (the smoke run checks that it runs; the interpreter is slow)
    torch.manual_seed(0)
    bf16 = experts_module(shape, dtype, device)
    group = 32 if args.smoke else BLOCK
    twins = {
        "fp8_channel": lambda: fp8_twin(bf16, 0),
        "fp8_block": lambda: fp8_twin(bf16, group),
        "int4": lambda: int4_twin(bf16, group),
        "int8": lambda: int8_twin(bf16, group),
        "mxfp4": lambda: mxfp4_twin(bf16),
    }
    variants = {name: twins[name]() for name in args.formats.split(",")}
    weight_bytes = {"fp8_channel": 1.0, "fp8_block": 1.0, "int8": 1.0, "int4": 0.5, "mxfp4": 0.5}  # (scales left out)
    per_expert = 3 * shape["hidden"] * shape["intermediate"]  # gate, up and down: their weights' count
    rows = []
    for tokens in (int(t) for t in ("1,4" if args.smoke else args.tokens).split(",")):
        x = torch.randn(tokens, shape["hidden"], device=device, dtype=dtype)
        index = torch.stack([torch.randperm(shape["experts"], device=device)[: shape["top_k"]] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, shape["top_k"], device=device), dim=-1).to(dtype)
        hit = int(torch.unique(index).numel())
        row: dict[str, object] = {"tokens": tokens, "experts_hit": hit}
        with torch.no_grad():
            bf16_s = timed(functools.partial(bf16, x, index, weights), iters, cuda)
            gbs = round(hit * per_expert * dtype.itemsize / bf16_s / 1e9, 1)
            row[base] = {"us": round(bf16_s * 1e6, 1), "GB_per_s": gbs}
            for name, (kept, dense) in variants.items():
                want = dense(x, index, weights)
                widen = cuda and fp8_devices.native(device) and name.startswith("fp8")
                for widened in (False, True) if widen else (False,):
                    key = name + ("_widened" if widened else "")
                    native = fp8_devices.native
                    if widened:  # the bytes widened as on an A100, on this GPU
                        fp8_devices.native = lambda d: False  # type: ignore[assignment]
                    try:
                        seconds = timed(functools.partial(kept, x, index, weights), iters, cuda)
                        got = kept(x, index, weights)
                    except Exception as exc:  # noqa: BLE001 - a variant this GPU refuses: said so
                        row[key] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                        continue
                    finally:
                        fp8_devices.native = native  # type: ignore[assignment]
                    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    row[key] = {
                        "us": round(seconds * 1e6, 1),
                        "GB_per_s": round(hit * per_expert * weight_bytes[name] / seconds / 1e9, 1),
                        "error": round(error, 5),
                        f"over_{base}": round(bf16_s / seconds, 3),
                    }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu" if args.cpu else "cpu (smoke)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": {"name": "smoke" if args.smoke else args.shape, **shape},
        "experts_bytes": {base: held_bytes(bf16), **{name: held_bytes(kept) for name, (kept, _) in variants.items()}},
        "results": rows,
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_experts.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
