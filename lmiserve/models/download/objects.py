"""Models in object stores: `s3://bucket/prefix` (s3.py) and `gs://bucket/prefix` (gcs.py), fetched into a
local cache in parallel ranged parts that a killed start resumes.

The cache: `download_dir/<scheme>/<bucket>/<prefix>/`, one directory a URL, with a manifest
(`.lmiserve-manifest.json`) of the ETag each finished file was downloaded at. A start lists the prefix,
selects what serving needs (selection.py) and downloads only the files whose ETag is not the manifest's
(parts.py: in parallel ranged parts, resumed after a kill, verified by size and MD5), so a second start
downloads nothing. One process a machine downloads a URL (a file lock); the others wait for it. When the
store cannot be reached and the cache holds every file of the last listing, the cache is used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from lmiserve.models.bundled import exclusive_lock
from lmiserve.models.download.common import DownloadError, FetchOptions, one_line, with_retries
from lmiserve.models.download.parts import Source, download
from lmiserve.models.download.selection import RemoteFile, select
from lmiserve.models.errors import ModelLoadError

logger = logging.getLogger("lmiserve.download")

MANIFEST = ".lmiserve-manifest.json"


class Bucket(Source, Protocol):
    """A bucket prefix of an object store (s3.py, gcs.py)."""

    def list(self) -> list[RemoteFile]:
        """Every object under the prefix, named relative to it (etag: the object's ETag)."""


def split_url(url: str) -> tuple[str, str, str]:
    """`s3://bucket/a/b` -> ("s3", "bucket", "a/b/"); DownloadError for a URL without a bucket or with `..`."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    parts = PurePosixPath(prefix).parts
    if not bucket or any(part in ("..", ".") for part in parts):
        raise DownloadError(f"{url} is not a valid {scheme}:// URL (expected {scheme}://BUCKET/PREFIX)")
    return scheme.lower(), bucket, "/".join(parts) + "/" if parts else ""


def open_bucket(url: str, scheme: str, bucket: str, prefix: str) -> Bucket:
    if scheme == "s3":
        from lmiserve.models.download.s3 import S3Bucket

        return S3Bucket(url, bucket, prefix)
    from lmiserve.models.download.gcs import GcsBucket

    return GcsBucket(url, bucket, prefix)


def fetch(url: str, options: FetchOptions) -> Path:
    """The local directory of the model at `url` (or its `.gguf` file), downloaded now where the cache lacks it."""
    scheme, name, prefix = split_url(url)
    target = options.objects_dir() / scheme / name / prefix
    target.mkdir(parents=True, exist_ok=True)
    store = open_bucket(url, scheme, name, prefix)
    with exclusive_lock(target.parent / f".{target.name}.lock", waiting=f"another process is downloading {url}"):
        cache = _Cache(target)
        try:
            listing = with_retries(f"listing {url}", store.list, options, store.transient)
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - one line, or the cache when the store cannot be reached
            if not store.transient(exc):
                _remove_if_empty(target)
                raise store.error(exc) from None
            if not cache.complete():
                raise DownloadError(
                    f"cannot reach {url} after {options.retries + 1} attempt(s) ({one_line(exc)}) and it is not in "
                    f"the cache {target}"
                ) from None
            logger.warning("cannot reach %s (%s): using the cached copy in %s", url, one_line(exc), target)
            return _result(target, cache.files())
        selected = select(listing, source=url, gguf_file=options.gguf_file, trust_remote_code=options.trust_remote_code)
        todo = [(f, cache.path(f.name)) for f in selected if not cache.has(f)]
        download(store, todo, options, cache.finished)
        cache.keep_only(selected)
    return _result(target, [f.name for f in selected])


@dataclass
class _Cache:
    """The cache directory of one URL and its manifest (name -> {etag, size})."""

    root: Path
    manifest: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            data = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError):
            data = {}
        self.manifest = data if isinstance(data, dict) else {}

    def path(self, name: str) -> Path:
        return self.root / name

    def has(self, f: RemoteFile) -> bool:
        entry = self.manifest.get(f.name)
        path = self.path(f.name)
        return (
            isinstance(entry, dict) and entry.get("etag") == f.etag and path.is_file() and path.stat().st_size == f.size
        )

    def complete(self) -> bool:
        """True when the manifest names files and every one is there with its size."""
        return bool(self.manifest) and all(
            isinstance(e, dict) and self.path(n).is_file() and self.path(n).stat().st_size == e.get("size")
            for n, e in self.manifest.items()
        )

    def files(self) -> list[str]:
        return sorted(self.manifest)

    def finished(self, f: RemoteFile) -> None:
        self.manifest[f.name] = {"etag": f.etag, "size": f.size}
        self._save()

    def keep_only(self, selected: list[RemoteFile]) -> None:
        """Forget (and delete) the files of an earlier listing that this one no longer selects."""
        names = {f.name for f in selected}
        stale = [n for n in self.manifest if n not in names]
        for name in stale:
            self.path(name).unlink(missing_ok=True)
            del self.manifest[name]
        if stale:
            self._save()

    def _save(self) -> None:
        tmp = self.root / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=1, sort_keys=True))
        os.replace(tmp, self.root / MANIFEST)


def _remove_if_empty(target: Path) -> None:
    """Leave no empty cache directory behind for a URL that named no model."""
    with contextlib.suppress(OSError):
        target.rmdir()


def _result(target: Path, names: list[str]) -> Path:
    """The directory, or the one `.gguf` file of a GGUF selection."""
    if len(names) == 1 and names[0].lower().endswith(".gguf"):
        return target / names[0]
    return target
