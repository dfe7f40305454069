"""Decode attention over the block KV cache: the compiled CPU kernel (engine/attention/cpu_kernel.py) over an
fp32 cache, a bf16 one and an fp8 (e4m3) one under fp32 queries and, with `--torch`, the torch ops
(engine/attention/paged.py, the same three): one layer's call, SmolLM2-135M's attention shape by default. (The fp8
outputs' difference from fp32 is mostly the cache's own rounding.)

    .venv/bin/python benchmarks/paged_attention.py [--rows 32] [--block-size 16] [--calls 200] [--torch]

Every candidate reads the same values (each row's positions in randomly scattered blocks of the pool), each
call another layer's copy (`--layers`) so that it reads from memory as a forward pass does; the calls
alternate so that a noisy machine slows all alike. Prints the median and the fastest call (on a shared
machine the minimum is the steadier comparison), each against the compiled kernel's, and each output's
largest difference from the torch fp32 path's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmiserve.engine.attention import cpu_kernel, paged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--min-span", type=int, default=64)
    parser.add_argument("--max-span", type=int, default=600)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parts", type=int, default=None, help="the compiled kernel's tasks per row (default: its choice)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=8,
        help="caches cycled through, so each call reads from memory as a forward pass does",
    )
    parser.add_argument("--torch", action="store_true", help="also time the torch path (fp32, bf16 and fp8)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    rows, heads, groups, dim, bs = args.rows, args.kv_heads, args.groups, args.head_dim, args.block_size
    spans = torch.randint(args.min_span, args.max_span + 1, (rows,), generator=gen).numpy().astype("int64")
    layers = range(args.layers)

    needed = [-(-int(s) // bs) for s in spans]
    num_blocks = sum(needed) + 64
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(rows, max(needed), dtype=torch.int64)
    taken = 0
    for row, count in enumerate(needed):
        tables[row, :count] = order[taken : taken + count]
        taken += count
    pool_k = torch.randn(num_blocks, heads, bs, dim, generator=gen)
    pool_v = torch.randn(num_blocks, heads, bs, dim, generator=gen)

    query = torch.randn(rows, heads, groups, dim, generator=gen)
    new_k = torch.randn(rows, heads, dim, generator=gen)
    new_v = torch.randn(rows, heads, dim, generator=gen)
    scale = dim**-0.5

    pool_ks, pool_vs = [pool_k.clone() for _ in layers], [pool_v.clone() for _ in layers]
    bf = [t.bfloat16() for t in (query, pool_k, pool_v, new_k, new_v)]
    bf_ks, bf_vs = [bf[1].clone() for _ in layers], [bf[2].clone() for _ in layers]
    f8 = [t.to(torch.float8_e4m3fn) for t in (pool_k, pool_v)]
    f8_ks, f8_vs = [f8[0].clone() for _ in layers], [f8[1].clone() for _ in layers]
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        cpu_kernel.warm_up(dtype)
    kernel = "paged (numba)"
    candidates = {
        kernel: lambda i: cpu_kernel.compiled_decode_attention(
            query, pool_ks[i], pool_vs[i], new_k, new_v, tables, spans, scale, args.parts
        ),
        "paged (numba bf16)": lambda i: cpu_kernel.compiled_decode_attention(
            bf[0], bf_ks[i], bf_vs[i], bf[3], bf[4], tables, spans, scale, args.parts
        ),
        "paged (numba fp8)": lambda i: cpu_kernel.compiled_decode_attention(
            query, f8_ks[i], f8_vs[i], new_k, new_v, tables, spans, scale, args.parts
        ),
    }
    if args.torch:
        candidates["paged (torch fp32)"] = lambda i: paged.torch_decode_attention(
            query, pool_ks[i], pool_vs[i], new_k, new_v, tables, spans, scale
        )
        candidates["paged (torch bf16)"] = lambda i: paged.torch_decode_attention(
            bf[0], bf[1], bf[2], bf[3], bf[4], tables, spans, scale
        )
        candidates["paged (torch fp8)"] = lambda i: paged.torch_decode_attention(
            query, f8_ks[i], f8_vs[i], new_k, new_v, tables, spans, scale
        )
    reference = paged.torch_decode_attention(query, pool_k.clone(), pool_v.clone(), new_k, new_v, tables, spans, scale)
    outs = {name: fn(0) for name, fn in candidates.items()}
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for call in range(args.calls):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn(call % args.layers)
            times[name].append(time.perf_counter() - start)
    positions = int(spans.sum())
    print(
        f"rows {rows}, spans {int(spans.min())}..{int(spans.max())} (sum {positions}), kv_heads {heads}, "
        f"groups {groups}, head_dim {dim}, block_size {bs}, layers {args.layers}, "
        f"numba threads {cpu_kernel.numba.get_num_threads()}"
    )
    base = times[kernel]
    for name, samples in times.items():
        median, fastest = statistics.median(samples), min(samples)
        diff = (outs[name].float() - reference).abs().max().item()
        print(
            f"{name:24s} median {median * 1e6:8.1f} us ({median / statistics.median(base):5.2f}x numba)"
            f"  min {fastest * 1e6:8.1f} us ({fastest / min(base):5.2f}x)  max |diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
