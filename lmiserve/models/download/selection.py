"""Which files of a model repository or bucket prefix serving needs: one set of weights (safetensors when
there are any, never both `.bin` and `.safetensors`, never `original/` or consolidated copies), the config,
tokenizer and chat-template files, the adapter files of a LoRA adapter, sentence-transformers' module
configs, and for a GGUF repository the one `.gguf` file asked for (llama.cpp's `-hf org/repo:QUANT`).

The same rules serve the Hub, S3 and GCS: each lists `(name, size)` pairs, relative to the model's root.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from lmiserve.models.download.common import DownloadError

# llama.cpp's default when `-hf org/repo` names no quantization
DEFAULT_GGUF_TAG = "Q4_K_M"
# files at the root that describe the model (config, tokenizer, chat template, generation config, ...)
_DESCRIPTIVE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
# weights files that training leaves beside a model and serving never reads
_NOT_WEIGHTS = re.compile(r"^(training_args|optimizer|scheduler|rng_state.*|trainer_state)\.(bin|pt|pth)$")
_CONSOLIDATED = re.compile(r"^consolidated\b", re.IGNORECASE)
# sentence-transformers' module folders: "1_Pooling/config.json", "2_Normalize/..."
_ST_MODULE_DIR = re.compile(r"^\d+_\w+$")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".torchscript")


@dataclass(frozen=True)
class RemoteFile:
    """One file of a remote model: its name relative to the model's root, its size in bytes, its version as the
    source names it (the Hub: its blob's name; S3 and GCS: the ETag), and the digest to verify it by
    (`("sha256" | "git-sha1" | "md5", hex)`, when the source gives one)."""

    name: str
    size: int
    etag: str = ""
    digest: tuple[str, str] | None = None


def split_gguf_tag(model_id: str) -> tuple[str, str | None]:
    """`org/repo:Q4_K_M` -> ("org/repo", "Q4_K_M"); an id without a tag -> (id, None)."""
    repo, sep, tag = model_id.rpartition(":")
    if sep and repo and "/" not in tag and tag.strip():
        return repo, tag.strip()
    return model_id, None


def select(
    files: Iterable[RemoteFile],
    *,
    source: str,
    gguf_file: str | None = None,
    gguf_tag: str | None = None,
    trust_remote_code: bool = False,
) -> list[RemoteFile]:
    """The files to fetch from `files` (all of `source`, named in errors). DownloadError when there is no
    model among them, or the GGUF file asked for is not there."""
    every = sorted(files, key=lambda f: f.name)
    if not every:
        raise DownloadError(f"{source} holds no model: it has no files")
    ggufs = [f for f in every if f.name.lower().endswith(".gguf") and "/" not in f.name]
    if gguf_file or gguf_tag:
        return [_pick_gguf(ggufs, source, gguf_file, gguf_tag)]
    top = [f for f in every if "/" not in f.name]
    names = {f.name for f in top}
    if "config.json" not in names and "adapter_config.json" not in names:
        if ggufs:  # a GGUF repository: the default quantization, or its only file
            return [_pick_gguf(ggufs, source, None, None)]
        scripts = [f for f in top if f.name.lower().endswith(TORCHSCRIPT_SUFFIXES) and not _NOT_WEIGHTS.match(f.name)]
        if len(scripts) == 1:  # a TorchScript model
            return [*scripts, *(f for f in top if f.name.endswith(".json") or f.name == "serving.properties")]
        raise DownloadError(
            f"{source} holds no model: no config.json, adapter_config.json, .gguf or TorchScript file among its "
            f"{len(every)} file(s)"
        )
    chosen = [f for f in top if _descriptive(f.name, trust_remote_code)]
    chosen += _weights(top)
    chosen += [f for f in every if _sentence_transformers_module(f.name)]
    if not any(f.name.endswith((".safetensors", ".bin")) for f in chosen):
        raise DownloadError(f"{source} holds no model weights: no .safetensors or .bin file beside its config.json")
    return sorted(set(chosen), key=lambda f: f.name)


def _descriptive(name: str, trust_remote_code: bool) -> bool:
    if name.endswith(".index.json"):
        return False  # chosen with their weights
    if name == "serving.properties":
        return True
    if name.endswith(".py"):
        return trust_remote_code  # the repository's own code runs only when allowed
    return name.lower().endswith(_DESCRIPTIVE_SUFFIXES) and not name.lower().startswith(("readme", "license"))


def _weights(top: list[RemoteFile]) -> list[RemoteFile]:
    """One set of weights: the safetensors (with their index) when there are any, else the `.bin` files."""
    safetensors = [f for f in top if f.name.endswith(".safetensors") and not _CONSOLIDATED.match(f.name)]
    if safetensors:
        return safetensors + [f for f in top if f.name.endswith(".safetensors.index.json")]
    bins = [f for f in top if f.name.endswith(".bin") and not _NOT_WEIGHTS.match(f.name)]
    return bins + [f for f in top if f.name.endswith(".bin.index.json")]


def _sentence_transformers_module(name: str) -> bool:
    parts = PurePosixPath(name).parts
    return len(parts) == 2 and _ST_MODULE_DIR.match(parts[0]) is not None and parts[1].endswith(".json")


def _pick_gguf(ggufs: list[RemoteFile], source: str, gguf_file: str | None, tag: str | None) -> RemoteFile:
    if gguf_file:
        found = [f for f in ggufs if f.name == gguf_file]
        if not found:
            raise DownloadError(f"{source} has no file {gguf_file!r}; its GGUF files: {_listed(ggufs)}")
        return _single(found[0], source)
    if not ggufs:
        raise DownloadError(f"{source} has no .gguf file (a quantization tag :{tag} was given)")
    wanted = (tag or DEFAULT_GGUF_TAG).lower()
    matches = [f for f in ggufs if _tag_of(f.name) == wanted]
    if not matches and tag is None and len(ggufs) == 1:
        matches = ggufs
    if not matches:
        tags = sorted({_tag_of(f.name).upper() for f in ggufs})
        hint = f"name one with {source}:TAG" if tag is None else "choose one of them"
        raise DownloadError(
            f"{source} has no {wanted.upper()} GGUF file; its quantizations: {', '.join(tags)} ({hint}, "
            "or the file with gguf_file)"
        )
    return _single(matches[0], source)


def _single(found: RemoteFile, source: str) -> RemoteFile:
    if _SPLIT_GGUF.search(found.name):
        raise DownloadError(f"{found.name} of {source} is one part of a split GGUF file, which is not supported")
    return found


def _tag_of(name: str) -> str:
    """The quantization tag of a GGUF file name: "Model-Q4_K_M.gguf" -> "q4_k_m"."""
    stem = name[: -len(".gguf")]
    match = re.search(r"[.-]((?:I?Q\d\w*)|BF16|F16|F32)$", stem, re.IGNORECASE)
    return (match.group(1) if match else stem).lower()


def _listed(files: list[RemoteFile]) -> str:
    return ", ".join(f.name for f in files) or "none"
