"""What a download shows (lmiserve/models/download/progress.py): a log line every few seconds with the bytes
done, the total and the rate, and one at the end."""

from __future__ import annotations

import logging
import time

import pytest

from lmiserve.models.download import progress


def test_the_line_says_done_total_share_and_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    report = progress.Progress("org/name", 4 * 2**30, lambda: 2**30, bar=False)
    monkeypatch.setattr(progress.time, "monotonic", lambda: report.started + 2.0)  # 2 s, however busy the machine
    assert report.line() == "downloading org/name: 1.0 GiB of 4.0 GiB (25%), 512.0 MiB/s"
    assert progress.human_bytes(100) == "100 B"
    assert progress.human_bytes(1536) == "1.5 KiB"


def test_lines_every_interval_while_it_runs_and_one_at_the_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.05)
    done = {"bytes": 0}
    with (
        caplog.at_level(logging.INFO, logger="lmiserve.download"),
        progress.reporting("m", 1000, lambda: done["bytes"]),
    ):
        for step in range(1, 5):
            done["bytes"] = step * 250
            time.sleep(0.08)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("downloading m: ") and " of 1000 B (" in line for line in lines), lines
    assert lines[-1].startswith("downloaded m: 1000 B in ")
