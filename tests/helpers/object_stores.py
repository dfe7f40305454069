"""Local S3 and GCS servers for the object-store tests: the real boto3 and google-cloud-storage clients
against moto and gcp-storage-emulator on 127.0.0.1, so no test reaches the internet.

    with s3_server() as s3:
        s3.upload_dir("models", "tiny", tiny_model_dir)
        with run_server(["--model-id", "s3://models/tiny"], env=s3.env) as url: ...
        assert s3.gets("models", "tiny/config.json") == 1

    with gcs_server() as gcs:
        gcs.upload_dir("models", "tiny", tiny_model_dir)
        subprocess.run([...], env={**without_cloud_env(os.environ), **gcs.env})

Both servers run in threads of the test process, on ports the OS picks, and record every request they
answer (`requests`, `gets`), so a test can tell how often a file was fetched and which byte ranges.

`env` holds what a subprocess needs to reach the server and nothing else (no real credentials, no
instance-metadata lookups): layer it over `without_cloud_env(os.environ)`, which drops the
AWS_*/GOOGLE_*/CLOUDSDK_* variables of whoever runs the tests (an AWS_PROFILE naming a profile that
does not exist here would otherwise break boto3 in the subprocess).

moto keeps its buckets in module globals: one `s3_server` at a time per process (pytest-xdist's
workers are separate processes). The GCS emulator keeps its objects in memory, per server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

TEST_ACCESS_KEY_ID = "testing"
TEST_SECRET_ACCESS_KEY = "testing"
TEST_REGION = "us-east-1"
TEST_GCP_PROJECT = "test-project"
LOCALHOST = "127.0.0.1"
MIB = 1024 * 1024

_CLOUD_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCLOUD_", "CLOUDSDK_", "BOTO_")
_CLOUD_ENV_NAMES = ("STORAGE_EMULATOR_HOST", "API_ENDPOINT_OVERRIDE")


def without_cloud_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the variables that steer boto3 or the Google clients (AWS_*, GOOGLE_*, CLOUDSDK_*,
    STORAGE_EMULATOR_HOST, ...): what is left to layer a server's `env` over."""
    return {
        name: value
        for name, value in environ.items()
        if not name.upper().startswith(_CLOUD_ENV_PREFIXES) and name.upper() not in _CLOUD_ENV_NAMES
    }


def _no_proxy_env() -> dict[str, str]:
    """NO_PROXY extended with the loopback names, so a proxy configured for the tests' machine is never asked."""
    existing = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    value = ",".join(part for part in (existing, LOCALHOST, "localhost") if part)
    return {"NO_PROXY": value, "no_proxy": value}


def _files_under(directory: Path) -> list[tuple[str, Path]]:
    """(relative posix path, file) for every file under `directory`, sorted."""
    return sorted((path.relative_to(directory).as_posix(), path) for path in directory.rglob("*") if path.is_file())


