"""Decode attention over the block KV cache (engine/attention/paged.py) against the slot kernel
(engine/attention/cpu_kernel.py): one layer's call, SmolLM2-135M's attention shape by default.

    .venv/bin/python benchmarks/paged_attention.py [--rows 32] [--block-size 16] [--calls 200]

Both kernels read the same values (the paged pool holds each row's positions in randomly scattered
blocks), each call another layer's copy (`--layers`) so that it reads from memory as a forward pass
does; the calls alternate so that a noisy machine slows both alike. Prints the median and the fastest call
(on a shared machine the minimum is the steadier comparison).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lmiserve.engine.attention import cpu_kernel as decode_attention
from lmiserve.engine.attention import paged as paged_attention


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
        "--parts", type=int, default=None, help="the paged kernel's tasks per row (default: its choice)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=8,
        help="caches cycled through, so each call reads from memory as a forward pass does",
    )
    parser.add_argument("--torch", action="store_true", help="also time the torch path (fp32 and bf16)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    rows, heads, groups, dim, bs = args.rows, args.kv_heads, args.groups, args.head_dim, args.block_size
    spans = torch.randint(args.min_span, args.max_span + 1, (rows,), generator=gen).numpy().astype(np.int64)
    capacity = -(-int(spans.max()) // bs) * bs
    slot_k = torch.randn(rows, heads, capacity, dim, generator=gen)
    slot_v = torch.randn(rows, heads, capacity, dim, generator=gen)
    layers = range(args.layers)

    needed = [-(-int(s) // bs) for s in spans]
    num_blocks = sum(needed) + 64
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(rows, max(needed), dtype=torch.int64)
    pool_k = torch.zeros(num_blocks, heads, bs, dim)
    pool_v = torch.zeros(num_blocks, heads, bs, dim)
    taken = 0
    for row, count in enumerate(needed):
        blocks = order[taken : taken + count]
        taken += count
        tables[row, :count] = blocks
        pool_k[blocks] = slot_k[row, :, : count * bs].reshape(heads, count, bs, dim).transpose(0, 1)
        pool_v[blocks] = slot_v[row, :, : count * bs].reshape(heads, count, bs, dim).transpose(0, 1)

    query = torch.randn(rows, heads, groups, dim, generator=gen)
    new_k = torch.randn(rows, heads, dim, generator=gen)
    new_v = torch.randn(rows, heads, dim, generator=gen)
    scale = dim**-0.5

    slot_ks, slot_vs = [slot_k.clone() for _ in layers], [slot_v.clone() for _ in layers]
    pool_ks, pool_vs = [pool_k.clone() for _ in layers], [pool_v.clone() for _ in layers]
    decode_attention.warm_up()
    cpu_kernel.warm_up()
    candidates = {
        "slot (decode_attention)": lambda i: decode_attention.decode_attention(
            query, slot_ks[i], slot_vs[i], new_k, new_v, spans, scale
        ),
        "paged (numba)": lambda i: cpu_kernel.compiled_decode_attention(
            query, pool_ks[i], pool_vs[i], new_k, new_v, tables, spans, scale, args.parts
        ),
    }
    if args.torch:
        bf = [t.bfloat16() for t in (query, pool_k, pool_v, new_k, new_v)]
        candidates["paged (torch fp32)"] = lambda i: paged_attention.torch_decode_attention(
            query, pool_ks[i], pool_vs[i], new_k, new_v, tables, spans, scale
        )
        candidates["paged (torch bf16)"] = lambda i: paged_attention.torch_decode_attention(
            bf[0], bf[1], bf[2], bf[3], bf[4], tables, spans, scale
        )
    outs = {name: fn(0) for name, fn in candidates.items()}
    reference = outs["slot (decode_attention)"]
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
        f"numba threads {paged_attention.numba.get_num_threads()}"
    )
    base = times["slot (decode_attention)"]
    for name, samples in times.items():
        median, fastest = statistics.median(samples), min(samples)
        diff = (outs[name].float() - reference).abs().max().item()
        print(
            f"{name:24s} median {median * 1e6:8.1f} us ({median / statistics.median(base):5.2f}x slot)"
            f"  min {fastest * 1e6:8.1f} us ({fastest / min(base):5.2f}x)  max |diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
