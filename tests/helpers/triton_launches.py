"""The Triton kernels' launches as the JIT keys them (tests of "no request pays for a new shape"): on a GPU,
Triton compiles a kernel once for each key (the constexprs, and each argument's specialization: an int
equal to 1, divisible by 16 or neither; a pointer 16-byte aligned or not), so a step whose launch has a key
the warm-up did not run waits for a compilation. Under the interpreter (this CPU) nothing compiles, but the
keys are computed from the same arguments with Triton's own function (`native_specialize_impl`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest


@dataclass
class LaunchKeys:
    """Each kernel's launch keys, in order of first appearance (`keys`), and every launch's (`launches`)."""

    keys: dict[str, list[tuple]] = field(default_factory=dict)
    launches: list[tuple[str, tuple]] = field(default_factory=list)

    def seen(self) -> set[tuple[str, tuple]]:
        return {(name, key) for name, keys in self.keys.items() for key in keys}


def record_launch_keys(monkeypatch: pytest.MonkeyPatch, makers: list[tuple[ModuleType, str]]) -> LaunchKeys:
    """From now on (in this test), kernels made by ``triton.jit`` record each launch's key; `makers`: the
    ``functools.cache``'d functions that make the kernels, as (module, name), replaced for the test by
    fresh caches of the same functions (so the kernels are made through the recording ``jit``; the
    originals, and their real kernels, come back after it)."""
    import triton
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, native_specialize_impl

    record = LaunchKeys()
    real_jit = triton.jit

    def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        if fn is None:
            return functools.partial(jit, **options)
        kernel = real_jit(fn, **options)
        params = JITFunction(fn, **options).params
        name = fn.__name__

        def key(args: tuple, kwargs: dict[str, Any]) -> tuple:
            values = list(args) + [kwargs[p.name] for p in params[len(args) :]]
            out = []
            for param, value in zip(params, values, strict=True):
                if param.is_constexpr:
                    out.append(("constexpr", value))
                else:
                    spec = native_specialize_impl(
                        BaseBackend,
                        value,
                        param.is_const,
                        not param.do_not_specialize,
                        not param.do_not_specialize_on_alignment,
                    )
                    out.append((param.name, *spec))
            return tuple(out)

        class Recording:
            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                launch = kernel[grid]

                def run(*args: Any, **kwargs: Any) -> Any:
                    k = key(args, kwargs)
                    record.launches.append((name, k))
                    keys = record.keys.setdefault(name, [])
                    if k not in keys:
                        keys.append(k)
                    return launch(*args, **kwargs)

                return run

        return Recording()

    monkeypatch.setattr(triton, "jit", jit)
    for module, name in makers:
        monkeypatch.setattr(module, name, functools.cache(inspect.unwrap(getattr(module, name))))
    return record
