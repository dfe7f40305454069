"""helpers.hub_server.FakeHub: the real `huggingface_hub` client downloads from it as from the Hub."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import HfApi, RepoFile, RepoFolder, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from helpers.hub_server import FakeHub
from helpers.waiting import wait_until

REPO = "org/tiny"
WEIGHTS = bytes(range(256)) * 40  # 10 KiB; LFS by its suffix
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# tiny\n",
    "model.safetensors": WEIGHTS,
    "extra/adapter.bin": b"adapter weights",
}


@pytest.fixture(autouse=True)
def _client_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, no telemetry (no /api/agent-harnesses request), and no implicit token: a token saved on this machine
    or in HF_TOKEN is never sent, so a request without `token=` is anonymous."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as hub:
        yield hub


def files_under(folder: str | Path) -> dict[str, bytes]:
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def resolve_statuses(hub: FakeHub, method: str, filename: str) -> list[int]:
    """Statuses of the `method` requests of `filename`'s resolve URL, at any revision, in order."""
    return [s for m, p, s in hub.requests if m == method and "/resolve/" in p and p.endswith(f"/{filename}")]


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


# ---------------------------------------------------------------- downloads


def test_snapshot_download_fetches_exactly_the_allowed_files(hub: FakeHub, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    path = snapshot_download(
        REPO, revision="main", allow_patterns=["*.json", "*.safetensors"], cache_dir=tmp_path, endpoint=hub.url
    )
    assert Path(path) == tmp_path / "models--org--tiny" / "snapshots" / sha
    wanted = ("config.json", "tokenizer.json", "model.safetensors")
    assert files_under(path) == {name: FILES[name] for name in sorted(wanted)}
    assert (tmp_path / "models--org--tiny" / "refs" / "main").read_text() == sha
    for name in FILES:
        assert hub.downloads(REPO, name) == (1 if name in wanted else 0), name
    assert ("GET", f"/api/models/{REPO}/revision/main", 200) in hub.requests
    assert ("GET", f"/api/models/{REPO}/tree/{sha}", 200) in hub.requests
    assert all("agent-harnesses" not in p for _, p, _ in hub.requests)
    # blobs are named by etag: sha256 for the LFS file, the git blob sha1 for the others
    blobs = {p.name for p in (tmp_path / "models--org--tiny" / "blobs").iterdir()}
    assert blobs == {hashlib.sha256(WEIGHTS).hexdigest()} | {git_blob_sha1(FILES[n]) for n in wanted[:2]}


def test_a_second_snapshot_download_of_the_same_commit_downloads_nothing(hub: FakeHub, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url)
    seen = len(hub.requests)
    snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url)  # a branch: one repo info call to resolve it
    assert hub.requests[seen:] == [("GET", f"/api/models/{REPO}/revision/main", 200)]
    snapshot_download(REPO, revision=sha, cache_dir=tmp_path, endpoint=hub.url)  # a commit: nothing at all
    assert len(hub.requests) == seen + 1
    assert all(hub.downloads(REPO, name) == 1 for name in FILES)


