"""numba, the compiler of the CPU kernels (engine/attention/cpu_kernel_loops.py, engine/lora/kernels.py,
engine/model/skinny_gemm.py, engine/model/group_kernels.py), imported once. numba is a dependency; a
broken install only costs speed: `HAVE_NUMBA` is then False and the kernels are not used.

The threading layer: TBB when the `tbb` package is installed (a dependency on x86-64), else numba's
default (OpenMP). The engine runs its kernels on a thread of its own (engine/torch_thread.py), not the
main thread, and GNU OpenMP launched from there cost ~60-150 us more per parallel region on the 2-CPU
AMD EPYC (it counts the extra thread among the ones it manages, finds more threads than CPUs and stops
its workers spinning): with ~150 kernel calls a step, a 1-row int4 step took 27 ms on the engine's
thread against 10 ms on the main thread. TBB's pool costs the same from any thread (10 ms).
`NUMBA_THREADING_LAYER` set by the user is kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
from collections.abc import Callable
from importlib import metadata

try:
    import numba
except Exception:  # noqa: BLE001 - import errors of numba/llvmlite come in many types
    numba = None  # type: ignore[assignment]
    HAVE_NUMBA = False
else:
    HAVE_NUMBA = True

__all__ = ["HAVE_NUMBA", "THREADING_LAYER", "lazily_compiled", "numba"]

_TBB_LIBRARIES = ("libtbb.so.12", "libtbb.12.dylib", "tbb12.dll")


def _choose_threading_layer() -> str:
    """TBB when its library loads (numba's TBB pool finds it loaded), else what numba picks."""
    chosen = os.environ.get("NUMBA_THREADING_LAYER", "")
    if chosen or not HAVE_NUMBA:
        return chosen or "default"
    with contextlib.suppress(Exception):  # no tbb, an unloadable library, a numba without the pool
        files = metadata.files("tbb") or []
        library = next(f.locate() for f in files if f.name in _TBB_LIBRARIES)
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        importlib.import_module("numba.np.ufunc.tbbpool")  # fails unless the library is found

        numba.config.THREADING_LAYER = "tbb"  # type: ignore[attr-defined]
        return "tbb"
    return "default"


THREADING_LAYER = _choose_threading_layer()  # "tbb", "default" (numba's own choice) or the user's


def lazily_compiled(kernel: Callable[..., None]) -> Callable[[], Callable[..., None]]:
    """A function that compiles `kernel` on its first call (for many cores with `numba.prange`,
    without the GIL, cached on disk so later processes load it) and returns the compiled kernel."""

    @functools.cache
    def compiled() -> Callable[..., None]:
        result: Callable[..., None] = numba.njit(fastmath=True, parallel=True, cache=True, nogil=True)(kernel)
        return result

    return compiled
