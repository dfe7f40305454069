"""Models in object stores (lmiserve/models/download/objects.py, s3.py, gcs.py, parts.py) through the real boto3
and google-cloud-storage clients, against moto's S3 server and a GCS emulator (helpers.object_stores): only the
serving files, a cache keyed by URL and ETag, parallel ranged parts that resume, verification, and one line for
every error."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from helpers.object_stores import GcsServer, S3Server, gcs_server, s3_server, without_cloud_env
from helpers.server import free_port
from lmiserve.models.download import DownloadError, FetchOptions, fetch, parts
from lmiserve.models.download.gcs import GcsBucket
from lmiserve.models.download.s3 import S3Bucket

WEIGHTS = bytes(range(256)) * 160  # 40 KiB: ten parts of 4 KiB
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "model.safetensors": WEIGHTS,
    "pytorch_model.bin": b"the same weights, pickled",
    "README.md": b"# tiny",
}
SERVED = ["config.json", "model.safetensors", "tokenizer.json"]


def write_model(directory: Path, files: dict[str, bytes] = FILES) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cloud variable of the machine running the tests reaches the clients."""
    for name in set(os.environ) - set(without_cloud_env(os.environ)):
        monkeypatch.delenv(name)


T = TypeVar("T", S3Server, GcsServer)


