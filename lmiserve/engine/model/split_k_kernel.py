"""How a program of the few-rows product kernels (`fp8_gemv_kernel`, `int4_triton_kernel`) stores its sums
(imported only where Triton is installed; the interpreter runs it on a CPU in the tests), by `SPLIT`:

- 0, K unsplit: the program's sums are the outputs, stored in `y`'s dtype;
- 1, K split, added by the caller: the program's fp32 sums go to its split's slice of the ``[splits, M, N]``
  `parts`, which `kernel_choice.split_k_product` adds after the kernel (two more kernels: a sum and a cast);
- 2, K split, added in the kernel: each program stores its slice of `parts` likewise, then takes a ticket from
  its output tile's counter (an atomic add, ``acq_rel`` at GPU scope, after a barrier: the CTA's stores are
  released with it, as CUTLASS's serial split-K semaphore does). The program that draws the last ticket adds
  the tile's slices in split order (0, 1, ...: the same bits whichever program comes last), stores the outputs
  and puts the counter back to 0 for the next product. One kernel, no atomics on the outputs.
"""

import triton
import triton.language as tl

__all__ = ["store_sums"]


@triton.jit
def store_sums(  # pragma: no cover - runs inside a Triton kernel
    acc, y_ptr, p_ptr, c_ptr, offs_m, offs_n, mask, stride_ym, stride_ps, SPLIT: tl.constexpr
):
    # acc: the program's fp32 sums [BLOCK_M, BLOCK_N] (scaled); y and each slice of parts are [M, N] with rows
    # `stride_ym` apart, the slices `stride_ps` apart
    at = offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT == 0:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        pid_k = tl.program_id(2)
        tl.store(p_ptr + pid_k.to(tl.int64) * stride_ps + at, acc, mask=mask)
        if SPLIT == 2:
            tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            splits = tl.num_programs(2)
            tl.debug_barrier()  # every thread's slice stored before the ticket releases them
            ticket = tl.atomic_add(c_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == splits - 1:
                total = tl.zeros(acc.shape, tl.float32)
                for s in range(0, splits):
                    total += tl.load(p_ptr + s * stride_ps + at, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(c_ptr + tile, 0, sem="relaxed", scope="gpu")
