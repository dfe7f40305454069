"""Models from the Hugging Face Hub (or a mirror or private hub: `HF_ENDPOINT`), through `huggingface_hub`.

The files land in the standard cache (`HF_HOME`, `HF_HUB_CACHE`: `blobs/`, `snapshots/<commit>/`, `refs/`),
where transformers and the `hf` CLI find them too. `HF_TOKEN` (or `HUGGING_FACE_HUB_TOKEN`), `HF_ENDPOINT`
and `HF_HUB_OFFLINE` are read as huggingface_hub reads them.

1. List the revision's files with `HfApi` (a retry loop with backoff for network errors); with
   `HF_HUB_OFFLINE`, or when the Hub cannot be reached and the revision is cached, the cached snapshot is used.
2. Select what serving needs (selection.py).
3. Under a lock per repository (several servers or tensor-parallel ranks on one cache download once),
   download the missing blobs in ranged parts through huggingface_hub's HTTP session (parts.py: resumed
   after a kill, which huggingface_hub's own downloads are not; each verified by its sha256 or git hash),
   then link the snapshot, only once every file is there, and point the revision's ref at its commit.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lmiserve.models.bundled import exclusive_lock
from lmiserve.models.download.common import DownloadError, FetchOptions, mismatch, one_line, with_retries
from lmiserve.models.download.parts import download
from lmiserve.models.download.selection import RemoteFile, select, split_gguf_tag

logger = logging.getLogger("lmiserve.download")


def fetch(spec: str, options: FetchOptions) -> Path:
    """The snapshot directory of Hub repo `spec` (`org/name`, or `org/repo:TAG` for one GGUF file), or the
    `.gguf` file in it; downloaded now if needed."""
    from huggingface_hub import constants

    repo_id, tag = split_gguf_tag(spec)
    revision = options.revision or "main"
    named = _named(repo_id, options)
    cache = Path(constants.HF_HUB_CACHE)
    if constants.HF_HUB_OFFLINE:
        return _from_cache(repo_id, revision, tag, options, cache, reason="HF_HUB_OFFLINE is set")
    try:
        commit, files = with_retries(
            f"listing {named} on {constants.ENDPOINT}",
            lambda: _listing(repo_id, revision),
            options,
            _transient,
        )
    except Exception as exc:  # noqa: BLE001 - mapped to one line, or the cache when the Hub is unreachable
        if not _transient(exc):
            raise _error(exc, repo_id, revision) from None
        try:
            path = _from_cache(repo_id, revision, tag, options, cache, reason="")
        except DownloadError:
            raise DownloadError(
                f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} after {options.retries + 1} attempt(s) "
                f"({one_line(exc)}) and {named} is not in the cache {cache}"
            ) from None
        logger.warning(
            "cannot reach %s (%s): using the cached snapshot of %s", constants.ENDPOINT, one_line(exc), named
        )
        return path
    selected = _select(files, repo_id, tag, options)
    return _download(repo_id, revision, commit, selected, options, cache)


def _listing(repo_id: str, revision: str) -> tuple[str, list[RemoteFile]]:
    """The commit `revision` points at, and every file of it."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi()
    info = api.repo_info(repo_id, revision=revision)
    commit = str(info.sha)
    files = [
        _hub_file(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None, f.lfs.size if f.lfs else None)
        for f in api.list_repo_tree(repo_id, revision=commit, recursive=True)
        if isinstance(f, RepoFile)
    ]
    return commit, files


def _select(files: list[RemoteFile], repo_id: str, tag: str | None, options: FetchOptions) -> list[RemoteFile]:
    chosen = select(
        files,
        source=repo_id,
        gguf_file=options.gguf_file,
        gguf_tag=tag,
        trust_remote_code=options.trust_remote_code,
    )
    by_name = {f.name: f for f in files}
    return [by_name[f.name] for f in chosen]


def _download(
    repo_id: str, revision: str, commit: str, selected: list[RemoteFile], options: FetchOptions, cache: Path
) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    blobs, snapshot = storage / "blobs", storage / "snapshots" / commit
    lock_dir = cache / ".locks" / storage.name
    lock_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(lock_dir / "lmiserve-snapshot.lock", waiting=f"another process is downloading {repo_id}"):
        todo = [(f, blobs / f.etag) for f in selected if not (blobs / f.etag).is_file()]
        download(_HubSource(repo_id, revision, commit), todo, options)
        for f in selected:  # the snapshot's links, once every blob is there
            link, blob = snapshot / f.name, blobs / f.etag
            problem = mismatch(blob, f.size, None)
            if problem:
                blob.unlink()
                raise DownloadError(
                    f"file {f.name} of {repo_id} in the cache failed verification ({problem}); it was removed: "
                    "start again to download it anew"
                )
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.unlink(missing_ok=True)  # a dangling link
                os.symlink(os.path.relpath(blob, link.parent), link)
        if revision != commit:
            ref = storage / "refs" / revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit)
    return _result(snapshot, selected)


