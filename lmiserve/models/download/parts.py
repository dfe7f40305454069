"""The one downloader of every source (the Hub, S3, GCS): files in ranged parts, several at a time, that a
killed start resumes, each verified before it takes its name.

A file goes to `DEST.incomplete`, written in parts of `part_size` bytes by `WORKERS` threads over all the
files of a model; `DEST.incomplete.json` records the parts written (with the file's ETag and size), so the
next start after a kill reads only the others, and a file that changed at the source starts over. A file
fully written is verified (its size, and the digest the source gives: sha256, git's blob hash or MD5),
then renamed to `DEST`. The free disk space is checked against what is left before the first byte; the
bytes written are reported every few seconds (progress.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

from lmiserve.models.download.common import (
    DownloadError,
    FetchOptions,
    check_disk_space,
    mismatch,
    one_line,
    with_retries,
)
from lmiserve.models.download.progress import human_bytes, reporting
from lmiserve.models.download.selection import RemoteFile
from lmiserve.models.errors import ModelLoadError

logger = logging.getLogger("lmiserve.download")

T = TypeVar("T")

INCOMPLETE = ".incomplete"
PART_SIZE = 16 << 20  # bytes a ranged GET reads
WORKERS = 8  # ranged GETs at a time


class Source(Protocol):
    """Where the bytes of a model's files come from."""

    url: str  # what the messages name: "s3://bucket/prefix", "org/name"

    def digest(self, file: RemoteFile) -> tuple[str, str] | None:
        """The digest to verify `file` by, or None when the source gives none."""

    def read(self, file: RemoteFile, start: int, end: int) -> bytes:
        """Bytes [start, end) of `file`, as of its ETag."""

    def transient(self, exc: BaseException) -> bool:
        """True for an error worth another attempt (no connection, a timeout, throttling, a 5xx)."""

    def error(self, exc: BaseException) -> DownloadError:
        """The one line for an error that is not transient (no bucket or repository, access denied, ...)."""


def download(
    source: Source,
    files: list[tuple[RemoteFile, Path]],
    options: FetchOptions,
    finished: Callable[[RemoteFile], None] = lambda f: None,
) -> None:
    """Download every `(file, destination)`; `finished(file)` once a file is verified and in place."""
    if not files:
        return
    partials = [_Partial(f, dest, options.part_size or PART_SIZE) for f, dest in files]
    total = sum(p.file.size for p in partials)
    resumed = sum(p.done_bytes for p in partials)
    check_disk_space(partials[0].path.parent, total - resumed, source.url)
    logger.info(
        "downloading %d file(s) of %s (%s)%s",
        len(partials),
        source.url,
        human_bytes(total),
        f", resuming after {human_bytes(resumed)} downloaded before" if resumed else "",
    )

    def run(job: tuple[_Partial, int]) -> None:
        partial, part = job
        start, end = partial.span(part)
        data = with_retries(
            f"reading {partial.file.name} of {source.url}",
            lambda: source.read(partial.file, start, end),
            options,
            source.transient,
        )
        partial.write(part, data)

    def verify(partial: _Partial) -> None:
        digest = with_retries(
            f"checking {partial.file.name} of {source.url}",
            lambda: source.digest(partial.file),
            options,
            source.transient,
        )
        partial.finish(source.url, digest)
        finished(partial.file)

    jobs = [(p, i) for p in partials for i in range(p.parts) if i not in p.done]
    try:
        with reporting(source.url, total, lambda: sum(p.done_bytes for p in partials)):
            _run_all(run, jobs, source)
        _run_all(verify, partials, source, workers=1)
    finally:
        for partial in partials:
            partial.drop_if_empty()


class _Partial:
    """`DEST.incomplete` of one file and the record of its parts written (`DEST.incomplete.json`)."""

    def __init__(self, f: RemoteFile, dest: Path, part_size: int) -> None:
        self.file, self.dest, self.part_size = f, dest, part_size
        self.path = dest.with_name(dest.name + INCOMPLETE)
        self.record = dest.with_name(dest.name + INCOMPLETE + ".json")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.parts = max(1, -(-f.size // part_size))
        self.done: set[int] = set()
        self._lock = threading.Lock()
        try:
            saved = json.loads(self.record.read_text())
        except (OSError, ValueError):
            saved = None
        if (
            isinstance(saved, dict)
            and saved.get("etag") == f.etag
            and saved.get("size") == f.size
            and saved.get("part_size") == part_size
            and self.path.is_file()
        ):
            self.done = {int(i) for i in saved.get("done", []) if 0 <= int(i) < self.parts}
        else:
            self.record.unlink(missing_ok=True)
            with open(self.path, "wb") as handle:
                handle.truncate(f.size)
            self._save()

    def span(self, part: int) -> tuple[int, int]:
        start = part * self.part_size
        return start, min(start + self.part_size, self.file.size)

    @property
    def done_bytes(self) -> int:
        return sum(end - start for start, end in map(self.span, list(self.done)))

    def write(self, part: int, data: bytes) -> None:
        start, end = self.span(part)
        if len(data) != end - start:
            raise DownloadError(
                f"part {part} of {self.file.name} came back with {len(data)} bytes, not {end - start}: it changed "
                "at the source while it downloaded; start again"
            )
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, start)
            os.fsync(fd)  # on disk before the record says so: a kill never leaves a recorded part unwritten
        finally:
            os.close(fd)
        with self._lock:
            self.done.add(part)
            self._save()

    def finish(self, url: str, digest: tuple[str, str] | None) -> None:
        """Verify the fully written file and give it its name (DownloadError, the file removed, if it fails)."""
        problem = mismatch(self.path, self.file.size, digest)
        if problem:
            self.path.unlink(missing_ok=True)
            self.record.unlink(missing_ok=True)
            raise DownloadError(
                f"file {self.file.name} of {url} failed verification ({problem}); it was removed: start "
                "again to download it anew"
            )
        os.replace(self.path, self.dest)
        self.record.unlink(missing_ok=True)

    def drop_if_empty(self) -> None:
        """Remove the placeholder of a file not one part of which was written (a download that failed at once)."""
        if not self.done and self.path.is_file():
            self.path.unlink(missing_ok=True)
            self.record.unlink(missing_ok=True)

    def _save(self) -> None:
        tmp = self.record.with_name(self.record.name + ".tmp")
        record = {
            "etag": self.file.etag,
            "size": self.file.size,
            "part_size": self.part_size,
            "done": sorted(self.done),
        }
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.record)


def _run_all(run: Callable[[T], None], jobs: list[T], source: Source, workers: int | None = None) -> None:
    """Every job on the pool; the first failure stops the rest (the parts written are kept) and is raised:
    one line (`source.error`) for an error of the source."""
    with ThreadPoolExecutor(max_workers=workers or WORKERS, thread_name_prefix="lmiserve-download") as pool:
        futures = [pool.submit(run, job) for job in jobs]
        try:
            for future in futures:
                future.result()
        except BaseException as exc:
            for future in futures:
                future.cancel()
            if isinstance(exc, ModelLoadError) or not isinstance(exc, Exception):
                raise
            if source.transient(exc):
                raise DownloadError(f"downloading {source.url} failed: {one_line(exc)}") from None
            raise source.error(exc) from None
