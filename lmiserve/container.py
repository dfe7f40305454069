"""The container's entrypoint (`python -m lmiserve.container`, the Dockerfile's ENTRYPOINT).

SageMaker runs a bring-your-own container as ``docker run IMAGE serve``, with the model artifacts
(model.tar.gz, extracted) under ``/opt/ml/model``, and expects port 8080, ``GET /ping`` and ``POST
/invocations``. Vertex AI runs the image's own command, telling the port and routes in ``AIP_*``
variables (``AIP_HTTP_PORT``, ``AIP_HEALTH_ROUTE``, ``AIP_PREDICT_ROUTE``: lmiserve's settings read
them, lmiserve/config/sources.py) and the artifacts' location in ``AIP_STORAGE_URI``.

- ``serve [ARGS...]`` (also no command, or one starting with ``-``): ``lmiserve serve --model-dir
  ROOT ARGS...`` when the model root holds anything (a model, a serving.properties, or both), else
  ``lmiserve serve ARGS...``, which serves the model of ``HF_MODEL_ID``/``OPTION_MODEL_ID``/``MODEL_ID`` or the
  bundled default. The root: ``LMISERVE_MODEL_DIR``, else ``AIP_STORAGE_URI`` when it is a local
  directory (a path or ``file://``), else ``SM_MODEL_DIR``, else ``/opt/ml/model``. A ``gs://`` (or
  ``s3://``) ``AIP_STORAGE_URI`` is the model when the root holds none: lmiserve's settings read it and
  the model is downloaded at start (docs/models.md).
- anything else (``bash``, ``python ...``, ``lmiserve bench ...``) runs as given.

The chosen command replaces this process (exec), so SIGTERM reaches lmiserve directly: it drains and
exits 0 (lmiserve/server/drain.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

DEFAULT_MODEL_ROOT = "/opt/ml/model"


def model_root(environ: Mapping[str, str]) -> tuple[Path, list[str]]:
    """The directory the model is looked for in, and notes worth a line on stderr."""
    notes: list[str] = []
    if environ.get("LMISERVE_MODEL_DIR", "").strip():
        return Path(environ["LMISERVE_MODEL_DIR"].strip()), notes
    storage = environ.get("AIP_STORAGE_URI", "").strip()
    if storage:
        local = _local_path(storage)
        if local is not None and local.is_dir():
            return local, notes
    return Path(environ.get("SM_MODEL_DIR", "").strip() or DEFAULT_MODEL_ROOT), notes


def has_model(root: Path) -> bool:
    """True if `root` is a directory with anything in it (hidden entries and lost+found aside)."""
    if not root.is_dir():
        return False
    return any(not entry.name.startswith(".") and entry.name != "lost+found" for entry in root.iterdir())


def command(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The command line to exec for the container's arguments `argv`, and notes for stderr."""
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
    elif args and not args[0].startswith("-"):
        return args, []  # another command: run as given
    lmiserve = [sys.executable, "-m", "lmiserve", "serve"]
    if any(flag in args for flag in ("--model-dir", "--model-id", "--model", "--model-store")):
        return [*lmiserve, *args], []
    root, notes = model_root(environ)
    if has_model(root):
        notes.append(f"serving the model directory {root}")
        return [*lmiserve, "--model-dir", str(root), *args], notes
    storage = environ.get("AIP_STORAGE_URI", "").strip()
    if _model_id_set(environ):
        source = "the model of HF_MODEL_ID/OPTION_MODEL_ID/MODEL_ID"
    elif "://" in storage and not storage.startswith("file:"):
        source = f"the model at AIP_STORAGE_URI={storage} (downloaded at start)"
    else:
        source = "the bundled default model"
    notes.append(f"{root} holds no model: serving {source}")
    return [*lmiserve, *args], notes


def main(argv: Sequence[str] | None = None) -> NoReturn:
    line, notes = command(sys.argv[1:] if argv is None else argv, os.environ)
    for note in notes:
        print(f"lmiserve-container: {note}", file=sys.stderr, flush=True)
    try:
        os.execvp(line[0], line)
    except OSError as exc:
        print(f"lmiserve-container: cannot run {line[0]}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        raise SystemExit(127) from None


def _local_path(uri: str) -> Path | None:
    if uri.startswith("/"):
        return Path(uri)
    parsed = urlparse(uri)
    return Path(parsed.path) if parsed.scheme == "file" else None


def _model_id_set(environ: Mapping[str, str]) -> bool:
    names = ("HF_MODEL_ID", "OPTION_MODEL_ID", "SERVING_MODEL_ID", "MODEL_ID")
    return any(environ.get(name, "").strip() for name in names)


if __name__ == "__main__":
    main()
