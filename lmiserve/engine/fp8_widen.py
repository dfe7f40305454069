"""fp8 bytes widened inside the Triton kernels on a GPU without fp8 conversions (`fp8_devices.native` false: an
A100 or A10G), by moving their bits into a fp16 (imported only where Triton is installed; the fp8 weights'
`engine/model/fp8_gemv_kernel.py` and the paged attention's `engine/attention/triton_kernel.py` call them):

- e4m3: its sign, 4 exponent bits and 3 mantissa bits placed in a fp16's sign, the low 4 of its 5 exponent bits
  and its top 3 mantissa bits read as ``x / 2**8`` (the biases differ by 15 - 7 = 8), exactly, subnormals
  included (as Marlin's fp8 kernels do on Ampere); the caller folds the 2**8 into its scale. e4m3fn's NaN
  (``0x7f``) would read as a number; checkpoints and caches hold none;
- e5m2: a fp16's high byte, exactly."""

import triton
import triton.language as tl

__all__ = ["e4m3_over_256", "e5m2"]


@triton.jit
def e4m3_over_256(bits):  # pragma: no cover - runs inside a Triton kernel
    h = bits.to(tl.uint16)
    return (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def e5m2(bits):  # pragma: no cover - runs inside a Triton kernel
    return (bits.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
