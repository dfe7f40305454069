"""Models from the Hub (lmiserve/models/download/hub.py) through the real `huggingface_hub`, against a local
Hub (helpers.hub_server.FakeHub): only the serving files, revisions, GGUF files, the cache, resume, verification,
and one line for every error."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from helpers.hub_server import FakeHub
from lmiserve.models.download import DownloadError, FetchOptions, fetch, hub, parts

REPO = "org/tiny"
WEIGHTS = bytes(range(256)) * 160  # 40 KiB
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "README.md": b"# tiny\n",
    "model.safetensors": WEIGHTS,
    "pytorch_model.bin": b"the same weights, pickled",
    "original/consolidated.00.pth": b"meta's copy",
}
SERVED = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
FAST = FetchOptions(retries=1, backoff=0.01, part_size=4096)


@pytest.fixture
def hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A local Hub this process's huggingface_hub talks to, an empty cache, no token."""
    cache = tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    with FakeHub() as server:
        server.patch_client(monkeypatch)
        yield server


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def resolve_gets(server: FakeHub) -> list[tuple[str, int]]:
    return [(p.rsplit("/", 1)[-1], s) for m, p, s in server.requests if m == "GET" and "/resolve/" in p]


def test_only_the_serving_files_into_the_standard_cache(hf: FakeHub) -> None:
    sha = hf.add_repo(REPO, FILES)
    folder = fetch(REPO, FAST)
    assert folder == Path(constants.HF_HUB_CACHE) / "models--org--tiny" / "snapshots" / sha
    assert listing(folder) == SERVED
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert (folder / "model.safetensors").is_symlink()  # the HF cache's layout: links to blobs
    assert (folder.parents[1] / "refs" / "main").read_text() == sha
    assert {name for name, _ in resolve_gets(hf)} == set(SERVED)
    assert all(status == 206 for _, status in resolve_gets(hf))  # ranged parts