def serving_the_model(server: T, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> T:
    """`server` holding the model as models/tiny, and this process's clients pointed at it."""
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    server.upload_dir("models", "tiny", write_model(tmp_path / "src"))
    return server


@pytest.fixture
def s3(clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3Server]:
    with s3_server() as server:
        yield serving_the_model(server, monkeypatch, tmp_path)


@pytest.fixture
def gcs(clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[GcsServer]:
    with gcs_server() as server:
        yield serving_the_model(server, monkeypatch, tmp_path)


@pytest.fixture
def options(tmp_path: Path) -> FetchOptions:
    return FetchOptions(download_dir=tmp_path / "downloads", retries=1, backoff=0.01, part_size=4096)


def test_s3_fetches_the_serving_files_once(s3: S3Server, options: FetchOptions) -> None:
    folder = fetch("s3://models/tiny", options)
    assert folder == options.objects_dir() / "s3" / "models" / "tiny"
    assert listing(folder) == SERVED
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert s3.gets("models", "tiny/model.safetensors") == 10  # ranged parts
    assert s3.gets("models", "tiny/pytorch_model.bin") == 0
    manifest = json.loads((folder / ".lmiserve-manifest.json").read_text())
    assert sorted(manifest) == SERVED
    s3.clear_requests()
    assert fetch("s3://models/tiny/", options) == folder  # a second start lists, and downloads nothing
    assert [r.method for r in s3.requests] == ["GET"] and "list-type" in s3.requests[0].query


def test_s3_a_changed_object_is_downloaded_again_alone(s3: S3Server, options: FetchOptions) -> None:
    folder = fetch("s3://models/tiny", options)
    s3.upload("models", "tiny/config.json", b'{"model_type": "mistral"}')
    s3.clear_requests()
    fetch("s3://models/tiny", options)
    assert (folder / "config.json").read_bytes() == b'{"model_type": "mistral"}'
    assert s3.gets("models", "tiny/config.json") == 1
    assert s3.gets("models", "tiny/model.safetensors") == 0


def test_s3_multipart_objects_verify_by_size(s3: S3Server, options: FetchOptions, tmp_path: Path) -> None:
    big = write_model(tmp_path / "big", {"config.json": b"{}", "model.safetensors": os.urandom(6 << 20)})
    s3.upload_dir("models", "big", big, multipart_threshold=5 << 20)
    folder = fetch("s3://models/big", FetchOptions(download_dir=options.download_dir))
    assert (folder / "model.safetensors").read_bytes() == (big / "model.safetensors").read_bytes()


def test_s3_an_interrupted_download_resumes(
    s3: S3Server, options: FetchOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_read = S3Bucket.read
    reads = {"n": 0}

    def dies_after_four(self: S3Bucket, file: object, start: int, end: int) -> bytes:
        reads["n"] += 1
        if reads["n"] > 4:
            raise KeyboardInterrupt  # as a kill: nothing is cleaned up
        return real_read(self, file, start, end)  # type: ignore[arg-type]

    monkeypatch.setattr(parts, "WORKERS", 1)
    monkeypatch.setattr(S3Bucket, "read", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        fetch("s3://models/tiny", options)
    monkeypatch.setattr(S3Bucket, "read", real_read)
    s3.clear_requests()
    folder = fetch("s3://models/tiny", options)
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    gets = sum(s3.gets("models", f"tiny/{name}") for name in SERVED)
    assert gets == 12 - 4  # config, tokenizer and ten parts of the weights; four were written before


def test_s3_a_corrupt_object_fails_its_md5(s3: S3Server, options: FetchOptions, monkeypatch: pytest.MonkeyPatch):
    real_read = S3Bucket.read

    def flips(self: S3Bucket, file: object, start: int, end: int) -> bytes:
        data = real_read(self, file, start, end)  # type: ignore[arg-type]
        return data[:-1] + bytes([data[-1] ^ 1]) if getattr(file, "name", "") == "config.json" else data

    monkeypatch.setattr(S3Bucket, "read", flips)
    with pytest.raises(DownloadError, match=r"^file config.json of s3://models/tiny failed verification \(its md5 is"):
        fetch("s3://models/tiny", options)


def test_s3_errors_are_one_line(s3: S3Server, options: FetchOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DownloadError, match=r"^bucket nobucket does not exist \(s3://nobucket/tiny\)$"):
        fetch("s3://nobucket/tiny", options)
    with pytest.raises(DownloadError, match=r"^s3://models/empty holds no model: it has no files$"):
        fetch("s3://models/empty", options)
    s3.upload("models", "notes/readme.txt", b"hello")
    with pytest.raises(DownloadError, match=r"^s3://models/notes holds no model: no config.json, adapter_config"):
        fetch("s3://models/notes", options)
    lister = s3.user_credentials("lister", ["s3:ListBucket"])
    with s3.enforce_auth():
        for name, value in lister.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(DownloadError, match=r"^access to s3://models/tiny was denied \(AccessDenied\): check the"):
            fetch("s3://models/tiny", options)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTISSUED")
        with pytest.raises(DownloadError, match=r"was denied \(InvalidAccessKeyId\)"):
            fetch("s3://models/tiny", options)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(DownloadError, match=r"^no AWS credentials for s3://models/tiny: set AWS_ACCESS_KEY_ID"):
        fetch("s3://models/tiny", options)


def test_s3_down_uses_the_cache_or_says_so(
    s3: S3Server, options: FetchOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = fetch("s3://models/tiny", options)
    s3.upload("models", "other/config.json", b"{}")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # the store is down
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")
    assert fetch("s3://models/tiny", options) == folder  # cached: a warning, and the copy serves
    with pytest.raises(DownloadError, match=r"^cannot reach s3://models/other after 2 attempt\(s\) \(.*\) and it is"):
        fetch("s3://models/other", options)


def test_gcs_fetches_the_serving_files_once(gcs: GcsServer, options: FetchOptions) -> None:
    folder = fetch("gs://models/tiny", options)
    assert folder == options.objects_dir() / "gs" / "models" / "tiny"
    assert listing(folder) == SERVED
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert gcs.gets("models", "tiny/model.safetensors") == 10
    gcs.clear_requests()
    assert fetch("gs://models/tiny", options) == folder
    assert gcs.gets("models", "tiny/model.safetensors") == 0


def test_gcs_a_corrupt_object_fails_its_md5(gcs: GcsServer, options: FetchOptions, monkeypatch: pytest.MonkeyPatch):
    real_read = GcsBucket.read

    def flips(self: GcsBucket, file: object, start: int, end: int) -> bytes:
        data = real_read(self, file, start, end)  # type: ignore[arg-type]
        return bytes([data[0] ^ 1]) + data[1:] if getattr(file, "name", "") == "tokenizer.json" else data

    monkeypatch.setattr(GcsBucket, "read", flips)
    with pytest.raises(DownloadError, match=r"^file tokenizer.json of gs://models/tiny failed verification \(its md5"):
        fetch("gs://models/tiny", options)


def test_gcs_errors_are_one_line(gcs: GcsServer, options: FetchOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DownloadError, match=r"^bucket nobucket does not exist"):
        fetch("gs://nobucket/tiny", options)
    with gcs.forbid("models"), pytest.raises(DownloadError, match=r"^access to gs://models/tiny was denied \(403\)"):
        fetch("gs://models/tiny", options)
    gcs_url = "gs://models/tiny"
    folder = fetch(gcs_url, options)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # the store is down
    assert fetch(gcs_url, options) == folder
    with pytest.raises(DownloadError, match=r"^cannot reach gs://models/else after 2 attempt\(s\)"):
        fetch("gs://models/else", options)


def test_bad_urls(options: FetchOptions) -> None:
    with pytest.raises(DownloadError, match=r"is not a valid s3:// URL \(expected s3://BUCKET/PREFIX\)"):
        fetch("s3://", options)
    with pytest.raises(DownloadError, match=r"s3://b/../x is not a valid s3:// URL"):
        fetch("s3://b/../x", options)
