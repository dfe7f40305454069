"""A local Hugging Face Hub for tests: the part of the Hub HTTP API that `huggingface_hub` (2.4) downloads with.

    with FakeHub() as hub:
        sha = hub.add_repo("org/tiny", {"config.json": b"{}", "model.safetensors": weights})
        path = snapshot_download("org/tiny", cache_dir=tmp_path, endpoint=hub.url)

Endpoints (what the client calls; repo ids must be `namespace/name`, models only):

- `GET /api/models/{repo_id}` and `.../revision/{revision}`: repo info (`HfApi.model_info`, `repo_info`, and
  `snapshot_download` for a branch/tag). `?blobs=true` (`files_metadata=True`) adds size, blobId and lfs to siblings.
- `GET /api/models/{repo_id}/tree/{revision}[/{path}]?recursive=&expand=`: `list_repo_tree`/`list_repo_files`, and
  `snapshot_download` once per commit (the listing is then cached on disk in `<repo cache>/trees/<commit>.json`).
- `POST /api/models/{repo_id}/paths-info/{revision}` (form `paths=..&expand=..`): `get_paths_info`.
- `HEAD`/`GET /{repo_id}/resolve/{revision}/{filename}`: `hf_hub_download` sends a HEAD for the metadata (ETag,
  X-Repo-Commit, Content-Length, and X-Linked-Etag/X-Linked-Size for LFS files), then a GET of the same URL.
  Files are served directly (200, no redirect to a CDN); a GET with `Range: bytes=N-` gets a 206.
- `GET /api/agent-harnesses`: an empty registry (the client fetches it once a process unless telemetry is off).

Revisions are branch and tag names (`add_ref`), full 40-hex commit shas, and names with slashes such as `refs/pr/1`
(the client URL-encodes them as one path segment). Errors answer `{"error": ...}` with `X-Error-Code` and
`X-Error-Message` as the Hub does, which the client turns into: RepositoryNotFoundError (unknown or private repo: 401
without an `Authorization` header, 404 with a wrong one), GatedRepoError (files of a gated repo: 401 without a token,
403 with a wrong one; its info and tree stay public, as on the Hub), RevisionNotFoundError (404) and
RemoteEntryNotFoundError (404, with X-Repo-Commit, so the client caches the miss under `.no_exist/<commit>/`).
No X-Xet-* header and no `xetHash` is ever sent, so the client never takes the Xet path.

Pointing the client here. `huggingface_hub.constants` reads HF_ENDPOINT at import time (ENDPOINT and
HUGGINGFACE_CO_URL_TEMPLATE, which `hf_hub_url` formats before swapping in an `endpoint=` argument), and the
module-level functions (`huggingface_hub.model_info`, ...) are bound to an `HfApi()` made at import. So in-process,
either pass `endpoint=hub.url` everywhere (`snapshot_download`, `hf_hub_download`, `HfApi(endpoint=...)`), or call
`hub.patch_client(monkeypatch)`, which patches those constants and the module-level `HfApi`. A subprocess gets
`hub.env()` in its environment (HF_ENDPOINT and friends), read when it imports `huggingface_hub`. Either way keep
telemetry off: otherwise the first request of a process also GETs `{constants.ENDPOINT}/api/agent-harnesses` (the
real Hub, if only `endpoint=` was passed) and writes `$HF_HOME/.agent_harnesses.json`.

Resuming. `huggingface_hub` 2.4 resumes only inside one `http_get` call: when the connection drops mid-body it waits
1 s and asks for the rest with `Range: bytes=N-` (`cut_next_bodies` drops it). N counts only the whole
`constants.DOWNLOAD_CHUNK_SIZE` (10 MiB) chunks it got, so a file cut within its first 10 MiB starts again with a 200;
to see a 206, cut a file over 20 MiB (the cut is at half). It downloads into a process-unique
`blobs/<etag>.<8 hex>.incomplete` and deletes that on failure, so a killed process leaves its file behind and the next
process downloads the whole file again (a 200, never a 206).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    import pytest

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub refuses larger files outside LFS
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class _File:
    """A file of a commit, with the hashes the Hub reports (computed once)."""

    def __init__(self, content: bytes, lfs: bool) -> None:
        self.content, self.lfs, self.size = content, lfs, len(content)
        self.sha256 = hashlib.sha256(content).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()
        self.pointer_size = len(pointer)
        git_data = pointer if lfs else content  # what git stores: the pointer, for an LFS file
        self.blob_id = hashlib.sha1(b"blob %d\0" % len(git_data) + git_data).hexdigest()
        self.etag = self.sha256 if lfs else self.blob_id

    def lfs_info(self, sha_key: str) -> dict[str, Any]:
        return {sha_key: self.sha256, "size": self.size, "pointerSize": self.pointer_size}


@dataclass
class _Commit:
    sha: str
    files: dict[str, _File]
    date: str
    title: str


@dataclass
class _Repo:
    commits: dict[str, _Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag name -> commit sha
    gated: bool = False
    private: bool = False
    token: str | None = None


class _HubError(Exception):
    """An error answer: `{"error": message}` with X-Error-Code (if `code`) and X-Error-Message."""

    def __init__(self, status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.headers = {**({"X-Error-Code": code} if code else {}), "X-Error-Message": message, **(headers or {})}


class FakeHub:
    """A local Hugging Face Hub for tests: repos of files, revisions, gated/private repos, a request log.

    The socket is bound in the constructor (`url` is known at once); `start()` serves it from a daemon thread.
    Knobs a test may set at any time: `bytes_per_second` (file bodies are sent throttled, in small chunks, so a test
    can kill a client midway), `fail_next` (the next N requests answer 500), `cut_next_bodies` (the next N file
    bodies stop after half their bytes and the connection closes, like a dropped network).
    """

    def __init__(self) -> None:
        self.bytes_per_second: float | None = None
        self.fail_next = 0
        self.cut_next_bodies = 0
        self.requests: list[tuple[str, str, int]] = []  # (method, raw URL path without query, status)
        self._repos: dict[str, _Repo] = {}
        self._downloads: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self._thread: threading.Thread | None = None
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # throttled bodies still being sent give up
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that should download from this hub (layer it over os.environ)."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
        }

    def patch_client(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process's `huggingface_hub` here, for code that passes no `endpoint=` (see the module doc)."""
        from huggingface_hub import constants, hf_api

        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", self.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        monkeypatch.setattr(hf_api.api, "endpoint", self.url)

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path] | Path,
        *,
        branch: str = "main",
        gated: bool = False,
        private: bool = False,
        token: str | None = None,
    ) -> str:
        """Add (or add a new commit to) a repo; return the new commit sha (40 hex).

        `files` is the whole tree of the new commit: a dict of relative path -> content (bytes, or a Path to read),
        or a directory whose files (recursively) become the repo. Files of LFS_MIN_SIZE bytes or more, or with a
        weight suffix (LFS_SUFFIXES), are LFS files (etag = sha256, `lfs` in siblings and tree entries); the others
        are git files (etag = git blob sha1). The commit becomes the head of `branch`. `gated`/`private`/`token`
        set the repo's access (the last call wins): without `Authorization: Bearer <token>` matching `token` exactly,
        a private repo answers RepoNotFound and a gated repo's files answer GatedRepo.
        """
        if repo_id.count("/") != 1:
            raise ValueError(f"repo_id must be 'namespace/name', got {repo_id!r}")
        if isinstance(files, Path):
            files = {p.relative_to(files).as_posix(): p for p in sorted(files.rglob("*")) if p.is_file()}
        tree: dict[str, _File] = {}
        for path, value in files.items():
            content = value.read_bytes() if isinstance(value, Path) else bytes(value)
            tree[path] = _File(content, lfs=len(content) >= LFS_MIN_SIZE or path.endswith(LFS_SUFFIXES))
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            repo.gated, repo.private, repo.token = gated, private, token
            seed = [
                repo_id,
                branch,
                repo.refs.get(branch),
                len(repo.commits),
                sorted((p, f.etag) for p, f in tree.items()),
            ]
            sha = hashlib.sha1(json.dumps(seed).encode()).hexdigest()
            date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
            repo.commits[sha] = _Commit(sha, tree, date, f"Commit {len(repo.commits) + 1}")
            repo.refs[branch] = sha
        return sha

    def add_ref(self, repo_id: str, name: str, commit: str) -> None:
        """Make `name` (a branch or tag, e.g. "v1.0" or "refs/pr/1") point at `commit` of `repo_id`."""
        with self._lock:
            repo = self._repos[repo_id]
            if commit not in repo.commits:
                raise KeyError(f"{repo_id} has no commit {commit}")
            repo.refs[name] = commit

    def downloads(self, repo_id: str, filename: str) -> int:
        """How many GETs (not HEADs) of that file's resolve URL, at any revision, returned a body (200 or 206)."""
        with self._lock:
            return self._downloads[repo_id, filename]

    # ---------------------------------------------------------------- used by the request handler

    def _take(self, knob: str) -> bool:
        """Consume one unit of a countdown knob (`fail_next`, `cut_next_bodies`); whether there was one."""
        with self._lock:
            if getattr(self, knob) > 0:
                setattr(self, knob, getattr(self, knob) - 1)
                return True
            return False

    def _log(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: FakeHub

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away mid-body is expected
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every response has a Content-Length

    def log_message(self, format: str, *args: Any) -> None:  # quiet: `FakeHub.requests` is the log
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        hub = cast(_Server, self.server).hub
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if hub._take("fail_next"):
                raise _HubError(500, None, "Internal Error (injected by FakeHub.fail_next)")
            self._route(hub, method, [unquote(p) for p in url.path.split("/")[1:]], parse_qs(url.query), body)
        except _HubError as e:
            self._send(
                e.status, json.dumps({"error": e.message}).encode(), {"Content-Type": "application/json", **e.headers}
            )
        except ConnectionError:  # the client went away
            self.close_connection = True

    def _route(self, hub: FakeHub, method: str, parts: list[str], query: dict[str, list[str]], body: bytes) -> None:
        def flag(name: str) -> bool:
            return query.get(name, ["false"])[-1].lower() in ("1", "true")

        if method == "GET" and parts == ["api", "agent-harnesses"]:
            return self._json({"standardEnvVars": [], "harnesses": {}})
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            if method == "GET" and (not rest or (len(rest) == 2 and rest[0] == "revision")):
                repo = self._repo(hub, repo_id, files=False)
                return self._json(_info(repo_id, repo, self._commit(repo, rest[1] if rest else "main"), flag("blobs")))
            if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                commit = self._commit(self._repo(hub, repo_id, files=False), rest[1])
                return self._json(_tree(commit, "/".join(rest[2:]), flag("recursive"), flag("expand")))
            if method == "POST" and len(rest) == 2 and rest[0] == "paths-info":
                commit = self._commit(self._repo(hub, repo_id, files=False), rest[1])
                form = parse_qs(body.decode())
                return self._json(_paths_info(commit, form.get("paths", []), form.get("expand") == ["true"]))
        elif method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(hub, method, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        raise _HubError(404, None, "Sorry, we can't find the page you are looking for.")

    def _repo(self, hub: FakeHub, repo_id: str, *, files: bool) -> _Repo:
        """The repo, if this request may see it (its files, with `files`); else the Hub's 401/403/404."""
        auth = self.headers.get("Authorization")
        repo = hub._repos.get(repo_id)
        allowed = repo is not None and repo.token is not None and auth == f"Bearer {repo.token}"
        if repo is None or (repo.private and not allowed):
            raise _HubError(401 if auth is None else 404, "RepoNotFound", "Repository not found")
        if repo.gated and files and not allowed:
            message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated"
            message += " to access it. Please log in."
            raise _HubError(401 if auth is None else 403, "GatedRepo", message)
        return repo

    @staticmethod
    def _commit(repo: _Repo, revision: str) -> _Commit:
        sha = revision if _COMMIT_SHA.fullmatch(revision) else repo.refs.get(revision)
        if sha not in repo.commits:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo.commits[sha]

    def _resolve(self, hub: FakeHub, method: str, repo_id: str, revision: str, filename: str) -> None:
        commit = self._commit(self._repo(hub, repo_id, files=True), revision)
        file = commit.files.get(filename)
        if file is None:
            raise _HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit.sha})
        size = file.size
        headers = {"ETag": f'"{file.etag}"', "X-Repo-Commit": commit.sha, "Accept-Ranges": "bytes"}
        if file.lfs:
            headers |= {"X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": str(size)}
        if method == "HEAD":
            return self._send(200, file.content, headers)  # its Content-Length, no body
        status, start, end = 200, 0, size
        if range_header := self.headers.get("Range"):
            start, end = _byte_range(range_header, size)
            status, headers["Content-Range"] = 206, f"bytes {start}-{end - 1}/{size}"
        with hub._lock:
            hub._downloads[repo_id, filename] += 1
        self._send(status, file.content[start:end], headers, cut=hub._take("cut_next_bodies"))

    def _json(self, payload: Any) -> None:
        self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _send(self, status: int, body: bytes, headers: Mapping[str, str], *, cut: bool = False) -> None:
        """Answer (logged first, so the entry is there when the client has the answer); the body is throttled to
        `hub.bytes_per_second`, or cut after half (then the connection closes)."""
        hub = cast(_Server, self.server).hub
        hub._log(self.command, urlsplit(self.path).path, status)
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        if cut:
            body, self.close_connection = body[: len(body) // 2], True
        rate = hub.bytes_per_second
        chunk = max(1, int(rate / 50)) if rate else max(1, len(body))
        for offset in range(0, len(body), chunk):
            if hub._stopping.is_set():
                self.close_connection = True
                return
            self.wfile.write(body[offset : offset + chunk])
            self.wfile.flush()
            if rate:
                time.sleep(chunk / rate)


def _byte_range(header: str, size: int) -> tuple[int, int]:
    """The [start, end) bytes a `Range: bytes=first-[last]` or `bytes=-suffix` header asks for; else a 416."""
    match = _RANGE.fullmatch(header.replace(" ", ""))
    first, last = match.groups() if match else ("", "")
    if first:
        start, end = int(first), min(size, int(last) + 1) if last else size
    else:
        start, end = (max(0, size - int(last)), size) if last else (0, 0)
    if start >= end:
        raise _HubError(416, None, f"Range not satisfiable: {header}", {"Content-Range": f"bytes */{size}"})
    return start, end


def _info(repo_id: str, repo: _Repo, commit: _Commit, blobs: bool) -> dict[str, Any]:
    """`GET /api/models/{repo_id}[/revision/{revision}]`: the fields ModelInfo reads (siblings with `?blobs=true`)."""
    siblings = []
    for path, file in sorted(commit.files.items()):
        sibling: dict[str, Any] = {"rfilename": path}
        if blobs:
            sibling |= {"size": file.size, "blobId": file.blob_id}
            if file.lfs:
                sibling["lfs"] = file.lfs_info("sha256")
        siblings.append(sibling)
    first_date = min(c.date for c in repo.commits.values())
    return {
        "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
        "author": repo_id.split("/")[0], "sha": commit.sha, "lastModified": commit.date, "createdAt": first_date,
        "private": repo.private, "gated": "auto" if repo.gated else False, "disabled": False,
        "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
        "usedStorage": sum(f.size for f in commit.files.values()),
    }  # fmt: skip


def _entry(commit: _Commit, path: str, expand: bool) -> dict[str, Any]:
    """A tree / paths-info entry: a file (with `lfs`) or a directory."""
    file = commit.files.get(path)
    if file is None:
        entry: dict[str, Any] = {"type": "directory", "oid": hashlib.sha1(f"{commit.sha}:{path}".encode()).hexdigest()}
        entry |= {"size": 0, "path": path}
    else:
        entry = {"type": "file", "oid": file.blob_id, "size": file.size, "path": path}
        if file.lfs:
            entry["lfs"] = file.lfs_info("oid")
    if expand:
        entry["lastCommit"] = {"id": commit.sha, "title": commit.title, "date": commit.date}
    return entry


def _directories(commit: _Commit) -> set[str]:
    return {path.rsplit("/", i)[0] for path in commit.files for i in range(1, path.count("/") + 1)}


def _tree(commit: _Commit, path: str, recursive: bool, expand: bool) -> list[dict[str, Any]]:
    """`GET /api/models/{repo_id}/tree/{revision}[/{path}]`: directories and files under `path` (all levels if
    `recursive`, else its direct children); an unknown directory is EntryNotFound."""
    if path and path not in _directories(commit):
        raise _HubError(404, "EntryNotFound", f"{path} does not exist on {commit.sha}", {"X-Repo-Commit": commit.sha})
    prefix = f"{path}/" if path else ""
    below = [p for p in sorted(_directories(commit)) + sorted(commit.files) if p.startswith(prefix)]
    return [_entry(commit, p, expand) for p in below if recursive or "/" not in p[len(prefix) :]]


def _paths_info(commit: _Commit, paths: list[str], expand: bool) -> list[dict[str, Any]]:
    """`POST /api/models/{repo_id}/paths-info/{revision}`: the entries of the paths that exist (others are left out)."""
    known = commit.files.keys() | _directories(commit)
    return [_entry(commit, path.strip("/"), expand) for path in paths if path.strip("/") in known]