def test_second_start_downloads_nothing_and_works_offline(hf: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hf.add_repo(REPO, FILES)
    first = fetch(REPO, FAST)
    before = len(resolve_gets(hf))
    assert fetch(REPO, FAST) == first
    assert len(resolve_gets(hf)) == before  # listed again (main may have moved), nothing downloaded
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    count = len(hf.requests)
    assert fetch(REPO, FAST) == first
    assert len(hf.requests) == count  # offline: not one request
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hf.stop()  # the Hub is down: the cached snapshot serves, with a warning
    assert fetch(REPO, FAST) == first


def test_revisions_branch_tag_and_commit(hf: FakeHub) -> None:
    old = hf.add_repo(REPO, {**FILES, "config.json": b'{"v": 1}'})
    new = hf.add_repo(REPO, FILES)
    hf.add_ref(REPO, "v1.0", old)
    assert fetch(REPO, FAST).name == new
    tagged = fetch(REPO, FetchOptions(revision="v1.0", part_size=4096))
    assert tagged.name == old and (tagged / "config.json").read_bytes() == b'{"v": 1}'
    assert fetch(REPO, FetchOptions(revision=old)).name == old
    with pytest.raises(DownloadError, match=r"^revision 'nope' of org/tiny does not exist \(give a branch, tag or"):
        fetch(REPO, FetchOptions(revision="nope", retries=0))


def test_gguf_repository_fetches_one_file(hf: FakeHub) -> None:
    hf.add_repo("org/gguf", {"m-Q4_K_M.gguf": b"GGUF1", "m-Q8_0.gguf": b"GGUF22", "README.md": b""})
    assert fetch("org/gguf", FAST).name == "m-Q4_K_M.gguf"
    assert fetch("org/gguf:Q8_0", FAST).read_bytes() == b"GGUF22"
    assert fetch("org/gguf", FetchOptions(gguf_file="m-Q8_0.gguf")).name == "m-Q8_0.gguf"
    assert {name for name, _ in resolve_gets(hf)} == {"m-Q4_K_M.gguf", "m-Q8_0.gguf"}


def test_gated_private_and_missing_repositories(hf: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hf.add_repo("org/gated", FILES, gated=True, token="hf_good")
    hf.add_repo("org/private", FILES, private=True, token="hf_good")
    gated = r"^org/gated is a gated repository and HF_TOKEN is not set: accept its conditions on http://\S+/org/gated"
    with pytest.raises(DownloadError, match=gated):
        fetch("org/gated", FAST)
    with pytest.raises(DownloadError, match=r"^repository org/private was not found on \S+ \(set HF_TOKEN if it"):
        fetch("org/private", FAST)
    with pytest.raises(DownloadError, match=r"^repository org/missing was not found on \S+ \(set HF_TOKEN"):
        fetch("org/missing", FAST)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(DownloadError, match=r"^org/gated is a gated repository and the token in HF_TOKEN has no"):
        fetch("org/gated", FAST)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_good")  # the older name, when HF_TOKEN is unset
    monkeypatch.delenv("HF_TOKEN")
    assert listing(fetch("org/gated", FAST)) == SERVED
    assert listing(fetch("org/private", FAST)) == SERVED


def test_offline_with_nothing_cached(hf: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DownloadError, match=r"^HF_HUB_OFFLINE is set and org/tiny is not in the Hugging Face cache"):
        fetch(REPO, FAST)
    assert not hf.requests


def test_network_down_after_retries(hf: FakeHub) -> None:
    hf.stop()
    with pytest.raises(
        DownloadError, match=r"^cannot reach the Hugging Face Hub at \S+ after 2 attempt\(s\) \(.*\) and"
    ):
        fetch(REPO, FAST)


def test_a_5xx_is_retried(hf: FakeHub) -> None:
    hf.add_repo(REPO, FILES)
    hf.fail_next = 1
    assert listing(fetch(REPO, FAST)) == SERVED


def test_an_interrupted_download_resumes_where_it_stopped(hf: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hf.add_repo(REPO, FILES)
    real_read = hub._HubSource.read
    reads = {"n": 0}

    def dies_after_four(self: hub._HubSource, file: object, start: int, end: int) -> bytes:
        reads["n"] += 1
        if reads["n"] > 4:
            raise KeyboardInterrupt  # as a kill: nothing is cleaned up
        return real_read(self, file, start, end)  # type: ignore[arg-type]

    monkeypatch.setattr(parts, "WORKERS", 1)  # one part at a time: exactly four parts are written
    monkeypatch.setattr(hub._HubSource, "read", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        fetch(REPO, FAST)
    snapshot_dirs = list((Path(constants.HF_HUB_CACHE) / "models--org--tiny").glob("snapshots/*"))
    assert not snapshot_dirs  # no snapshot until every file is there
    monkeypatch.setattr(hub._HubSource, "read", real_read)
    before = len(resolve_gets(hf))
    folder = fetch(REPO, FAST)
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    again = resolve_gets(hf)[before:]
    parts_of_all = sum(-(-len(FILES[n]) // 4096) for n in SERVED)
    assert len(again) == parts_of_all - 4  # only the parts not written before


def test_a_corrupt_file_is_caught_and_removed(hf: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hf.add_repo(REPO, FILES)
    real_read = hub._HubSource.read

    def flips_a_byte(self: hub._HubSource, file: object, start: int, end: int) -> bytes:
        data = real_read(self, file, start, end)  # type: ignore[arg-type]
        return (
            bytes([data[0] ^ 1]) + data[1:] if start == 0 and getattr(file, "name", "") == "model.safetensors" else data
        )

    monkeypatch.setattr(hub._HubSource, "read", flips_a_byte)
    with pytest.raises(DownloadError, match=r"^file model.safetensors of org/tiny failed verification \(its sha256 is"):
        fetch(REPO, FAST)
    blobs = Path(constants.HF_HUB_CACHE) / "models--org--tiny" / "blobs"
    assert not [p for p in blobs.iterdir() if "incomplete" in p.name and "model" in p.name]
    monkeypatch.setattr(hub._HubSource, "read", real_read)
    assert (fetch(REPO, FAST) / "model.safetensors").read_bytes() == WEIGHTS


def test_not_enough_disk_space(hf: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hf.add_repo(REPO, FILES)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))  # type: ignore[attr-defined]
    with pytest.raises(DownloadError, match=r"^not enough disk space for org/tiny: 40.\d KiB to download, 100 B free"):
        fetch(REPO, FAST)
    assert not [name for name, _ in resolve_gets(hf)]  # not one byte before the check