class _HubSource:
    """The files of one commit of a Hub repository, read in ranges through huggingface_hub's session (parts.Source)."""

    def __init__(self, repo_id: str, revision: str, commit: str) -> None:
        self.repo_id, self.revision, self.commit = repo_id, revision, commit
        self.url = repo_id

    def digest(self, file: RemoteFile) -> tuple[str, str] | None:
        return file.digest

    def read(self, file: RemoteFile, start: int, end: int) -> bytes:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        if end <= start:
            return b""
        headers = build_hf_headers()
        headers["Range"] = f"bytes={start}-{end - 1}"
        url = hf_hub_url(self.repo_id, file.name, revision=self.commit)
        response = get_session().get(url, headers=headers, follow_redirects=True, timeout=60)
        hf_raise_for_status(response)
        data = bytes(response.content)
        if response.status_code == 200 and len(data) == file.size:  # a server that ignores Range
            return data[start:end]
        return data

    def transient(self, exc: BaseException) -> bool:
        return _transient(exc)

    def error(self, exc: BaseException) -> DownloadError:
        return _error(exc, self.repo_id, self.revision)


def _from_cache(
    repo_id: str, revision: str, tag: str | None, options: FetchOptions, cache: Path, *, reason: str
) -> Path:
    """The cached snapshot of `revision`, never touching the network; DownloadError when it is not there."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    ref = storage / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    named = _named(repo_id, options)
    command = f"lmiserve download {repo_id}{f' --revision {revision}' if options.revision else ''}"
    missing = DownloadError(
        f"{reason + ' and ' if reason else ''}{named} is not in the Hugging Face cache {cache}: download it first "
        f"(`{command}`) or unset HF_HUB_OFFLINE"
    )
    files = _cached_listing(storage, commit)
    if files is None:
        raise missing
    selected = _select(files, repo_id, tag, options)
    folder = storage / "snapshots" / commit
    for f in selected:
        path = folder / f.name
        if not path.is_file():
            raise missing
        problem = mismatch(path, f.size, None)
        if problem:
            raise DownloadError(
                f"file {f.name} of {repo_id} in the cache {cache} is damaged ({problem}): download it again"
            )
    return _result(folder, selected)


def _named(repo_id: str, options: FetchOptions) -> str:
    return f"{repo_id}{f' (revision {options.revision!r})' if options.revision else ''}"


def _cached_listing(storage: Path, commit: str) -> list[RemoteFile] | None:
    """The files of `commit` as huggingface_hub cached its listing; None when it has none."""
    entries: Any = None
    try:
        from huggingface_hub._tree_cache import read_tree_cache

        entries = read_tree_cache(str(storage), commit)
    except ImportError:  # pragma: no cover - another huggingface_hub: what the snapshot holds
        pass
    if entries:
        return [_hub_file(name, e.size, e.blob_id, e.lfs_sha256, e.lfs_size) for name, e in entries.items()]
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return [
        RemoteFile(p.relative_to(snapshot).as_posix(), p.stat().st_size, p.resolve().name)
        for p in snapshot.rglob("*")
        if p.is_file()
    ]


def _hub_file(name: str, size: int, blob_id: str, lfs_sha256: str | None, lfs_size: int | None) -> RemoteFile:
    """A file of a Hub revision: its blob in the cache is named by the LFS sha256, else the git blob id."""
    if lfs_sha256:
        return RemoteFile(name, int(lfs_size or size), lfs_sha256, ("sha256", lfs_sha256))
    return RemoteFile(name, int(size), blob_id, ("git-sha1", blob_id))


def _result(folder: Path, selected: list[RemoteFile]) -> Path:
    """The snapshot folder, or the one `.gguf` file of a GGUF selection."""
    if len(selected) == 1 and selected[0].name.lower().endswith(".gguf"):
        return folder / selected[0].name
    return folder


def _transient(exc: BaseException) -> bool:
    """A network error worth another attempt: no connection, a timeout, a 429 or a 5xx."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if isinstance(exc, httpx2.TransportError):
        return True
    if isinstance(exc, LocalEntryNotFoundError) and isinstance(exc.__cause__, httpx2.TransportError | HfHubHTTPError):
        return True
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        return status == 429 or status >= 500
    return False


def _error(exc: BaseException, repo_id: str, revision: str) -> DownloadError:
    """The one line for a Hub error: gated, private or missing repository, missing revision, denied."""
    import os

    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if isinstance(exc, GatedRepoError):
        return DownloadError(
            f"{repo_id} is a gated repository and "
            + ("the token in HF_TOKEN has no access to it: " if token else "HF_TOKEN is not set: ")
            + f"accept its conditions on {constants.ENDPOINT}/{repo_id} and set HF_TOKEN to a token of an account "
            "with access"
        )
    if isinstance(exc, RevisionNotFoundError):
        return DownloadError(f"revision {revision!r} of {repo_id} does not exist (give a branch, tag or commit of it)")
    if isinstance(exc, RepositoryNotFoundError):
        why = "HF_TOKEN is not valid for it" if token else "set HF_TOKEN if it is private"
        return DownloadError(
            f"repository {repo_id} was not found on {constants.ENDPOINT} ({why}), and no local directory has that name"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return DownloadError(
            f"access to {repo_id} on {constants.ENDPOINT} was denied ({exc.response.status_code}): check HF_TOKEN"
        )
    if _transient(exc):
        return DownloadError(f"downloading {repo_id} from {constants.ENDPOINT} failed: {one_line(exc)}")
    if isinstance(exc, OSError):
        return DownloadError(f"downloading {repo_id} failed: {one_line(exc)}")
    return DownloadError(f"downloading {repo_id} failed: {type(exc).__name__}: {one_line(exc)}")
