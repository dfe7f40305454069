"""Load the one-shot model kinds (embedding, classifier, TorchScript) into their engine runners.

Everything is read from local files (never downloaded). The sentence-transformers pipeline of an
embedding directory is read from its own config files — `modules.json`, the Pooling module's
`config.json`, `sentence_bert_config.json` — without the sentence-transformers package.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lmiserve.config import Settings
from lmiserve.core.tensors import ModelSignature, TensorSpec
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.kinds import torchscript_file

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lmiserve.oneshot.batcher import TensorRunner
    from lmiserve.oneshot.text import ClassifierRunner, EmbeddingRunner, Pooling
    from lmiserve.oneshot.torchscript import TorchScriptRunner

log = logging.getLogger(__name__)

_POOLING_KEYS = (  # sentence-transformers Pooling config key -> our mode, in its order of precedence
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_lasttoken", "lasttoken"),
)
TENSOR_DTYPES = ("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64")


def load_runner(kind: str, settings: Settings, model_id: str | None = None) -> TensorRunner:
    """The engine runner of a one-shot model described by `settings` (model_id, device, dtype, ...);
    `model_id`: where its files are, when not `settings.model_id` (a downloaded model's local copy)."""
    model_id = model_id or settings.model_id
    if not model_id:
        raise ModelLoadError(f"a {kind} model needs model_id (its directory)")
    path = Path(model_id).expanduser().resolve()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if kind == "torchscript":
        return load_torchscript(path, settings)
    if kind == "embedding":
        return load_embedding(path, settings)
    if kind in ("classifier", "regression"):
        return load_classifier(path, settings)
    raise ModelLoadError(f"unknown model kind {kind!r}")


def read_pooling(path: Path) -> Pooling:
    """The Pooling (mode) and Normalize steps of a sentence-transformers directory; mean without one."""
    from lmiserve.oneshot.text import Pooling

    modules = _json(path / "modules.json", default=[])
    mode, normalize = "mean", False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            config = _json(path / module.get("path", "") / "config.json", default={})
            if isinstance(config, dict) and config.get("pooling_mode"):
                named = str(config["pooling_mode"])
                mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}.get(named, named)
            else:
                chosen = [m for key, m in _POOLING_KEYS if isinstance(config, dict) and config.get(key)]
                if len(chosen) > 1:
                    raise ModelLoadError(f"{path}: combined pooling modes {chosen} are not supported")
                mode = chosen[0] if chosen else "mean"
        elif kind.endswith(".Normalize"):
            normalize = True
    from lmiserve.oneshot.text import POOLING_MODES

    if mode not in POOLING_MODES:
        raise ModelLoadError(f"{path}: pooling mode {mode!r} is not supported (supported: {', '.join(POOLING_MODES)})")
    return Pooling(mode=mode, normalize=normalize)


def load_embedding(path: Path, settings: Settings) -> EmbeddingRunner:
    from transformers import AutoModel

    from lmiserve.oneshot.text import EmbeddingRunner

    pooling = read_pooling(path)
    model, tokenizer, device = _load_transformers(AutoModel.from_pretrained, path, settings)
    bert = _json(path / "sentence_bert_config.json", default={})
    max_length = _max_length(model, tokenizer, bert.get("max_seq_length") if isinstance(bert, dict) else None)
    dim = int(getattr(model.config, "hidden_size", 0) or 0) or -1
    matryoshka = read_matryoshka(path, dim)
    log.info(
        "embedding model %s: %s pooling%s, dim %d, max %d tokens",
        path,
        pooling.mode,
        " + normalize" if pooling.normalize else "",
        dim,
        max_length,
    )
    return EmbeddingRunner(
        model,
        tokenizer,
        pooling=pooling,
        dim=dim,
        path=path,
        device=device,
        max_length=max_length,
        matryoshka=matryoshka,
        prompts=read_prompts(path),
    )


def read_prompts(path: Path) -> dict[str, str]:
    """The named prompts of `config_sentence_transformers.json` (``"prompts": {"query": "query: "}``)."""
    config = _json(path / "config_sentence_transformers.json", default={})
    prompts = config.get("prompts") if isinstance(config, dict) else None
    if not isinstance(prompts, dict):
        return {}
    return {str(k): v for k, v in prompts.items() if isinstance(v, str)}


def read_matryoshka(path: Path, dim: int) -> tuple[int, ...] | None:
    """The dimensions an embedding may be cut to, as the directory declares them (in `config.json` or
    `config_sentence_transformers.json`, the first that says): ``"matryoshka_dimensions": [64, 128, ...]``
    (those, and `dim`), or ``"is_matryoshka": true`` (any, answered as the empty tuple); None when
    neither file declares it (the embedding is only served whole)."""
    for name in ("config.json", "config_sentence_transformers.json"):
        config = _json(path / name, default={})
        if not isinstance(config, dict):
            continue
        listed = config.get("matryoshka_dimensions")
        if isinstance(listed, list) and listed:
            if not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= dim for d in listed):
                raise ModelLoadError(f"{path / name}: matryoshka_dimensions must be integers from 1 to {dim}")
            return tuple(sorted({*listed, dim}))
        if config.get("is_matryoshka") is True:
            return ()
    return None


