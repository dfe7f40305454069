"""The local object stores of tests/helpers/object_stores.py, driven by the real clients the way the model
downloader uses them: boto3 against moto (S3) and google-cloud-storage against gcp-storage-emulator (GCS).

What these pin down: listings under a prefix (key, size, ETag/MD5/CRC32C), ranged reads (inclusive
ends), multipart ETags, the exceptions of a missing bucket, of a refused request and of a server that is
down, how long each client retries by default and how to bound it, and that a subprocess needs nothing
but the server's `env` (no real credentials, no metadata-server lookups).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import google_crc32c
import pytest
import requests
from botocore.config import Config
from google.api_core import exceptions as google_exceptions
from google.cloud import storage as gcs_storage
from google.cloud.storage.retry import DEFAULT_RETRY

from helpers.object_stores import MIB, GcsServer, S3Server, gcs_server, s3_server, without_cloud_env

FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": bytes(range(256)) * 3,
    "sub dir/ü+weights.bin": b"\x00\x01" * 1000,  # a space, a '+' and non-ASCII: percent-encoding round trips
    "nested/a/b.txt": b"b",
    "empty.txt": b"",
}
BIG = 9 * MIB + 123  # over boto3's own multipart threshold (8 MiB) too


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsServer]:
    with gcs_server() as server:
        yield server


@pytest.fixture(autouse=True)
def _no_cloud_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever AWS_*/GOOGLE_* variables the machine has, the in-process clients here never see them."""
    for name in list(os.environ):
        if name not in without_cloud_env({name: ""}):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    for relative, data in FILES.items():
        path = tmp_path / "model" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return tmp_path / "model"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_python(code: str, env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    """Run `code` in a fresh interpreter with `env` over a cloud-free environment (HOME empty: no ~/.aws,
    no gcloud files); the JSON it prints last."""
    full_env = {**without_cloud_env(os.environ), "HOME": str(tmp_path), **env}
    done = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


# ------------------------------------------------------------------------------------------------ S3


def test_s3_listing_pages_under_a_prefix_give_key_size_and_etag(s3: S3Server, model_dir: Path) -> None:
    keys = s3.upload_dir("listing", "models/tiny", model_dir)
    s3.upload("listing", "models/tiny-other/x", b"not under the prefix with its slash")
    client = s3.client()
    pages = list(
        client.get_paginator("list_objects_v2").paginate(
            Bucket="listing", Prefix="models/tiny/", PaginationConfig={"PageSize": 2}
        )
    )
    assert len(pages) == 3  # 5 objects, 2 a page: the paginator follows the continuation tokens
    listed = {item["Key"]: item for page in pages for item in page.get("Contents", [])}
    assert sorted(listed) == keys == sorted(f"models/tiny/{relative}" for relative in FILES)
    for relative, data in FILES.items():
        item = listed[f"models/tiny/{relative}"]
        assert item["Size"] == len(data)
        assert item["ETag"] == f'"{md5_hex(data)}"'  # quoted, as S3 sends it
    body = client.get_object(Bucket="listing", Key="models/tiny/sub dir/ü+weights.bin")["Body"].read()
    assert body == FILES["sub dir/ü+weights.bin"]


def test_s3_ranged_get_returns_exactly_the_range_and_is_counted(s3: S3Server) -> None:
    data = bytes(range(256)) * 4
    s3.upload("ranges", "blob.bin", data)
    client = s3.client()
    s3.clear_requests()

    part = client.get_object(Bucket="ranges", Key="blob.bin", Range="bytes=10-19")
    assert part["Body"].read() == data[10:20]  # both ends inclusive
    assert part["ContentRange"] == f"bytes 10-19/{len(data)}"
    assert part["ContentLength"] == 10
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert client.get_object(Bucket="ranges", Key="blob.bin", Range="bytes=1000-")["Body"].read() == data[1000:]
    assert client.get_object(Bucket="ranges", Key="blob.bin", Range="bytes=1020-5000")["Body"].read() == data[1020:]
    with pytest.raises(botocore.exceptions.ClientError) as raised:
        client.get_object(Bucket="ranges", Key="blob.bin", Range=f"bytes={len(data)}-")
    assert raised.value.response["Error"]["Code"] == "InvalidRange"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 416

    assert s3.gets("ranges", "blob.bin") == 4
    assert [r.range for r in s3.object_requests("ranges", "blob.bin")][:2] == ["bytes=10-19", "bytes=1000-"]
    client.list_objects_v2(Bucket="ranges")
    assert s3.gets("ranges", "blob.bin") == 4  # a listing is no GET of the object


def test_s3_multipart_upload_has_an_md5_dash_parts_etag(s3: S3Server, tmp_path: Path) -> None:
    data = os.urandom(BIG)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "model.safetensors").write_bytes(data)
    s3.upload_dir("multipart", "m", tmp_path / "big", multipart_threshold=1 * MIB)

    parts = [data[i : i + 5 * MIB] for i in range(0, len(data), 5 * MIB)]
    expected = f'"{md5_hex(b"".join(hashlib.md5(p).digest() for p in parts))}-{len(parts)}"'
    client = s3.client()
    (item,) = client.list_objects_v2(Bucket="multipart", Prefix="m/")["Contents"]
    assert (item["Key"], item["Size"], item["ETag"]) == ("m/model.safetensors", BIG, expected)
    assert expected.endswith('-2"')  # not the MD5 of the content: a downloader cannot check it as one
    head = client.head_object(Bucket="multipart", Key="m/model.safetensors")
    assert head["ETag"] == expected
    tail = client.get_object(Bucket="multipart", Key="m/model.safetensors", Range=f"bytes={5 * MIB - 3}-{5 * MIB + 2}")
    assert tail["Body"].read() == data[5 * MIB - 3 : 5 * MIB + 3]  # across the parts' border


