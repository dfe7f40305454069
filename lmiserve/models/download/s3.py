"""`s3://bucket/prefix` through `boto3`: the standard credential chain (environment, profile, SSO, the
instance's or task's role) and `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for MinIO and other S3-compatible
stores, both as boto3 reads them."""

from __future__ import annotations

import re
from typing import Any

from lmiserve.models.download.common import DownloadError
from lmiserve.models.download.selection import RemoteFile

_MD5 = re.compile(r"^[0-9a-f]{32}$")
_DENIED = frozenset(
    {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
     "AllAccessDisabled", "AccountProblem", "Forbidden"}
)  # fmt: skip
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling", "500", "502", "503", "504"}
)


class S3Bucket:
    """A prefix of an S3 bucket (objects.Bucket)."""

    def __init__(self, url: str, bucket: str, prefix: str) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise DownloadError(f"{url}: s3:// models need boto3: pip install 'lmiserve[s3]'") from None
        self.url, self.bucket, self.prefix = url, bucket, prefix
        config = Config(
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
            max_pool_connections=16,
        )
        self.client: Any = boto3.session.Session().client("s3", config=config)

    def list(self) -> list[RemoteFile]:
        found = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", []):
                key = str(item["Key"])
                if key.endswith("/"):  # a "folder" marker
                    continue
                found.append(RemoteFile(key[len(self.prefix) :], int(item["Size"]), str(item["ETag"]).strip('"')))
        return found

    def digest(self, file: RemoteFile) -> tuple[str, str] | None:
        """The MD5 of an object uploaded in one part and not encrypted with KMS or a customer key: its ETag.
        (A multipart object's ETag, `md5-N`, and an SSE-KMS object's are no digest of its bytes.)"""
        if not _MD5.match(file.etag):
            return None
        head = self.client.head_object(Bucket=self.bucket, Key=self.prefix + file.name, IfMatch=f'"{file.etag}"')
        if head.get("SSECustomerAlgorithm") or str(head.get("ServerSideEncryption", "")).startswith("aws:kms"):
            return None
        return ("md5", file.etag)

    def read(self, file: RemoteFile, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        response = self.client.get_object(
            Bucket=self.bucket, Key=self.prefix + file.name, Range=f"bytes={start}-{end - 1}", IfMatch=f'"{file.etag}"'
        )
        body = response["Body"]
        try:
            return bytes(body.read())
        finally:
            body.close()

    def transient(self, exc: BaseException) -> bool:
        from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, ReadTimeoutError
        from botocore.exceptions import ConnectTimeoutError as BotoConnectTimeout

        if isinstance(exc, EndpointConnectionError | ConnectionClosedError | ReadTimeoutError | BotoConnectTimeout):
            return True
        if isinstance(exc, ClientError):
            return _code(exc) in _TRANSIENT_CODES
        return isinstance(exc, ConnectionError | TimeoutError)

    def error(self, exc: BaseException) -> DownloadError:
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return DownloadError(
                f"no AWS credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                "or run with an instance or task role"
            )
        if isinstance(exc, ClientError):
            code = _code(exc)
            if code in ("NoSuchBucket",):
                return DownloadError(f"bucket {self.bucket} does not exist ({self.url})")
            if code in _DENIED:
                return DownloadError(
                    f"access to {self.url} was denied ({code}): check the AWS credentials (AWS_PROFILE, "
                    "AWS_ACCESS_KEY_ID, the instance or task role) and the bucket's policy"
                )
            if code in ("PreconditionFailed", "412"):
                return DownloadError(f"an object under {self.url} changed while it downloaded: start again")
            return DownloadError(f"S3 refused {self.url}: {code}: {exc.response.get('Error', {}).get('Message', '')}")
        return DownloadError(f"downloading {self.url} failed: {type(exc).__name__}: {' '.join(str(exc).split())}")


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", "")) or str(
        exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )
