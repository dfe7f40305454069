"""How a download shows itself: a progress bar on a terminal and, in the log, a line every few seconds
with the bytes done, the total and the rate, whatever the source.

The bytes done come from a `measure` function the source gives (the bytes written so far), read on a
thread of its own, so a source that hands the transfer to a library (huggingface_hub) is measured the
same way as one that counts its own parts.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger("lmiserve.download")

# HTTP clients that log every request at INFO (huggingface_hub's httpx2, google-cloud-storage's urllib3, boto3):
# kept at WARNING wherever a download logs its own progress (`lmiserve serve`, `lmiserve download`)
CHATTY_LOGGERS = ("httpx", "httpx2", "urllib3", "botocore", "boto3", "s3transfer", "google")
LOG_INTERVAL = 5.0  # seconds between two log lines
BAR_INTERVAL = 0.5  # seconds between two updates of the terminal's bar


def human_bytes(count: float) -> str:
    """1536 -> "1.5 KiB"; 3 * 2**30 -> "3.0 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"  # pragma: no cover - the loop returns


class Progress:
    """Reports `measure()` against `total` bytes until stopped; `line()` is the log line of now."""

    def __init__(self, what: str, total: int, measure: Callable[[], int], *, bar: bool | None = None) -> None:
        self.what, self.total, self.measure = what, total, measure
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._bar_wanted = sys.stderr.isatty() if bar is None else bar
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        done = min(max(self.measure(), 0), self.total) if self.total else max(self.measure(), 0)
        elapsed = max(time.monotonic() - self.started, 1e-6)
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        return (
            f"downloading {self.what}: {human_bytes(done)} of {human_bytes(self.total)}{share}, "
            f"{human_bytes(done / elapsed)}/s"
        )

    def start(self) -> Progress:
        self._thread = threading.Thread(target=self._run, name="lmiserve-download-progress", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        bar = self._make_bar()
        next_log = time.monotonic() + LOG_INTERVAL
        try:
            while not self._stop.wait(BAR_INTERVAL if bar is not None else min(LOG_INTERVAL, 1.0)):
                if bar is not None:
                    bar.n = min(max(self.measure(), 0), self.total or bar.n)
                    bar.refresh()
                if time.monotonic() >= next_log:
                    next_log += LOG_INTERVAL
                    logger.info(self.line())
        finally:
            if bar is not None:
                bar.n = min(max(self.measure(), 0), self.total or bar.n)
                bar.close()

    def _make_bar(self) -> Any:
        if not self._bar_wanted:
            return None
        from tqdm import tqdm

        return tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1024, desc=self.what, leave=False)


@contextmanager
def reporting(what: str, total: int, measure: Callable[[], int]) -> Iterator[Progress]:
    """Report the download of `what` (`total` bytes) while the block runs; log its end."""
    progress = Progress(what, total, measure).start()
    try:
        yield progress
    finally:
        progress.stop()
    elapsed = time.monotonic() - progress.started
    logger.info(
        "downloaded %s: %s in %.1f s (%s/s)",
        what,
        human_bytes(total),
        elapsed,
        human_bytes(total / max(elapsed, 1e-6)),
    )