def test_s3_missing_bucket_and_key(s3: S3Server) -> None:
    client = s3.client()
    with pytest.raises(client.exceptions.NoSuchBucket) as raised:  # a subclass of botocore's ClientError
        client.list_objects_v2(Bucket="no-such-bucket", Prefix="m/")
    assert isinstance(raised.value, botocore.exceptions.ClientError)
    assert raised.value.response["Error"]["Code"] == "NoSuchBucket"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    with pytest.raises(client.exceptions.NoSuchBucket):
        client.get_object(Bucket="no-such-bucket", Key="m/config.json")

    s3.create_bucket("present")
    with pytest.raises(client.exceptions.NoSuchKey) as raised:
        client.get_object(Bucket="present", Key="m/config.json")
    assert raised.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(botocore.exceptions.ClientError) as raised:
        client.head_object(Bucket="present", Key="m/config.json")
    assert raised.value.response["Error"]["Code"] == "404"  # HEAD answers carry no body: the status is the code


def test_s3_endpoint_comes_from_the_environment(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3.env.items():
        if name != "AWS_ENDPOINT_URL_S3":
            monkeypatch.setenv(name, value)
    s3.upload("endpoints", "k", b"v")
    client = boto3.client("s3")  # no endpoint_url, no credentials: all from the environment
    assert client.meta.endpoint_url == s3.endpoint_url
    assert client.get_object(Bucket="endpoints", Key="k")["Body"].read() == b"v"

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint_url)  # the service's own variable wins
    assert boto3.client("s3").meta.endpoint_url == s3.endpoint_url
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert boto3.client("s3").meta.endpoint_url == "https://s3.amazonaws.com"


def test_s3_subprocess_needs_only_the_env(s3: S3Server, model_dir: Path, tmp_path: Path) -> None:
    s3.upload_dir("subprocess", "tiny", model_dir)
    s3.clear_requests()
    code = """if True:
        import json, boto3
        client = boto3.client("s3")
        keys = [o["Key"] for p in client.get_paginator("list_objects_v2").paginate(Bucket="subprocess", Prefix="tiny/")
                for o in p["Contents"]]
        body = client.get_object(Bucket="subprocess", Key="tiny/config.json", Range="bytes=0-0")["Body"].read()
        print(json.dumps({"keys": keys, "first": body.decode(), "endpoint": client.meta.endpoint_url}))
    """
    result = run_python(code, s3.env, tmp_path)
    assert result == {"keys": sorted(f"tiny/{r}" for r in FILES), "first": "{", "endpoint": s3.endpoint_url}
    assert s3.gets("subprocess", "tiny/config.json") == 1


