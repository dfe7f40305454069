"""A Triton kernel for the tests: `fp8_w8a8_kernel.e4m3_bytes` over a vector (this module has no ``from __future__
import annotations``: Triton reads its ``tl.constexpr`` annotations)."""

import triton.language as tl

from lmiserve.engine.model.fp8_w8a8_kernel import e4m3_bytes


def e4m3_bytes_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):  # noqa: ANN001, ANN201 - a Triton kernel
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(out_ptr + offs, e4m3_bytes(tl.load(x_ptr + offs, mask=ok, other=0.0)), mask=ok)
