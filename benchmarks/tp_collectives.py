"""What a tensor-parallel step's collectives cost on this machine: `--degree` processes (gloo on CPU, NCCL
on CUDA) time an all-reduce of a ``[rows, hidden]`` activation (two a layer), the logits' all-gather and
the step batch's `broadcast_object_list` (one a step), as the workers run them (engine/executors/tensor_parallel.py).

    python benchmarks/tp_collectives.py [--degree 2] [--device cpu|cuda] [--rows 8] [--hidden 896]
                                        [--vocab 49152] [--iterations 300]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.degree))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.degree
    )
    control = dist.new_group(backend="gloo")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    activation = torch.ones(args.rows, args.hidden, device=device)
    logits = torch.ones(args.rows, -(-args.vocab // args.degree), device=device)
    parts = [torch.empty_like(logits) for _ in range(args.degree)]
    batch: list[Any] = [{"rows": [[1, 2, 3]] * args.rows, "blocks": list(range(64))}]

    def timed(run: Any) -> float:
        for _ in range(20):
            run()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iterations):
            run()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.iterations * 1e6

    report = {
        "all_reduce_us": timed(lambda: dist.all_reduce(activation)),
        "all_gather_logits_us": timed(lambda: dist.all_gather(parts, logits)),
        "broadcast_batch_us": timed(lambda: dist.broadcast_object_list(batch, src=0, group=control)),
    }
    if rank == 0:
        print(json.dumps({**vars(args), **report}, indent=1), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degree", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=args.degree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
