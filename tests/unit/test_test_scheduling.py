"""tests/conftest.py's schedule: the scopes it sends first to the workers (`LONGEST_SCOPES`) are scopes of this
suite, so a file renamed or moved is not silently sent last again."""

from __future__ import annotations

from pathlib import Path

from conftest import LONGEST_SCOPES, _worker_scope

ROOT = Path(__file__).resolve().parents[2]


def test_the_longest_scopes_are_scopes_of_the_suite() -> None:
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py"))
    scopes = {_worker_scope(name) for name in files}
    assert set(LONGEST_SCOPES) <= scopes, set(LONGEST_SCOPES) - scopes
    assert len(set(LONGEST_SCOPES)) == len(LONGEST_SCOPES)
