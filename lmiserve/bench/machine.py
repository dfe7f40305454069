"""What the report records about the machine: CPU model and the instruction-set flags that decide
kernel choices, memory, the load average (the machine may be shared), package versions."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

Json = dict[str, Any]

# the flags of /proc/cpuinfo that matter for CPU inference kernels (fp32, bf16, int8)
CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


def cpu_flags(cpuinfo: str) -> list[str]:
    """The flags of CPU_FLAGS the first processor of a /proc/cpuinfo text lists."""
    for line in cpuinfo.splitlines():
        if line.split(":", 1)[0].strip() in ("flags", "Features"):
            present = set(line.split(":", 1)[1].split())
            return [f for f in CPU_FLAGS if f in present]
    return []


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> Json:
    cpu = platform.processor() or None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_flags": cpu_flags(cpuinfo),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
    }


def versions() -> Json:
    out: dict[str, str | None] = {}
    for package in ("lmiserve", "torch", "transformers", "tokenizers", "numba", "httpx", "uvicorn", "matplotlib"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out
