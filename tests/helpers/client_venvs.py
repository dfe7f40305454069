"""Clients that `make test` installs (into .venv or a venv of their own): a missing one skips its tests
outside make, saying which `make` target installs it, and fails them under make (MAKELEVEL is set), where
it should have been installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LANGCHAIN_STAMP = REPO / ".venv" / ".langchain-installed"


def missing(path: Path, target: str) -> None:
    """Skip (outside make) or fail (under `make test`, which installs it) when a client's venv is missing."""
    if path.exists():
        return
    message = f"{path.relative_to(REPO)} is missing: run `make {target}`"
    if os.environ.get("MAKELEVEL"):
        raise RuntimeError(message)
    pytest.skip(message)
