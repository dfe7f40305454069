"""What kind of model a directory holds, from its files alone (no torch import, nothing loaded).

- `torchscript`: a `.pt`/`.torchscript` file (the model id itself, or the only one in the directory);
- `embedding`: sentence-transformers files (`modules.json` or `sentence_bert_config.json`);
- `classifier`: `config.json` architectures ending in `ForSequenceClassification` (regression when the
  head has one label; the loaded model then reports kind `regression`);
- `llm`: anything else — causal LM directories, `.gguf` files, hub ids, the bundled default.

`option.model_kind` overrides the detection.
"""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("llm", "embedding", "classifier", "torchscript")
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".torchscript")
WEIGHT_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")


def detect_kind(model_id: str | None, configured: str = "auto") -> str:
    if configured and configured != "auto":
        return "classifier" if configured == "regression" else configured
    if not model_id:
        return "llm"
    path = Path(model_id).expanduser()
    if path.is_file():
        return "torchscript" if path.suffix.lower() in TORCHSCRIPT_SUFFIXES else "llm"
    if not path.is_dir():
        return "llm"
    if torchscript_file(path) is not None and not (path / "config.json").is_file():
        return "torchscript"
    if (path / "modules.json").is_file() or (path / "sentence_bert_config.json").is_file():
        return "embedding"
    architectures = _architectures(path / "config.json")
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "classifier"
    return "llm"


def torchscript_file(path: Path) -> Path | None:
    """`path` itself if it is a TorchScript file, else the single one in the directory `path`."""
    if path.is_file():
        return path if path.suffix.lower() in TORCHSCRIPT_SUFFIXES else None
    found = (
        sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in TORCHSCRIPT_SUFFIXES)
        if path.is_dir()
        else []
    )
    return found[0] if len(found) == 1 else None


def has_weights(directory: Path) -> bool:
    """True when the directory itself holds a model (not only a serving.properties)."""
    if any((directory / name).is_file() for name in WEIGHT_FILES):
        return True
    return any(
        p.suffix.lower() in (*TORCHSCRIPT_SUFFIXES, ".gguf", ".safetensors") for p in directory.iterdir() if p.is_file()
    )


def _architectures(config: Path) -> list[str]:
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return []
    archs = data.get("architectures") if isinstance(data, dict) else None
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
