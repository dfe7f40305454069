"""Models from where users keep them: the Hugging Face Hub, S3 and GCS, fetched at start.

- `org/name` (a Hub id; `org/repo:Q4_K_M` or `gguf_file` for one file of a GGUF repository), with
  `revision`: through `huggingface_hub` into the standard Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`),
  with `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE` as huggingface_hub reads them (hub.py);
- `s3://bucket/prefix` through `boto3` (the standard credential chain, `AWS_ENDPOINT_URL`) and
  `gs://bucket/prefix` through `google-cloud-storage` (`STORAGE_EMULATOR_HOST`), into `download_dir`,
  keyed by the URL and the objects' ETags, in parallel ranged parts that a killed start resumes
  (objects.py).

Only the files serving needs are fetched (selection.py); the free disk space is checked against what is
missing before the first byte; one process of a machine downloads while the others wait on a file lock;
every file is verified (size, and the sha256 / MD5 the source gives) before the model is loaded from it.
A failure is a `DownloadError`: one line that says what to do; `lmiserve serve` then exits
`MODEL_DOWNLOAD_FAILED` (5).
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from lmiserve.models import ModelLoadError

if TYPE_CHECKING:
    from lmiserve.config import Settings

logger = logging.getLogger("lmiserve.download")

T = TypeVar("T")

SCHEMES = ("s3", "gs", "hf")
# "org/name" or "name" as the Hub spells repo ids, with an optional ":QUANT" GGUF tag
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")
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


def adapter_options(settings: Settings) -> FetchOptions:
    """How a LoRA adapter (or a draft model) named by a Hub id or URL is fetched: as the model, without the
    model's own revision or GGUF file."""
    from dataclasses import replace

    return replace(FetchOptions.from_settings(settings), revision=None, gguf_file=None)


def scheme_of(model_id: str) -> str | None:
    """ "s3", "gs" or "hf" for a URL of those schemes, "hf" for a Hub id that is no local path, else None."""
    text = model_id.strip()
    head, sep, _ = text.partition("://")
    if sep:
        return head.lower() if head.lower() in SCHEMES else None
    if text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf") or Path(text).expanduser().exists():
        return None
    return "hf" if _HUB_ID.match(text) else None


def is_remote(model_id: str | None) -> bool:
    """True when `model_id` names a model to fetch (a Hub id, `hf://`, `s3://` or `gs://`)."""
    return bool(model_id and model_id.strip()) and scheme_of(str(model_id)) is not None


def canonical_url(model_id: str) -> str:
    """The URL `allowed_model_urls` matches: `s3://b/p` and `gs://b/p` as given, a Hub id as `hf://org/name`."""
    text = model_id.strip()
    return text if "://" in text else f"hf://{text}"


def allowed(model_id: str, prefixes: str | None) -> bool:
    """True when the remote `model_id` lies under one of `prefixes` (comma-separated, `allowed_model_urls`):
    `s3://bucket/models` allows `s3://bucket/models/x`, never `s3://bucket/models-other`; `hf://org` (or
    `org/`) allows the Hub ids `org/...`."""
    url = canonical_url(model_id).rstrip("/")
    for prefix in (p.strip() for p in (prefixes or "").split(",")):
        if not prefix:
            continue
        prefix = canonical_url(prefix) if "://" in prefix else f"hf://{prefix}"
        if url == prefix.rstrip("/") or url.startswith(prefix if prefix.endswith("/") else prefix + "/"):
            return True
    return False


def fetch(model_id: str, options: FetchOptions | None = None) -> Path:
    """The local directory (or `.gguf` file) of the remote model `model_id`, fetched now if needed."""
    options = options or FetchOptions()
    scheme = scheme_of(model_id)
    if scheme == "hf":
        from lmiserve.models.download import hub

        return hub.fetch(model_id.strip().removeprefix("hf://"), options)
    if scheme in ("s3", "gs"):
        from lmiserve.models.download import objects

        return objects.fetch(model_id.strip(), options)
    raise DownloadError(f"model id {model_id!r} is not a Hub id, s3:// or gs:// URL")


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
