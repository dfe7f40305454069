"""The fast tier reads the settings in process: without the test session's OPTION_GRPC_PORT (tests/conftest.py
sets it for the servers that other tiers start), so the settings and their sources are what a user gets."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_session_grpc_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPTION_GRPC_PORT", raising=False)
