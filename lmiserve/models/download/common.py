"""What the model sources (hub.py, objects.py) share: the error they raise, how to fetch, retries with
backoff, the disk space check, verifying a file and a one-line message (the package's front door,
`lmiserve.models.download`, re-exports them)."""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from lmiserve.models.errors import ModelLoadError

if TYPE_CHECKING:
    from lmiserve.config import Settings

logger = logging.getLogger("lmiserve.download")

T = TypeVar("T")

BACKOFF_CAP = 30.0  # seconds: the longest wait between two attempts


class DownloadError(ModelLoadError):
    """A model could not be fetched: the message is one line saying why and what to do."""


@dataclass(frozen=True)
class FetchOptions:
    """How to fetch a remote model (from the settings: `revision`, `gguf_file`, `download_dir`, ...)."""

    revision: str | None = None
    gguf_file: str | None = None
    download_dir: Path | None = None  # None: the user cache dir / lmiserve / downloads
    retries: int = 4  # attempts after the first, on a network error, with backoff
    backoff: float = 1.0  # seconds before the first retry; doubled each time
    trust_remote_code: bool = False
    part_size: int | None = None  # bytes a ranged GET of S3/GCS reads; None: objects.PART_SIZE

    @classmethod
    def from_settings(cls, settings: Settings) -> FetchOptions:
        return cls(
            revision=settings.revision,
            gguf_file=settings.gguf_file,
            download_dir=Path(settings.download_dir).expanduser() if settings.download_dir else None,
            retries=settings.download_retries,
            trust_remote_code=settings.trust_remote_code,
            part_size=int(settings.download_part_size),
        )

    def objects_dir(self) -> Path:
        if self.download_dir is not None:
            return self.download_dir
        from lmiserve.models.bundled import default_cache_dir

        return default_cache_dir() / "downloads"


def with_retries(what: str, call: Callable[[], T], options: FetchOptions, transient: Callable[[Exception], bool]) -> T:
    """`call()`, again after a backoff while it raises an error `transient` accepts, `options.retries` times."""
    delay = options.backoff
    for attempt in range(options.retries + 1):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - `transient` decides; anything else is raised as it is
            if not transient(exc) or attempt == options.retries:
                raise
            logger.warning(
                "%s failed (%s); attempt %d of %d in %.0f s",
                what,
                one_line(exc),
                attempt + 2,
                options.retries + 1,
                delay,
            )
            time.sleep(delay)
            delay = min(delay * 2, BACKOFF_CAP)
    raise AssertionError("unreachable")  # pragma: no cover


def check_disk_space(directory: Path, needed: int, what: str) -> None:
    """DownloadError unless `directory`'s file system has `needed` bytes free (checked before the first byte)."""
    from lmiserve.models.download.progress import human_bytes

    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise DownloadError(
            f"not enough disk space for {what}: {human_bytes(needed)} to download, {human_bytes(free)} free in "
            f"{directory} (free some space or point the cache elsewhere)"
        )


def file_digest(path: Path, kind: str) -> str:
    """The hex digest of the file at `path`: `sha256`, `md5`, or `git-sha1` (git's blob id)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode()) if kind == "git-sha1" else hashlib.new(kind)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def mismatch(path: Path, size: int, digest: tuple[str, str] | None) -> str | None:
    """Why the file at `path` is not the one expected (its size, then its digest), or None when it is."""
    actual = path.stat().st_size
    if actual != size:
        return f"its size is {actual} bytes, not {size}"
    if digest is not None:
        kind, expected = digest
        found = file_digest(path, kind)
        if found != expected.lower():
            return f"its {kind} is {found}, not {expected}"
    return None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, shortened (a client error can carry a whole HTML page)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
