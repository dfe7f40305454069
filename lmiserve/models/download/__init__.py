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

import re
from pathlib import Path
from typing import TYPE_CHECKING

from lmiserve.models.download.common import (
    BACKOFF_CAP,
    DownloadError,
    FetchOptions,
    check_disk_space,
    file_digest,
    mismatch,
    one_line,
    with_retries,
)

if TYPE_CHECKING:
    from lmiserve.config import Settings

__all__ = [  # what the sources share (common.py), and the front door's own
    "BACKOFF_CAP",
    "SCHEMES",
    "DownloadError",
    "FetchOptions",
    "adapter_options",
    "allowed",
    "canonical_url",
    "check_disk_space",
    "fetch",
    "file_digest",
    "is_remote",
    "mismatch",
    "one_line",
    "scheme_of",
    "with_retries",
]

SCHEMES = ("s3", "gs", "hf")
# "org/name" or "name" as the Hub spells repo ids, with an optional ":QUANT" GGUF tag
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


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
