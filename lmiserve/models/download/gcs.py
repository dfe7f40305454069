"""`gs://bucket/prefix` (Vertex AI's `AIP_STORAGE_URI`) through `google-cloud-storage`: Application Default
Credentials (the service account on Vertex AI and GKE, `GOOGLE_APPLICATION_CREDENTIALS` elsewhere), anonymous
access to a public bucket when there are none, and `STORAGE_EMULATOR_HOST` for an emulator. The client's own
retries are off (`retry=None`): `download_retries` governs every source alike (download/__init__.py)."""

from __future__ import annotations

import base64
import os
from typing import Any

from lmiserve.models.download.common import DownloadError
from lmiserve.models.download.selection import RemoteFile


class GcsBucket:
    """A prefix of a GCS bucket (objects.Bucket)."""

    def __init__(self, url: str, bucket: str, prefix: str) -> None:
        try:
            from google.cloud import storage
        except ImportError:
            raise DownloadError(f"{url}: gs:// models need google-cloud-storage: pip install 'lmiserve[gcs]'") from None
        self.url, self.bucket_name, self.prefix = url, bucket, prefix
        self.client: Any = _client(storage)
        self.bucket: Any = self.client.bucket(bucket)
        self._generations: dict[str, int] = {}

    def list(self) -> list[RemoteFile]:
        found = []
        for blob in self.client.list_blobs(self.bucket_name, prefix=self.prefix, retry=None, timeout=60):
            name = str(blob.name)
            if name.endswith("/"):
                continue
            relative = name[len(self.prefix) :]
            digest = ("md5", base64.b64decode(blob.md5_hash).hex()) if blob.md5_hash else None
            self._generations[relative] = int(blob.generation) if blob.generation else 0
            found.append(RemoteFile(relative, int(blob.size or 0), str(blob.etag or blob.generation), digest))
        return found

    def digest(self, file: RemoteFile) -> tuple[str, str] | None:
        return file.digest

    def read(self, file: RemoteFile, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        generation = self._generations.get(file.name) or None
        blob = self.bucket.blob(self.prefix + file.name, generation=generation)
        return bytes(blob.download_as_bytes(start=start, end=end - 1, checksum=None, timeout=60, retry=None))

    def transient(self, exc: BaseException) -> bool:
        from google.api_core import exceptions as api

        if isinstance(exc, api.TooManyRequests | api.InternalServerError | api.BadGateway | api.ServiceUnavailable):
            return True
        if isinstance(exc, api.GatewayTimeout | api.RetryError):
            return True
        try:
            import requests

            if isinstance(exc, requests.ConnectionError | requests.Timeout):
                return True
        except ImportError:  # pragma: no cover - google-cloud-storage depends on requests
            pass
        return isinstance(exc, ConnectionError | TimeoutError)

    def error(self, exc: BaseException) -> DownloadError:
        from google.api_core import exceptions as api

        if isinstance(exc, api.NotFound):
            return DownloadError(f"bucket {self.bucket_name} does not exist, or an object of {self.url} vanished")
        if isinstance(exc, api.Forbidden | api.Unauthorized):
            return DownloadError(
                f"access to {self.url} was denied ({getattr(exc, 'code', '')}): check the credentials "
                "(GOOGLE_APPLICATION_CREDENTIALS, the service account) and its roles on the bucket"
            )
        if isinstance(exc, api.PreconditionFailed):
            return DownloadError(f"an object under {self.url} changed while it downloaded: start again")
        return DownloadError(f"downloading {self.url} failed: {type(exc).__name__}: {' '.join(str(exc).split())}")


def _client(storage: Any) -> Any:
    """A client: anonymous against an emulator or without credentials (a public bucket), else ADC's."""
    project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUD_ML_PROJECT_ID")
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or "lmiserve", credentials=AnonymousCredentials())
    try:
        return storage.Client(project=project)
    except Exception as exc:  # noqa: BLE001 - no Application Default Credentials: a public bucket may still serve
        from google.auth.exceptions import DefaultCredentialsError

        if not isinstance(exc, DefaultCredentialsError):
            raise
        return storage.Client.create_anonymous_client()