def test_s3_access_denied_invalid_key_and_bad_signature(s3: S3Server, tmp_path: Path) -> None:
    s3.upload("guarded", "m/config.json", b"{}")
    lister = s3.user_credentials("lister", ["s3:ListBucket"])  # may list, may not read
    code = """if True:
        import json, boto3, botocore.exceptions
        client = boto3.client("s3")
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="guarded")["Contents"]]
        try:
            client.get_object(Bucket="guarded", Key="m/config.json")
            error = None
        except botocore.exceptions.ClientError as e:
            error = [type(e).__name__, e.response["Error"]["Code"], e.response["ResponseMetadata"]["HTTPStatusCode"]]
        print(json.dumps({"keys": keys, "error": error}))
    """
    with s3.enforce_auth():
        result = run_python(code, {**s3.env, **lister}, tmp_path)
        assert result == {"keys": ["m/config.json"], "error": ["AccessDenied", "AccessDenied", 403]}

        def error_of(call: Any) -> tuple[str, int]:
            with pytest.raises(botocore.exceptions.ClientError) as raised:
                call()
            return raised.value.response["Error"]["Code"], raised.value.response["ResponseMetadata"]["HTTPStatusCode"]

        unknown = s3.client()  # the test keys: unknown to moto's IAM
        assert error_of(lambda: unknown.list_objects_v2(Bucket="guarded")) == ("InvalidAccessKeyId", 403)
        wrong = s3.client(aws_access_key_id=lister["AWS_ACCESS_KEY_ID"], aws_secret_access_key="wrong")
        assert error_of(lambda: wrong.get_object(Bucket="guarded", Key="m/config.json")) == (
            "SignatureDoesNotMatch",
            403,
        )
        reader = s3.client(
            aws_access_key_id=lister["AWS_ACCESS_KEY_ID"], aws_secret_access_key=lister["AWS_SECRET_ACCESS_KEY"]
        )
        assert error_of(lambda: reader.head_object(Bucket="guarded", Key="m/config.json")) == ("403", 403)
    assert s3.client().get_object(Bucket="guarded", Key="m/config.json")["Body"].read() == b"{}"  # enforcement over


def test_s3_without_credentials_fails_at_once(s3: S3Server) -> None:
    client = boto3.session.Session(region_name="us-east-1").client("s3", endpoint_url=s3.endpoint_url)
    started = time.monotonic()
    with pytest.raises(botocore.exceptions.NoCredentialsError, match="Unable to locate credentials"):
        client.list_objects_v2(Bucket="anything")
    assert time.monotonic() - started < 5  # AWS_EC2_METADATA_DISABLED: no instance-metadata wait


def _attempts(client: Any) -> list[int]:
    sent = [0]

    def count(**_: Any) -> None:
        sent[0] += 1

    client.meta.events.register("before-send", count)
    return sent


def test_s3_server_down_is_retried_briefly_then_endpoint_connection_error() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}

    default = boto3.client("s3", endpoint_url=url, **credentials)
    assert default.meta.config.retries == {"mode": "standard"}  # botocore's default mode now: 3 attempts in all
    sent = _attempts(default)
    started = time.monotonic()
    with pytest.raises(botocore.exceptions.EndpointConnectionError) as raised:
        default.list_objects_v2(Bucket="models")
    assert isinstance(raised.value, botocore.exceptions.ConnectionError)  # also a BotoCoreError, not a ClientError
    assert sent[0] == 3
    assert time.monotonic() - started < 5  # standard mode backs off rand(0, 1) * 50 ms * 2**i for errors like this

    once = boto3.client("s3", endpoint_url=url, config=Config(retries={"total_max_attempts": 1}), **credentials)
    sent = _attempts(once)
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        once.list_objects_v2(Bucket="models")
    assert sent[0] == 1
    # max_attempts counts the retries only: {"max_attempts": 1} makes 2 attempts in all
    twice = Config(retries={"max_attempts": 1, "mode": "standard"})
    assert boto3.client("s3", endpoint_url=url, config=twice, **credentials).meta.config.retries == {
        "mode": "standard",
        "total_max_attempts": 2,
    }


