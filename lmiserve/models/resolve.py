"""Turn the configured model id into a local transformers directory and a served model name.

Accepted model ids: nothing (the bundled SmolLM2 default), a transformers model directory, a `.gguf`
file (converted once into the cache), a Hugging Face Hub id (`org/name`, `org/repo:Q4_K_M`) or an
`s3://` / `gs://` URL: the remote ones are fetched at start (models/download), then served as local.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lmiserve.models import bundled
from lmiserve.models.download import FetchOptions, fetch, scheme_of
from lmiserve.models.download.selection import split_gguf_tag
from lmiserve.models.errors import ModelLoadError

# "name" or "org/name", as the hub spells repo ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Trailing quantization tag of GGUF file names: "Model.Q4_1", "model-q8_0", "Model.F16", "Model.IQ3_XS".
_GGUF_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)


def resolve_model_path(
    model_id: str | None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    options: FetchOptions | None = None,
) -> Path:
    """A local transformers directory (with config.json) for `model_id`; raise ModelLoadError if none.

    `cache_dir` is where converted GGUF models live (settings.model_cache_dir; default: the user
    cache dir of lmiserve); `revision` only applies to Hub ids; `options` say how a remote model is
    fetched (default: `revision` and the defaults of FetchOptions).
    """
    if model_id is None or not model_id.strip():
        return bundled.bundled_model_path(cache_dir)
    model_id = model_id.strip()
    if "://" in model_id and scheme_of(model_id) is None:
        raise ModelLoadError(
            f"model id {model_id!r} is a URL of a scheme lmiserve does not fetch: use a Hub id (org/name), "
            "an s3:// or gs:// URL, or a local directory"
        )
    if scheme_of(model_id) is not None:
        fetched = fetch(model_id, options or FetchOptions(revision=revision))
        return bundled.convert_gguf(fetched, cache_dir) if fetched.is_file() else _check_model_dir(fetched)
    local = Path(model_id).expanduser()
    if local.is_dir():
        return _check_model_dir(local)
    if local.is_file():
        if local.suffix.lower() == ".gguf":
            return bundled.convert_gguf(local, cache_dir)
        raise ModelLoadError(
            f"model id {model_id!r} is a file but not a .gguf file; pass a transformers model "
            "directory (with config.json), a .gguf file or a hub id"
        )
    raise ModelLoadError(f"model path {model_id!r} does not exist")


def default_model_name(model_id: str | None, path: str | os.PathLike[str] | None = None) -> str:
    """The served model name when none is configured, as LMI derives it.

    None -> "SmolLM2-135M-Instruct"; a local directory -> its basename; a .gguf file -> its stem
    without the quantization tag; a hub id -> non-word characters replaced by "_"
    ("TheBloke/Llama-2-7B-fp16" -> "TheBloke_Llama_2_7B_fp16").
    """
    if model_id is None or not model_id.strip():
        return bundled.DEFAULT_MODEL_NAME
    model_id = model_id.strip()
    if scheme_of(model_id) == "hf":
        model_id = split_gguf_tag(model_id.removeprefix("hf://"))[0]
    local = Path(model_id).expanduser()
    if local.exists() or _looks_like_path(model_id):
        local = Path(os.path.abspath(local))  # not resolve(): keep a symlink's own name
        if local.suffix.lower() == ".gguf":
            return _GGUF_QUANT_SUFFIX.sub("", local.stem) or local.stem
        return local.name or (Path(path).name if path is not None else "model")
    return re.sub(r"\W", "_", model_id)


def _looks_like_path(model_id: str) -> bool:
    """True unless the id could be a hub repo id ("name" or "org/name")."""
    return model_id.startswith(("/", ".", "~")) or model_id.lower().endswith(".gguf") or _HUB_ID.match(model_id) is None


def _check_model_dir(directory: Path) -> Path:
    directory = directory.resolve()
    if (directory / "config.json").is_file():
        return directory
    ggufs = sorted(directory.glob("*.gguf"))
    hint = (
        f"; it holds GGUF files, pass one of them instead, e.g. --model-id {ggufs[0]}"
        if ggufs
        else " (a transformers model directory needs config.json, weights and tokenizer files)"
    )
    raise ModelLoadError(f"model directory {directory} has no config.json{hint}")
