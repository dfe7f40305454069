"""Triton kernels compiled for NVIDIA GPUs on a machine without one: Triton's NVIDIA backend (its ``ptxas``
ships in the wheel) turns a kernel into a cubin for a compute capability, and the wheel's ``cuobjdump`` reads
the cubin's registers and spilled bytes. A kernel source a GPU's Triton cannot compile fails here, on the CPU,
instead of in a GPU session (where every candidate would be refused and the slower product would serve).

Runs in its own process (`compile_all`): under Triton's interpreter (TRITON_INTERPRET=1, which the tests set on a
CPU) ``triton.jit`` makes interpreted functions, which the compiler cannot read.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = ["Launch", "available", "compile_all", "job_of", "recording"]


def _backend_bin() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return path if (path / "ptxas").exists() and (path / "cuobjdump").exists() else None


def available() -> bool:
    """Whether this Triton can compile for NVIDIA GPUs here (its NVIDIA backend and binaries installed)."""
    return _backend_bin() is not None


@dataclass
class Launch:
    """One launch a kernel's Python wrapper made: the kernel's function (before ``triton.jit``) and its
    arguments, as the wrapper passed them."""

    kernel: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    """Stands for a jitted kernel: ``kernel[grid](...)`` records the launch instead of running it."""

    def __init__(self, kernel: Callable[..., Any], into: list[Launch]) -> None:
        self.kernel, self.into = kernel, into

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: self.into.append(Launch(self.kernel, args, kwargs))


def recording(monkeypatch: pytest.MonkeyPatch, module: Any, factory: str) -> list[Launch]:
    """From now on (in this test) the kernels `module.factory()` makes (one, or a tuple) record their launches
    in the list returned, their wrappers running as they would (the kernels' outputs left unwritten)."""
    launches: list[Launch] = []
    made = getattr(module, factory)()

    def recorder(kernel: Any) -> _Recorder:
        return _Recorder(getattr(kernel, "fn", kernel), launches)  # (an interpreted or jitted function's own)

    replaced = tuple(recorder(k) for k in made) if isinstance(made, tuple) else recorder(made)
    monkeypatch.setattr(module, factory, lambda: replaced)
    return launches


_POINTERS = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}


def job_of(launch: Launch, arch: int) -> dict[str, Any]:
    """`launch` as a compile job for compute capability `arch` (`compile_all`): tensors as pointers to their
    dtype, Python numbers as Triton types them, the ``tl.constexpr`` parameters and ``num_warps`` /
    ``num_stages`` as given; integers that are multiples of 16 specialized so, as a launch specializes them."""
    kwargs = dict(launch.kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    signature = inspect.signature(launch.kernel)
    bound = signature.bind(*launch.args, **kwargs).arguments
    pointers: dict[str, str] = {}
    scalars: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    aligned: list[str] = []
    for name, value in bound.items():
        if "constexpr" in str(signature.parameters[name].annotation):
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            pointers[name] = "*" + _POINTERS[value.dtype]
        elif isinstance(value, bool):
            scalars[name] = "i1"
        elif isinstance(value, int):
            scalars[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and value:
                aligned.append(name)
        elif isinstance(value, float):
            scalars[name] = "fp32"
        else:
            raise TypeError(f"{launch.kernel.__name__}'s {name}: {type(value).__name__} is not a kernel argument")
    return {
        "kernel": f"{launch.kernel.__module__}:{launch.kernel.__name__}",
        "pointers": pointers,
        "scalars": scalars,
        "constexprs": constexprs,
        "aligned": aligned,
        "arch": arch,
        **options,
    }


def compile_all(jobs: list[dict[str, Any]], processes: int = 2, timeout: float = 600) -> list[dict[str, Any]]:
    """Each job compiled: ``{"kernel": "module:function", "pointers": {arg: "*bf16", ...}, "constexprs": {arg:
    value}, "scalars": {arg: "fp32", ...}, "aligned": [arg, ...], "arch": 90, "num_warps": 4, "num_stages": 3}``
    (other arguments i32; the pointers and the `aligned` integers multiples of 16, as Triton specializes them at a
    launch with such values: without, its loads are not vectorized) to ``{"error": str | None, "registers": int, "spilled": int}``
    (spilled: the stack's bytes), in up to `processes` child processes (no more than this process may use)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    count = max(1, min(processes, len(os.sched_getaffinity(0)), len(jobs)))
    shares = [jobs[i::count] for i in range(count)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).parents[2],
        )
        for _ in shares
    ]
    outputs = [
        child.communicate(json.dumps(share), timeout=timeout) for child, share in zip(children, shares, strict=True)
    ]
    results: list[dict[str, Any]] = [{}] * len(jobs)
    for i, (child, (out, err)) in enumerate(zip(children, outputs, strict=True)):
        if child.returncode:
            raise RuntimeError(f"compiling for CUDA failed (exit {child.returncode}): {err[-2000:]}")
        results[i::count] = json.loads(out.splitlines()[-1])
    return results


def _compile(job: dict[str, Any], bin_dir: Path, scratch: Path) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module, name = job["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    jitted = fn if isinstance(fn, JITFunction) else triton.jit(fn)
    names = jitted.arg_names
    constexprs = job["constexprs"]
    types = {**job.get("scalars", {}), **job["pointers"]}
    signature = {n: types.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    aligned = [*job["pointers"], *job.get("aligned", ())]
    source = ASTSource(
        fn=jitted,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options = {"num_warps": job.get("num_warps", 4), "num_stages": job.get("num_stages", 3)}
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", job["arch"], 32), options=options)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names the job
        return {"error": f"{type(exc).__name__}: {str(exc)[:2000]}", "registers": 0, "spilled": 0}
    cubin = scratch / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([bin_dir / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    if found is None:
        return {"error": f"no resource usage in cuobjdump's output: {usage.stdout[:500]}", "registers": 0, "spilled": 0}
    return {"error": None, "registers": int(found[1]), "spilled": int(found[2])}


def _main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[2]))
    jobs = json.loads(sys.stdin.read())
    bin_dir = _backend_bin()
    assert bin_dir is not None
    scratch = Path(tempfile.mkdtemp(prefix="cuda-compile-"))
    try:
        results = [_compile(job, bin_dir, scratch) for job in jobs]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
