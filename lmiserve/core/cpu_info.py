"""What CPU this is: its model name and the instruction-set flags that decide which kernels are fast
(AVX-512, BF16, VNNI, AMX). Read from /proc/cpuinfo (Linux); elsewhere `platform` gives the name and
no flags. Used by the start-up autotune (its cache key) and by `lmiserve bench` (its report)."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags that matter for the CPU kernels (x86 names as /proc/cpuinfo spells them; arm: asimd, sve...).
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "asimddp",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
)


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: tuple[str, ...]  # the `KERNEL_FLAGS` this CPU has, in that order
    logical_cpus: int

    @property
    def has_bf16(self) -> bool:
        """Native bf16 products (AVX-512 BF16 or AMX on x86, BF16 on arm)."""
        return any(f in self.flags for f in ("avx512_bf16", "amx_bf16", "bf16"))

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "flags": list(self.flags), "logical_cpus": self.logical_cpus}

    def describe(self) -> str:
        return f"{self.model} ({self.logical_cpus} logical CPUs; {' '.join(self.flags) or 'no listed flags'})"


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """The model name and all flags of the first processor in a /proc/cpuinfo text."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        if model and flags:
            break
    return model, flags


@functools.cache
def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU (cached for the process)."""
    try:
        model, flags = parse_cpuinfo(Path(cpuinfo_path).read_text(errors="replace"))
    except OSError:
        model, flags = "", set()
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return CpuInfo(model, tuple(f for f in KERNEL_FLAGS if f in flags), os.cpu_count() or 1)
