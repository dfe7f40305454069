"""A model store: a directory whose sub-directories are models, each named after its directory.

A sub-directory counts when it holds a `serving.properties` or model files (config.json, weights, a
`.pt`/`.gguf` file). Its settings are the global ones with its own serving.properties on top (and,
for models registered through the management API, the call's options on top of that). Its model is
the directory itself when it holds model files, else the properties' `option.model_id` (relative paths
are relative to the directory), else the bundled default LLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from lmiserve.config import ConfigError, Settings
from lmiserve.config.sources import PROPERTIES_FILE_NAME, properties_layer
from lmiserve.models.kinds import has_weights

# Keys a model never inherits from the global settings: they name one model.
_OWN_KEYS = frozenset({"model_id", "model_name", "model_kind"})


def scan_store(store: str | Path) -> list[tuple[str, Path]]:
    """(name, directory) of every model in the store, sorted by name."""
    root = Path(store).expanduser()
    if not root.is_dir():
        raise ConfigError(f"model store '{root}' does not exist or is not a directory")
    return [
        (d.name, d.resolve())
        for d in sorted(root.iterdir())
        if d.is_dir() and not d.name.startswith(".") and ((d / PROPERTIES_FILE_NAME).is_file() or has_weights(d))
    ]


def model_settings(
    base: Settings, directory: Path, name: str | None = None, overrides: Mapping[str, object] | None = None
) -> Settings:
    """Settings of the model in `directory`: `base` < its serving.properties < `overrides`."""
    directory = Path(directory)
    options: dict[str, object] = {}
    sources: dict[str, str] = {}
    for key, source in base.sources.items():
        if key in _OWN_KEYS:
            continue
        if key in base.extra:
            options[key] = base.extra[key]
        elif key in Settings.model_fields:
            options[key] = getattr(base, key)
        sources[key] = source
    for key, (value, source) in properties_layer(None, directory).items():
        options[key], sources[key] = value, source
    for key, value in (overrides or {}).items():
        if value is not None:
            options[key], sources[key] = value, "model registration"
    model_id = str(options.get("model_id") or "").strip()
    if (overrides or {}).get("model_id"):
        pass  # the caller named the model file itself
    elif has_weights(directory):
        options["model_id"], sources["model_id"] = str(directory), f"model directory {directory}"
    elif model_id and not model_id.startswith(("/", "~")) and (directory / model_id).exists():
        options["model_id"] = str((directory / model_id).resolve())
    elif not model_id:
        options.pop("model_id", None)
    if name:
        options["model_name"], sources["model_name"] = name, f"model store directory {directory}"
    return Settings.from_options(options, sources)
