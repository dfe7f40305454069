"""What a process the server spawns does first, whatever it runs (a tensor-parallel rank,
engine/executors/tp_worker.py; the engine process, models/engine_process.py): it ignores SIGINT and SIGTERM
(the server drains, then stops it), exits when the server's process goes, logs at the server's level,
uses the CPU threads it is given, and shows no progress bars (nor takes tqdm's multiprocessing locks, which
a child's `os._exit` would leave for the resource tracker to report as leaked)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from lmiserve.engine.cpu_threads import apply as apply_threads

PARENT_POLL_S = 1.0  # how often a child checks that its parent process is still there


def start_child(log_level: str, threads: int | None, **logging_config: Any) -> None:
    """Set this spawned process up: `logging_config` is `logging.basicConfig`'s format or handlers;
    `threads` the CPU threads its torch uses (None: as they are)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    exit_with_parent()
    level = logging.getLevelName(log_level.upper())
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO, force=True, **logging_config)
    if threads is not None:
        apply_threads(threads)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def exit_with_parent() -> None:
    """End this process when its parent goes (a crashed or killed server leaves no child behind)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="lmiserve-parent-watch", daemon=True).start()
