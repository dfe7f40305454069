"""numba, the compiler of the CPU kernels (engine/attention/cpu_kernel.py, engine/lora/kernels.py,
engine/model/skinny_gemm.py), imported once. numba is a dependency; a broken install only costs speed: `HAVE_NUMBA`
is then False and the kernels are not used."""

from __future__ import annotations

import functools
from collections.abc import Callable

try:
    import numba
except Exception:  # noqa: BLE001 - import errors of numba/llvmlite come in many types
    numba = None  # type: ignore[assignment]
    HAVE_NUMBA = False
else:
    HAVE_NUMBA = True

__all__ = ["HAVE_NUMBA", "lazily_compiled", "numba"]


def lazily_compiled(kernel: Callable[..., None]) -> Callable[[], Callable[..., None]]:
    """A function that compiles `kernel` on its first call (for many cores with `numba.prange`,
    without the GIL, cached on disk so later processes load it) and returns the compiled kernel."""

    @functools.cache
    def compiled() -> Callable[..., None]:
        result: Callable[..., None] = numba.njit(fastmath=True, parallel=True, cache=True, nogil=True)(kernel)
        return result

    return compiled