def _join_key(prefix: str, relative: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{relative}" if prefix else relative


@dataclass(frozen=True)
class RecordedRequest:
    """One request a server answered: `path` percent-decoded (``/bucket/dir/file`` for S3), `range` the
    Range header as sent (``bytes=0-99``) or None."""

    method: str
    path: str
    query: dict[str, list[str]]
    range: str | None


@dataclass
class _RequestLog:
    entries: list[RecordedRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, entry: RecordedRequest) -> None:
        with self.lock:
            self.entries.append(entry)

    def snapshot(self) -> list[RecordedRequest]:
        with self.lock:
            return list(self.entries)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


# --------------------------------------------------------------------------------------------------- S3 (moto)

_S3_LOCK = threading.Lock()  # moto's backends are process-wide: one server at a time


@dataclass
class S3Server:
    """A moto S3 server (every AWS service moto has, in fact; IAM is used by `user_credentials`)."""

    endpoint_url: str  # http://127.0.0.1:PORT
    _log: _RequestLog = field(repr=False)
    _session: Any = field(default=None, repr=False)  # one boto3 Session: it loads the service models once

    @property
    def env(self) -> dict[str, str]:
        """For a subprocess that uses boto3 (over `without_cloud_env(os.environ)`): the endpoint (both spellings
        boto3 reads; AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL), test credentials, a region, no
        instance-metadata (IMDS) lookups and no config files of the machine's user."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "false",
            "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": TEST_SECRET_ACCESS_KEY,
            "AWS_DEFAULT_REGION": TEST_REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            **_no_proxy_env(),
        }

    def client(self, service: str = "s3", *, config: Any = None, **credentials: str) -> Any:
        """A boto3 client of this server (test credentials unless `aws_access_key_id=`/`aws_secret_access_key=`
        are given); it reads nothing from the environment that could send it elsewhere."""
        import boto3

        kwargs: dict[str, Any] = {
            "aws_access_key_id": TEST_ACCESS_KEY_ID,
            "aws_secret_access_key": TEST_SECRET_ACCESS_KEY,
            **credentials,
        }
        if self._session is None:
            self._session = boto3.session.Session(region_name=TEST_REGION)
        return self._session.client(service, endpoint_url=self.endpoint_url, config=config, **kwargs)

    def create_bucket(self, bucket: str) -> None:
        """Create `bucket` unless it exists (S3 bucket names: 3-63 characters, lowercase, digits, dots, dashes)."""
        client = self.client()
        try:
            client.head_bucket(Bucket=bucket)
        except client.exceptions.ClientError:
            client.create_bucket(Bucket=bucket)

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        """Put one object with a single PutObject (its ETag: the quoted MD5 of `data`)."""
        self.create_bucket(bucket)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def upload_dir(
        self, bucket: str, prefix: str, directory: Path, *, multipart_threshold: int | None = None
    ) -> list[str]:
        """Upload every file under `directory` as ``prefix/relative/path``; the keys, sorted. Files of
        `multipart_threshold` bytes or more go up in 5 MiB parts (ETag ``"<md5 of the parts' md5s>-N"``),
        the others in one PutObject (boto3's own threshold, 8 MiB, when None)."""
        from boto3.s3.transfer import TransferConfig

        self.create_bucket(bucket)
        client = self.client()
        transfer = TransferConfig(
            multipart_threshold=multipart_threshold if multipart_threshold is not None else 8 * MIB,
            multipart_chunksize=5 * MIB if multipart_threshold is not None else 8 * MIB,
            use_threads=False,
        )
        keys = []
        for relative, path in _files_under(Path(directory)):
            key = _join_key(prefix, relative)
            client.upload_file(str(path), bucket, key, Config=transfer)
            keys.append(key)
        return keys

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request answered so far, in order (the helper's own uploads included; `clear_requests`)."""
        return self._log.snapshot()

    def clear_requests(self) -> None:
        self._log.clear()

    def object_requests(self, bucket: str, key: str, method: str = "GET") -> list[RecordedRequest]:
        """The `method` requests of one object (path-style ``/bucket/key``: boto3 addresses an IP endpoint so)."""
        path = f"/{bucket}/{key}"
        return [r for r in self._log.snapshot() if r.method == method and r.path == path]

    def gets(self, bucket: str, key: str) -> int:
        """How many GETs of `key` the server answered (whole or ranged; listings are not counted)."""
        return len(self.object_requests(bucket, key))

    def user_credentials(self, user: str, actions: Sequence[str], resource: str = "*") -> dict[str, str]:
        """Make an IAM user allowed only `actions` (``["s3:ListBucket"]``) on `resource`; its keys as env
        overrides. They only matter under `enforce_auth()` (call this before: IAM itself is then checked)."""
        iam = self.client("iam")
        iam.create_user(UserName=user)
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": list(actions), "Resource": resource}],
        }
        iam.put_user_policy(UserName=user, PolicyName=f"{user}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    @contextlib.contextmanager
    def enforce_auth(self) -> Iterator[None]:
        """While open, moto authenticates and authorizes every request as AWS would, for every client of the
        server (it is server-wide state, set over HTTP: POST /moto-api/reset-auth). An access key moto did not
        issue: 403 InvalidAccessKeyId; a wrong secret: 403 SignatureDoesNotMatch; an action the user's policy
        does not allow: 403 AccessDenied (HEAD requests carry no body: code "403"). `client()`'s test keys are
        unknown to IAM: use `user_credentials(..., ["s3:*"])` for an all-powerful client meanwhile."""
        self._reset_auth("0")
        try:
            yield
        finally:
            self._reset_auth("inf")

    def _reset_auth(self, count: str) -> None:
        self._moto_api("reset-auth", count.encode())

    def _moto_api(self, path: str, data: bytes = b"") -> None:
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/{path}", data=data, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


def _moto_app(log: _RequestLog) -> Any:
    """moto's WSGI application (what `moto_server` and ThreadedMotoServer serve), recording each request."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    app = DomainDispatcherApplication(create_backend_app)

    def recording_app(environ: dict[str, Any], start_response: Any) -> Any:
        raw = urlsplit(environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ.get("PATH_INFO", "/"))
        log.add(
            RecordedRequest(
                method=environ["REQUEST_METHOD"],
                path=unquote(raw.path),
                query=parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True),
                range=environ.get("HTTP_RANGE"),
            )
        )
        return app(environ, start_response)

    return recording_app


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """A moto server on a free port of 127.0.0.1, started empty (POST /moto-api/reset) and stopped at the end.

    moto's ThreadedMotoServer offers no way to wrap its application, so this does what it does (werkzeug's
    threaded server with moto's request handler, in a daemon thread) around a request-recording one, and
    also closes the listening socket at the end (ThreadedMotoServer.stop() leaves it open)."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    class QuietHandler(MotoRequestHandler):
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            pass  # werkzeug would print every request to stderr

    if not _S3_LOCK.acquire(blocking=False):
        raise RuntimeError("another s3_server() is running in this process: moto's state is process-wide")
    try:
        log = _RequestLog()
        server = make_server(LOCALHOST, 0, _moto_app(log), threaded=True, request_handler=QuietHandler)
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="moto-s3", daemon=True)
        thread.start()
        s3 = S3Server(endpoint_url=f"http://{LOCALHOST}:{server.server_port}", _log=log)
        try:
            s3._moto_api("reset")
            s3._reset_auth("inf")
            log.clear()
            yield s3
        finally:
            with contextlib.suppress(OSError):
                s3._reset_auth("inf")
                s3._moto_api("reset")
            server.shutdown()
            server.server_close()
            thread.join()
    finally:
        _S3_LOCK.release()


# --------------------------------------------------------------------------------------------------- GCS

_GCS_OBJECT_PATH = re.compile(r"^(?:/download)?/storage/v1/b/(?P<bucket>[^/]+)/o/(?P<name>.+)$")
_GCS_BUCKET_PATH = re.compile(r"^(?:/download|/upload)?/storage/v1/b/(?P<bucket>[^/?]+)")


@dataclass
class GcsServer:
    """A gcp-storage-emulator (JSON API, in memory). It never checks credentials; `forbid` answers 403."""

    host: str  # http://127.0.0.1:PORT: STORAGE_EMULATOR_HOST, scheme included (the Python client needs it)
    _log: _RequestLog = field(repr=False)
    _forbidden: set[str] = field(default_factory=set, repr=False)

    @property
    def env(self) -> dict[str, str]:
        """For a subprocess that uses google-cloud-storage (over `without_cloud_env(os.environ)`): with
        STORAGE_EMULATOR_HOST set, `storage.Client()` uses anonymous credentials and never looks for real ones
        (no metadata server, no gcloud files)."""
        return {"STORAGE_EMULATOR_HOST": self.host, **_no_proxy_env()}

    def client(self) -> Any:
        """A google.cloud.storage.Client of this server, anonymous; independent of the process's environment."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project=TEST_GCP_PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": self.host}
        )

    def create_bucket(self, bucket: str) -> None:
        client = self.client()
        if client.lookup_bucket(bucket) is None:
            client.create_bucket(bucket)

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        self.create_bucket(bucket)
        self.client().bucket(bucket).blob(name).upload_from_string(data, content_type="application/octet-stream")

    def upload_dir(self, bucket: str, prefix: str, directory: Path) -> list[str]:
        """Upload every file under `directory` as ``prefix/relative/path``; the object names, sorted."""
        self.create_bucket(bucket)
        handle = self.client().bucket(bucket)
        names = []
        for relative, path in _files_under(Path(directory)):
            name = _join_key(prefix, relative)
            handle.blob(name).upload_from_filename(str(path), content_type="application/octet-stream")
            names.append(name)
        return names

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request answered so far (paths percent-decoded; the helper's own uploads included)."""
        return self._log.snapshot()

    def clear_requests(self) -> None:
        self._log.clear()

    def media_requests(self, bucket: str, name: str) -> list[RecordedRequest]:
        """The downloads of one object's data (GET ...?alt=media), whole or ranged; metadata GETs excluded."""
        found = []
        for request in self._log.snapshot():
            match = _GCS_OBJECT_PATH.match(request.path)
            if (
                request.method == "GET"
                and request.query.get("alt") == ["media"]
                and match is not None
                and (match["bucket"], match["name"]) == (bucket, name)
            ):
                found.append(request)
        return found

    def gets(self, bucket: str, name: str) -> int:
        """How many downloads of `name`'s data the server answered."""
        return len(self.media_requests(bucket, name))

    @contextlib.contextmanager
    def forbid(self, bucket: str) -> Iterator[None]:
        """While open, every request naming `bucket` is answered 403 with GCS's JSON error body (the emulator
        has no authorization of its own); the client raises google.api_core.exceptions.Forbidden."""
        self._forbidden.add(bucket)
        try:
            yield
        finally:
            self._forbidden.discard(bucket)


def _gcs_handler(log: _RequestLog, forbidden: set[str]) -> type:
    from gcp_storage_emulator.server import RequestHandler

    class RecordingHandler(RequestHandler):
        def parse_request(self) -> bool:
            if not super().parse_request():
                return False
            raw = urlsplit(self.path)
            log.add(
                RecordedRequest(
                    method=self.command,
                    path=unquote(raw.path),  # an object name's "/" travels as %2F (or bare, in a media_link)
                    query=parse_qs(raw.query, keep_blank_values=True),
                    range=self.headers.get("Range"),
                )
            )
            bucket = _GCS_BUCKET_PATH.match(raw.path)
            if bucket is not None and unquote(bucket["bucket"]) in forbidden:
                body = json.dumps(
                    {"error": {"code": 403, "message": "Forbidden", "errors": [{"reason": "forbidden"}]}}
                ).encode()
                self.send_response(403)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return False
            return True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return RecordingHandler


@contextlib.contextmanager
def gcs_server() -> Iterator[GcsServer]:
    """gcp-storage-emulator's request handler and in-memory storage on a free port of 127.0.0.1, served by a
    threading HTTP server (the emulator's own serves one request at a time) in a daemon thread."""
    from gcp_storage_emulator.storage import Storage

    log = _RequestLog()
    forbidden: set[str] = set()
    storage = Storage(use_memory_fs=True)
    server = ThreadingHTTPServer((LOCALHOST, 0), partial(_gcs_handler(log, forbidden), storage))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="gcs-emulator", daemon=True)
    thread.start()
    try:
        yield GcsServer(host=f"http://{LOCALHOST}:{server.server_port}", _log=log, _forbidden=forbidden)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
