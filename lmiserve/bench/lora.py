"""`lmiserve bench --lora N`: the adapters' load times, read from the server's log (the adapters are made
by `lmiserve.models.lora_demo`, in process, with torch: `runner` imports it when --lora asks)."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["adapter_load_times"]

_LOADED = re.compile(r"adapter (?P<name>\S+) loaded: rank \d+, .*?, (?P<mib>[\d.]+) MiB in (?P<ms>\d+) ms")


def adapter_load_times(server_log: Path) -> dict[str, dict[str, float]]:
    """Each adapter's load time (ms) and size (MiB), from a server's log."""
    found: dict[str, dict[str, float]] = {}
    try:
        text = server_log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return found
    for match in _LOADED.finditer(text):
        found[match["name"]] = {"load_ms": float(match["ms"]), "mib": float(match["mib"])}
    return found