def test_s3_stalled_server_is_a_read_timeout() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # accepts connections (the kernel does), never answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        config = Config(connect_timeout=1, read_timeout=0.3, retries={"total_max_attempts": 2})
        client = boto3.client(
            "s3",
            endpoint_url=url,
            config=config,
            aws_access_key_id="t",
            aws_secret_access_key="t",
            region_name="us-east-1",
        )
        sent = _attempts(client)
        with pytest.raises(botocore.exceptions.ReadTimeoutError):
            client.get_object(Bucket="models", Key="config.json")
        assert sent[0] == 2


# ------------------------------------------------------------------------------------------------ GCS


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def test_gcs_listing_under_a_prefix_gives_name_size_and_hashes(gcs: GcsServer, model_dir: Path) -> None:
    names = gcs.upload_dir("listing", "models/tiny", model_dir)
    gcs.upload("listing", "models/tiny-other/x", b"not under the prefix with its slash")
    blobs = list(gcs.client().list_blobs("listing", prefix="models/tiny/", page_size=2))
    # the emulator ignores page_size (maxResults) and sends one page: paging itself is not exercised here
    assert [b.name for b in blobs] == names == sorted(f"models/tiny/{relative}" for relative in FILES)
    for blob in blobs:
        data = FILES[blob.name.removeprefix("models/tiny/")]
        assert blob.size == len(data)
        assert blob.md5_hash == md5_b64(data)  # base64 of the digest, as GCS sends it
        assert blob.crc32c == crc32c_b64(data)
        assert blob.etag  # the emulator's etag is the md5_hash; real GCS's is an opaque string
        assert blob.generation
    body = gcs.client().bucket("listing").blob("models/tiny/sub dir/ü+weights.bin").download_as_bytes()
    assert body == FILES["sub dir/ü+weights.bin"]


def test_gcs_ranged_download_returns_exactly_the_range_and_is_counted(gcs: GcsServer) -> None:
    data = bytes(range(256)) * 4
    gcs.upload("ranges", "dir/blob.bin", data)
    blob = gcs.client().bucket("ranges").blob("dir/blob.bin")  # no metadata fetched: the name is enough
    gcs.clear_requests()

    assert blob.download_as_bytes(start=10, end=19) == data[10:20]  # end inclusive, like HTTP's Range
    assert blob.download_as_bytes(start=1000) == data[1000:]
    assert blob.download_as_bytes(start=1020, end=5000) == data[1020:]
    assert blob.download_as_bytes(start=len(data)) == b""  # the emulator: empty; real GCS answers 416
    assert blob.download_as_bytes() == data  # whole: checked against the x-goog-hash the server sends

    (listed,) = gcs.client().list_blobs("ranges", prefix="dir/")
    assert listed.download_as_bytes(start=0, end=0) == data[:1]  # through the media_link the listing gave

    assert gcs.gets("ranges", "dir/blob.bin") == 6
    ranges = [r.range for r in gcs.media_requests("ranges", "dir/blob.bin")]
    assert ranges == ["bytes=10-19", "bytes=1000-", "bytes=1020-5000", f"bytes={len(data)}-", None, "bytes=0-0"]


