"""What the report records about the machine: CPU model and the instruction-set flags that decide
kernel choices, memory, the load average (the machine may be shared), package versions."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

import psutil

from lmiserve.core.cpu_info import cpu_info

Json = dict[str, Any]


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> Json:
    cpu = cpu_info()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu.model,
        "cpu_flags": list(cpu.flags),  # the kernel-relevant ones (core/cpu_info.py)
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
