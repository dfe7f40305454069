"""The machine a benchmark ran on, as its reports name it."""

from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """`lscpu`'s model name (the processor's own name where there is no lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def run_facts() -> dict[str, str]:
    """What a result names its run by: the CPU (`cpu_model`), Python's and torch's versions."""
    import torch

    return {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__}
