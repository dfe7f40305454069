"""Model location and loading: resolve a model id to a local transformers directory, load it.

Importing this package is cheap: torch/transformers are only imported when a loader runs, so the
CLI can import `ModelLoadError` (and the resolvers) without paying for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lmiserve.models.errors import ModelLoadError

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from lmiserve.models.bundled import DEFAULT_GGUF_FILE as DEFAULT_GGUF_FILE
    from lmiserve.models.bundled import DEFAULT_GGUF_PACKAGE as DEFAULT_GGUF_PACKAGE
    from lmiserve.models.bundled import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME
    from lmiserve.models.bundled import bundled_gguf_path as bundled_gguf_path
    from lmiserve.models.bundled import bundled_model_path as bundled_model_path
    from lmiserve.models.bundled import convert_gguf as convert_gguf
    from lmiserve.models.bundled import converted_dir as converted_dir
    from lmiserve.models.bundled import default_cache_dir as default_cache_dir
    from lmiserve.models.load import LoadedModel as LoadedModel
    from lmiserve.models.load import load_causal_lm as load_causal_lm
    from lmiserve.models.load import resolve_device as resolve_device
    from lmiserve.models.load import resolve_dtype as resolve_dtype
    from lmiserve.models.resolve import default_model_name as default_model_name
    from lmiserve.models.resolve import resolve_model_path as resolve_model_path

_LAZY: dict[str, str] = {
    "DEFAULT_GGUF_FILE": "lmiserve.models.bundled",
    "DEFAULT_GGUF_PACKAGE": "lmiserve.models.bundled",
    "DEFAULT_MODEL_NAME": "lmiserve.models.bundled",
    "bundled_gguf_path": "lmiserve.models.bundled",
    "bundled_model_path": "lmiserve.models.bundled",
    "convert_gguf": "lmiserve.models.bundled",
    "converted_dir": "lmiserve.models.bundled",
    "default_cache_dir": "lmiserve.models.bundled",
    "LoadedModel": "lmiserve.models.load",
    "load_causal_lm": "lmiserve.models.load",
    "resolve_device": "lmiserve.models.load",
    "resolve_dtype": "lmiserve.models.load",
    "default_model_name": "lmiserve.models.resolve",
    "resolve_model_path": "lmiserve.models.resolve",
}

__all__ = [
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_MODEL_NAME",
    "LoadedModel",
    "ModelLoadError",
    "bundled_gguf_path",
    "bundled_model_path",
    "convert_gguf",
    "converted_dir",
    "default_cache_dir",
    "default_model_name",
    "load_causal_lm",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_path",
]  # ModelLoadError and the names of _LAZY


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