def load_classifier(path: Path, settings: Settings) -> ClassifierRunner:
    from transformers import AutoModelForSequenceClassification

    from lmiserve.oneshot.text import ClassifierRunner

    model, tokenizer, device = _load_transformers(AutoModelForSequenceClassification.from_pretrained, path, settings)
    return ClassifierRunner(model, tokenizer, path=path, device=device, max_length=_max_length(model, tokenizer, None))


def load_torchscript(path: Path, settings: Settings) -> TorchScriptRunner:
    import torch

    from lmiserve.models.load import resolve_device
    from lmiserve.oneshot.torchscript import TorchScriptRunner

    file = torchscript_file(path)
    if file is None:
        raise ModelLoadError(f"{path}: expected one TorchScript file (.pt, .pth or .torchscript)")
    signature = torchscript_signature(settings)
    device = resolve_device(settings.device)
    try:
        module = torch.jit.load(str(file), map_location=device)  # type: ignore[no-untyped-call, unused-ignore]  # torch leaves it unannotated
    except (RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"could not load the TorchScript module {file}: {exc}") from exc
    module.eval()
    return TorchScriptRunner(module, signature, path=file, device=device)


def torchscript_signature(settings: Settings) -> ModelSignature:
    """Inputs and outputs from input_names/_dtypes/_shapes and output_names/_dtypes/_shapes."""
    inputs = _specs("input", settings.input_names, settings.input_dtypes, settings.input_shapes)
    outputs = _specs("output", settings.output_names, settings.output_dtypes, settings.output_shapes)
    return ModelSignature(inputs=inputs, outputs=outputs)


def _specs(prefix: str, names: str | None, dtypes: str | None, shapes: str | None) -> tuple[TensorSpec, ...]:
    name_list = _split(names, ",")
    dtype_list = [d.upper() for d in _split(dtypes, ",")]
    shape_list = _split(shapes, ";")
    count = max(len(name_list), len(dtype_list), len(shape_list), 1)
    name_list = name_list or [f"{prefix}__{i}" for i in range(count)]
    dtype_list = dtype_list or ["FP32"] * count
    shape_list = shape_list or ["-1"] * count
    if not len(name_list) == len(dtype_list) == len(shape_list):
        raise ModelLoadError(
            f"{prefix}_names, {prefix}_dtypes and {prefix}_shapes describe different numbers of tensors "
            f"({len(name_list)}, {len(dtype_list)}, {len(shape_list)})"
        )
    specs = []
    for name, dtype, shape in zip(name_list, dtype_list, shape_list):
        if dtype not in TENSOR_DTYPES:
            raise ModelLoadError(f"{prefix}_dtypes: {dtype!r} is not one of {', '.join(TENSOR_DTYPES)}")
        try:
            dims = tuple(int(d) for d in _split(shape, ","))
        except ValueError:
            raise ModelLoadError(f"{prefix}_shapes: {shape!r} is not a list of integers like -1,4") from None
        if not dims or any(d < -1 or d == 0 for d in dims):
            raise ModelLoadError(f"{prefix}_shapes: {shape!r} needs positive dimensions or -1")
        specs.append(TensorSpec(name, dtype, dims))
    return tuple(specs)


def _split(text: str | None, sep: str) -> list[str]:
    return [part.strip() for part in (text or "").split(sep) if part.strip()]


def _load_transformers(
    load: Callable[..., PreTrainedModel], path: Path, settings: Settings
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.device]:
    """`load` is an auto class's `from_pretrained`."""
    from transformers import AutoTokenizer

    from lmiserve.models.load import resolve_device, resolve_dtype

    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    common = {"local_files_only": True, "trust_remote_code": settings.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
        model = load(path, dtype=dtype, **common)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"could not load the model in {path}: {exc}") from exc
    model.to(device)  # type: ignore[arg-type]  # transformers wraps `to` with @wraps(Module.to): the stub wants `self` again
    model.train(False)  # eval mode (what `model.eval()` does; transformers leaves `eval` unannotated)
    return model, tokenizer, device


def _max_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, configured: object) -> int:
    candidates = [
        configured,
        getattr(model.config, "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    ]
    values = [int(v) for v in candidates if isinstance(v, int) and 0 < v < 10_000_000]
    return min(values) if values else 512


def _json(path: Path, default: object) -> object:
    """The JSON document in `path` (any JSON value), or `default` when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default
