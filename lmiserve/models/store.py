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
from urllib.parse import unquote, urlparse

from lmiserve.config import ConfigError, Settings
from lmiserve.config.sources import PROPERTIES_FILE_NAME, properties_layer
from lmiserve.core.errors import Forbidden, InvalidRequest
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
    base: Settings, directory: Path | None, name: str | None = None, overrides: Mapping[str, object] | None = None
) -> Settings:
    """Settings of the model in `directory`: `base` < its serving.properties < `overrides`. Without a
    directory (a remote model: `overrides` name its `model_id`), `base` < `overrides`."""
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
    for key, (value, source) in (properties_layer(None, Path(directory)) if directory is not None else {}).items():
        options[key], sources[key] = value, source
    for key, value in (overrides or {}).items():
        if value is not None:
            options[key], sources[key] = value, "model registration"
    model_id = str(options.get("model_id") or "").strip()
    if (overrides or {}).get("model_id") or directory is None:
        pass  # the caller named the model file (or the remote model) itself
    elif has_weights(directory):
        options["model_id"], sources["model_id"] = str(directory), f"model directory {directory}"
    elif model_id and not model_id.startswith(("/", "~")) and (directory / model_id).exists():
        options["model_id"] = str((directory / model_id).resolve())
    elif not model_id:
        options.pop("model_id", None)
    if name:
        options["model_name"], sources["model_name"] = (
            name,
            f"model store directory {directory}" if directory else "model registration",
        )
    return Settings.from_options(options, sources)


def remote_source(url: object, settings: Settings, *, what: str = "Model") -> str | None:
    """The remote model `url` names (an `s3://`, `gs://` or `hf://` URL, or a Hub id `org/name` that the
    operator allows and no local path under the model roots has), None for a local path. Forbidden for a
    remote one outside `allowed_model_urls`: a caller must never make the server fetch a URL of its choosing."""
    from lmiserve.models.download import allowed, scheme_of

    text = str(url or "").strip()
    if not text:
        return None
    scheme, sep, _ = text.partition("://")
    if not sep:
        roots = settings.model_roots()
        local = roots and (roots[0] / text).exists()
        if local or scheme_of(text) != "hf" or not allowed(text, settings.allowed_model_urls):
            return None  # a local path: allowed_path decides
        return text
    if scheme.lower() not in ("s3", "gs", "hf"):
        return None
    if not allowed(text, settings.allowed_model_urls):
        raise Forbidden(
            f"{what} URL {text} is not allowed: this server fetches only what allowed_model_urls lists "
            f"({settings.allowed_model_urls or 'nothing'})."
        )
    return text


def allowed_path(url: object, roots: list[Path], *, what: str = "Model", param: str = "url") -> Path:
    """The directory or file `url` (a path or a file: URL) names, if it lies under one of `roots`
    (model_store first; a relative path is taken relative to it): what the management APIs may load
    from (POST /models, and the adapters APIs with ``what="Adapter"``, ``param="src"``). InvalidRequest
    for a missing or unsupported `url` or one that does not exist, Forbidden outside the roots. The root
    check comes before any look at the file system, so a refused path reveals nothing about what
    exists; the path is resolved first (``..`` and symbolic links), so neither leads out of a root."""
    if not url or not str(url).strip():
        raise InvalidRequest(f"Parameter {param} is required.")
    url = str(url).strip()
    parsed = urlparse(url)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
    elif parsed.scheme in ("",) or len(parsed.scheme) == 1:  # a plain path (or a Windows drive letter)
        path = Path(url)
    else:
        raise InvalidRequest(
            f"Unsupported {param} {url}: this server loads local directories (a path or file: URL), and Hub ids, "
            "s3:// and gs:// URLs that allowed_model_urls lists."
        )
    if not roots:
        raise Forbidden(
            f"{what} registration is not allowed: no model root is configured (set model_store or allowed_model_paths)."
        )
    if "\x00" in str(path):
        raise InvalidRequest(f"Invalid {param} {url}")
    path = (roots[0] / path.expanduser()).resolve()  # an absolute path replaces roots[0]
    if not any(path == root or path.is_relative_to(root) for root in roots):
        raise Forbidden(f"{what} path {url} is not under an allowed model root (model_store or allowed_model_paths).")
    if not path.exists():
        raise InvalidRequest(f"{what} directory not found: {url}")
    return path