def test_hf_hub_download_heads_then_gets_the_file(hub: FakeHub, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    path = hf_hub_download(REPO, "extra/adapter.bin", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == FILES["extra/adapter.bin"]
    assert hub.requests == [
        ("HEAD", f"/{REPO}/resolve/main/extra/adapter.bin", 200),
        ("GET", f"/{REPO}/resolve/main/extra/adapter.bin", 200),
    ]
    # by branch: a HEAD each time (the client caches no metadata), no second GET
    hf_hub_download(REPO, "extra/adapter.bin", cache_dir=tmp_path, endpoint=hub.url)
    assert resolve_statuses(hub, "HEAD", "extra/adapter.bin") == [200, 200]
    assert hub.downloads(REPO, "extra/adapter.bin") == 1
    hf_hub_download(REPO, "extra/adapter.bin", revision=sha, cache_dir=tmp_path, endpoint=hub.url)
    assert len(hub.requests) == 3  # by commit, cached: no request


def test_revisions_by_branch_tag_commit_and_pr_ref(hub: FakeHub, tmp_path: Path) -> None:
    first = hub.add_repo(REPO, {"config.json": b"v1"})
    hub.add_ref(REPO, "v1.0", first)
    second = hub.add_repo(REPO, {"config.json": b"v2"})
    dev = hub.add_repo(REPO, {"config.json": b"dev"}, branch="dev")
    hub.add_ref(REPO, "refs/pr/1", dev)
    assert len({first, second, dev}) == 3
    assert all(re.fullmatch(r"[0-9a-f]{40}", sha) for sha in (first, second, dev))
    api = HfApi(endpoint=hub.url)
    expected = {"main": (second, b"v2"), "v1.0": (first, b"v1"), first: (first, b"v1"), "dev": (dev, b"dev")}
    expected["refs/pr/1"] = (dev, b"dev")
    for revision, (sha, content) in expected.items():
        assert api.model_info(REPO, revision=revision).sha == sha, revision
        path = hf_hub_download(REPO, "config.json", revision=revision, cache_dir=tmp_path, endpoint=hub.url)
        assert Path(path).read_bytes() == content, revision
        path = snapshot_download(REPO, revision=revision, cache_dir=tmp_path / "snapshots", endpoint=hub.url)
        assert Path(path).name == sha and files_under(path) == {"config.json": content}, revision
    assert ("GET", f"/api/models/{REPO}/revision/refs%2Fpr%2F1", 200) in hub.requests  # one URL-encoded segment


# ---------------------------------------------------------------- metadata


def test_model_info_with_files_metadata(hub: FakeHub) -> None:
    sha = hub.add_repo(REPO, FILES)
    info = HfApi(endpoint=hub.url).model_info(REPO, revision=sha, files_metadata=True)
    assert (info.id, info.sha, info.private, info.gated) == (REPO, sha, False, False)
    assert info.last_modified is not None
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert sorted(siblings) == sorted(FILES)
    assert {name: s.size for name, s in siblings.items()} == {name: len(data) for name, data in FILES.items()}
    weights = siblings["model.safetensors"]
    assert weights.lfs is not None and weights.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert weights.lfs.size == len(WEIGHTS) and weights.lfs.pointer_size > 100
    assert siblings["config.json"].lfs is None
    assert siblings["config.json"].blob_id == git_blob_sha1(FILES["config.json"])
    plain = HfApi(endpoint=hub.url).model_info(REPO)  # without blobs=true: names only
    assert [s.size for s in plain.siblings or []] == [None] * len(FILES)


def test_tree_listing_and_paths_info(hub: FakeHub, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    for name, data in {**FILES, "extra/deeper/notes.txt": b"notes"}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    hub.add_repo(REPO, folder)  # a directory becomes the repo
    api = HfApi(endpoint=hub.url)
    assert api.list_repo_files(REPO) == sorted([*FILES, "extra/deeper/notes.txt"])
    top = {e.path: type(e) for e in api.list_repo_tree(REPO)}
    assert top == {"extra": RepoFolder, **{name: RepoFile for name in FILES if "/" not in name}}
    assert [e.path for e in api.list_repo_tree(REPO, "extra")] == ["extra/deeper", "extra/adapter.bin"]
    [weights] = [e for e in api.list_repo_tree(REPO, expand=True) if e.path == "model.safetensors"]
    assert isinstance(weights, RepoFile) and weights.lfs is not None and weights.xet_hash is None
    assert weights.last_commit is not None and weights.last_commit.oid == api.model_info(REPO).sha
    infos = api.get_paths_info(REPO, ["config.json", "extra", "missing.txt"])
    assert [(type(e), e.path) for e in infos] == [(RepoFile, "config.json"), (RepoFolder, "extra")]
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(REPO, "nowhere"))


# ---------------------------------------------------------------- errors and access


def test_gated_repo_needs_its_token(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, FILES, gated=True, token="hf_secret")
    info = HfApi(endpoint=hub.url).model_info(REPO)  # a gated repo's info is public, as on the Hub
    assert info.gated == "auto"
    with pytest.raises(GatedRepoError):
        snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(GatedRepoError):
        hf_hub_download(REPO, "config.json", cache_dir=tmp_path, endpoint=hub.url, token="hf_wrong")
    assert resolve_statuses(hub, "HEAD", "config.json") == [401, 403]
    path = snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url, token="hf_secret")
    assert files_under(path) == dict(sorted(FILES.items()))


def test_unknown_and_private_repos_are_not_found(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo("org/private", FILES, private=True, token="hf_secret")
    for repo_id in ("org/unknown", "org/private"):
        with pytest.raises(RepositoryNotFoundError) as error:
            snapshot_download(repo_id, cache_dir=tmp_path, endpoint=hub.url)
        assert type(error.value) is RepositoryNotFoundError  # not its subclass GatedRepoError
        assert error.value.response.status_code == 401
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download(repo_id, "config.json", cache_dir=tmp_path, endpoint=hub.url, token="hf_wrong")
    info = HfApi(endpoint=hub.url, token="hf_secret").model_info("org/private")
    assert info.private is True


def test_unknown_revision_and_file(hub: FakeHub, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="nope", cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="0" * 40, cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.url).model_info(REPO, revision="nope")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.txt", cache_dir=tmp_path, endpoint=hub.url)
    assert (tmp_path / "models--org--tiny" / ".no_exist" / sha / "missing.txt").exists()  # the miss is cached


def test_error_bodies_and_byte_ranges(hub: FakeHub) -> None:
    sha = hub.add_repo(REPO, {"config.json": b"0123456789"})

    def get(path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(hub.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    status, headers, body = get(f"/{REPO}/resolve/main/config.json", {"Range": "bytes=3-5"})
    assert (status, headers["Content-Range"], body) == (206, "bytes 3-5/10", b"345")
    status, headers, body = get(f"/{REPO}/resolve/main/config.json", {"Range": "bytes=-2"})
    assert (status, headers["Content-Range"], body) == (206, "bytes 8-9/10", b"89")
    status, headers, _ = get(f"/{REPO}/resolve/main/config.json", {"Range": "bytes=10-"})
    assert (status, headers["Content-Range"]) == (416, "bytes */10")
    status, headers, body = get(f"/{REPO}/resolve/main/missing.txt")
    assert (status, headers["X-Error-Code"], headers["X-Error-Message"]) == (404, "EntryNotFound", "Entry not found")
    assert (body, headers["X-Repo-Commit"]) == (b'{"error": "Entry not found"}', sha)
    status, headers, body = get("/api/models/org/unknown")
    assert (status, headers["X-Error-Code"], body) == (401, "RepoNotFound", b'{"error": "Repository not found"}')


# ---------------------------------------------------------------- failures, resume, other ways in


def test_a_dropped_body_resumes_with_a_range_request(hub: FakeHub, tmp_path: Path) -> None:
    big = os.urandom(24 * 1024 * 1024)  # the client resumes from whole 10 MiB chunks: cut at 12 MiB, resume at 10
    hub.add_repo(REPO, {"model.safetensors": big})
    hub.cut_next_bodies = 1
    path = hf_hub_download(REPO, "model.safetensors", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == big
    assert resolve_statuses(hub, "GET", "model.safetensors") == [200, 206]
    assert hub.downloads(REPO, "model.safetensors") == 2
    assert not list((tmp_path / "models--org--tiny" / "blobs").glob("*.incomplete"))


def test_a_server_error_is_retried(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, FILES)
    hub.fail_next = 1
    path = hf_hub_download(REPO, "config.json", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == FILES["config.json"]
    assert [s for _, _, s in hub.requests] == [500, 200, 200]  # HEAD; no cached copy, so HEAD again; GET


def test_patch_client_serves_calls_without_an_endpoint(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = hub.add_repo(REPO, FILES)
    hub.patch_client(monkeypatch)
    assert huggingface_hub.model_info(REPO).sha == sha  # the module-level HfApi made at import
    assert HfApi().model_info(REPO).sha == sha
    path = snapshot_download(REPO, allow_patterns=["*.md"], cache_dir=tmp_path)
    assert files_under(path) == {"README.md": FILES["README.md"]}
    assert Path(hf_hub_download(REPO, "config.json", cache_dir=tmp_path)).read_bytes() == FILES["config.json"]


def test_a_killed_download_starts_again_from_scratch_in_the_next_process(hub: FakeHub, tmp_path: Path) -> None:
    """A subprocess finds the hub through HF_ENDPOINT (`hub.env()`); killed midway, it leaves its `.incomplete` file,
    which huggingface_hub 2.4 never reuses: the next download gets the whole file again (200, not 206). (The client
    writes whole 10 MiB chunks, so that file is still empty here.)"""
    weights = os.urandom(256 * 1024)
    hub.add_repo(REPO, {"model.safetensors": weights})
    hub.bytes_per_second = 64 * 1024  # 4 s for the file
    env = {**os.environ, **hub.env(), "HF_HUB_CACHE": str(tmp_path), "HF_HOME": str(tmp_path / "home")}
    env["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"
    code = f"from huggingface_hub import snapshot_download; snapshot_download({REPO!r})"
    blobs = tmp_path / "models--org--tiny" / "blobs"
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.DEVNULL)

    def started() -> bool:
        return hub.downloads(REPO, "model.safetensors") == 1 or process.poll() is not None

    try:
        wait_until(started, "the subprocess downloads the weights")
        assert process.poll() is None, "the subprocess ended before it downloaded the weights"
        wait_until(lambda: any(blobs.glob("*.incomplete")), "the subprocess opens its temporary file")
    finally:
        process.kill()
        process.wait()
    [partial] = blobs.glob("*.incomplete")
    assert partial.stat().st_size < len(weights)
    hub.bytes_per_second = None
    path = snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url)
    assert files_under(path) == {"model.safetensors": weights}
    assert resolve_statuses(hub, "GET", "model.safetensors")[-1] == 200
    assert 206 not in resolve_statuses(hub, "GET", "model.safetensors")
    assert partial.exists()  # left behind for good
