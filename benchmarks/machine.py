"""The machine a benchmark ran on, as its reports name it."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any


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


def write_report(out: Path | None, **fields: Any) -> dict[str, Any]:
    """A result's report: the run's facts (`run_facts`) and `fields`, written as JSON to `out` where given."""
    report = {**run_facts(), **fields}
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
    return report