def test_gcs_missing_bucket_and_object_are_not_found(gcs: GcsServer) -> None:
    client = gcs.client()
    with pytest.raises(google_exceptions.NotFound) as raised:
        list(client.list_blobs("no-such-bucket", prefix="m/"))
    assert raised.value.code == 404
    with pytest.raises(google_exceptions.NotFound):
        client.bucket("no-such-bucket").blob("m/config.json").download_as_bytes()
    gcs.create_bucket("present")
    with pytest.raises(google_exceptions.NotFound):
        client.bucket("present").blob("m/config.json").download_as_bytes()
    assert client.bucket("present").get_blob("m/config.json") is None


def test_gcs_forbidden_bucket(gcs: GcsServer) -> None:
    gcs.upload("secret", "m/config.json", b"{}")
    client = gcs.client()
    with gcs.forbid("secret"):
        with pytest.raises(google_exceptions.Forbidden) as raised:
            list(client.list_blobs("secret", prefix="m/"))
        assert raised.value.code == 403
        with pytest.raises(google_exceptions.Forbidden):
            client.bucket("secret").blob("m/config.json").download_as_bytes(start=0, end=0)
    assert client.bucket("secret").blob("m/config.json").download_as_bytes() == b"{}"


def test_gcs_subprocess_needs_only_the_env_and_no_google_credentials(
    gcs: GcsServer, model_dir: Path, tmp_path: Path
) -> None:
    gcs.upload_dir("subprocess", "tiny", model_dir)
    gcs.clear_requests()
    code = """if True:
        import json
        from google.cloud import storage
        client = storage.Client()  # STORAGE_EMULATOR_HOST: anonymous credentials, google.auth.default() never asked
        anonymous = storage.Client.create_anonymous_client()
        names = [b.name for b in client.list_blobs("subprocess", prefix="tiny/")]
        body = anonymous.bucket("subprocess").blob("tiny/config.json").download_as_bytes(start=0, end=0)
        print(json.dumps({"names": names, "first": body.decode(), "credentials": type(client._credentials).__name__}))
    """
    env = {**gcs.env, "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "absent.json")}  # not even read
    result = run_python(code, env, tmp_path)
    assert result == {"names": sorted(f"tiny/{r}" for r in FILES), "first": "{", "credentials": "AnonymousCredentials"}
    assert gcs.gets("subprocess", "tiny/config.json") == 1


def test_gcs_emulator_host_needs_its_scheme(gcs: GcsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.host.removeprefix("http://"))
    with pytest.raises(requests.exceptions.InvalidSchema):
        list(gcs_storage.Client().list_blobs("anything", retry=None))


def test_gcs_server_down_retries_for_two_minutes_unless_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{closed_port()}")
    client = gcs_storage.Client()
    blob = client.bucket("models").blob("config.json")
    assert DEFAULT_RETRY.timeout == 120.0  # the default of list_blobs/download_as_bytes: 1 s, 2 s, 4 s ... for 120 s

    with pytest.raises(requests.exceptions.ConnectionError):
        blob.download_as_bytes(retry=None)  # one attempt: requests' own exception
    with pytest.raises(requests.exceptions.ConnectionError):
        list(client.list_blobs("models", retry=None))

    started = time.monotonic()
    with pytest.raises(google_exceptions.RetryError) as raised:
        blob.download_as_bytes(retry=DEFAULT_RETRY.with_timeout(0.5))
    assert isinstance(raised.value.cause, requests.exceptions.ConnectionError)
    assert time.monotonic() - started < 5

    # the default retries such errors (not only its first attempt): a server that hangs up on every request
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.05)
        accepted = [0]
        stop = threading.Event()

        def hang_up() -> None:
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                except TimeoutError:
                    continue
                accepted[0] += 1
                connection.close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{listener.getsockname()[1]}")
        hung_up = gcs_storage.Client().bucket("models").blob("config.json")
        fast = DEFAULT_RETRY.with_delay(initial=0.01, maximum=0.01).with_timeout(0.5)
        try:
            with pytest.raises(google_exceptions.RetryError) as raised:
                hung_up.download_as_bytes(retry=fast)
        finally:
            stop.set()
            thread.join()
        assert isinstance(raised.value.cause, requests.exceptions.ConnectionError)
        assert accepted[0] >= 3
