"""The compiled attention before and after widening an fp8 block's head once (0ebc58a), interleaved in one process:

    git show 9743cf6:lmiserve/engine/attention/cpu_kernel.py > /tmp/cpu_kernel_old.py
    .venv/bin/python benchmarks/results/issue39-lean-kv-2026-12-07/kernel_ab.py float32,bfloat16,float8_e4m3fn,float8_e5m2

median (best) ms of 40 calls each, 3 kv heads x 3 groups x 64 (SmolLM2-135M), blocks of 16."""
import importlib.util
import statistics
import sys
import time

import numpy as np
import torch

from lmiserve.engine.attention import cpu_kernel as new, kv_quant
spec = importlib.util.spec_from_file_location("cpu_kernel_old", "/tmp/cpu_kernel_old.py"); old = importlib.util.module_from_spec(spec); sys.modules["cpu_kernel_old"] = old; spec.loader.exec_module(old)
torch.manual_seed(0); DTS = [getattr(torch, n) for n in sys.argv[1].split(",")]
bs, H, D, G = 16, 3, 64, 3
for rows, span in ((1, 2048), (16, 2048), (1, 256), (16, 256)):
    per = -(-span // bs); blocks = rows * per
    table = torch.arange(blocks).reshape(rows, per)
    q = torch.randn(rows, H, G, D); nk = torch.randn(rows, H, D); nv = torch.randn(rows, H, D)
    line = []
    for dt in DTS:
        kc = kv_quant.quantize(torch.randn(blocks, H, bs, D), dt); vc = kv_quant.quantize(torch.randn(blocks, H, bs, D), dt)
        fs = {name: (lambda m=m: m.compiled_decode_attention(q, kc, vc, nk, nv, table, np.full(rows, span), 0.125)) for name, m in (("new", new), ("old", old))}
        outs = {k: f() for k, f in fs.items()}
        assert torch.allclose(outs["old"], outs["new"], atol=1e-5, rtol=1e-5), (dt, (outs["old"]-outs["new"]).abs().max())
        ts = {k: [] for k in fs}
        for _ in range(40):
            for k, f in fs.items():
                s = time.perf_counter(); f(); ts[k].append(time.perf_counter() - s)
        line.append(f"{str(dt)[6:]}: old {statistics.median(ts['old'])*1e3:.3f} ({min(ts['old'])*1e3:.3f}) new {statistics.median(ts['new'])*1e3:.3f} ({min(ts['new'])*1e3:.3f})")
    print(f"{rows} rows x {span}:", " | ".join(line), flush=True)
