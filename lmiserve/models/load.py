"""Load a local transformers causal LM directory onto a device, ready for the engine."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lmiserve.engine.loaded import LoadedModel  # the engine's input, built here
from lmiserve.engine.model.quantize import (
    INT8_COMPUTE_DTYPE,
    int4_available,
    int8_available,
    quantize_linears,
)
from lmiserve.models.attention_choice import sdpa_or_default
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.int4_load import load_int4_from_codes, quantize_int4
from lmiserve.models.quantized_load import (
    checkpoint_quantization,
    load_quantized,
    quantize_at_load,
)
from lmiserve.models.vision import is_vision_config, load_processor

__all__ = [
    "DEFAULT_MAX_CONTEXT",
    "LoadedModel",
    "load_causal_lm",
    "load_model_shell",
    "resolve_device",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 2048
_SANE_MAX_CONTEXT = 10_000_000  # tokenizers default model_max_length to ~1e30 when unknown
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(device: str = "auto") -> torch.device:
    """ "auto" -> cuda if available else cpu; "cpu", "cuda", "cuda:N" (and other torch devices) as given."""
    spec = (device or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(spec)
    except RuntimeError as exc:
        raise ModelLoadError(f"invalid device {device!r}: use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """ "auto" -> fp32 on CPU, bf16 on CUDA if supported else fp16; fp32/fp16/bf16 (and long names);
    int8 -> the dtype its activations run in (bf16); int4 -> fp32 (only its products run in bf16).

    On CPU, auto keeps fp32: bf16 and int8 can decode faster (int8 about 2x at batch 1 on an AVX-512
    BF16 Xeon) but change the greedy output against fp32 beyond the documented tolerance (docs/performance/dtypes.md,
    "Why `dtype=auto` stays fp32 on CPU"), so they are opt-in."""
    spec = (dtype or "auto").strip().lower()
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if spec == "int8":
        return INT8_COMPUTE_DTYPE
    if spec == "int4":
        return torch.float32
    try:
        return _DTYPES[spec]
    except KeyError:
        raise ModelLoadError(f"invalid dtype {dtype!r}: use auto, fp32, fp16, bf16, int8 or int4") from None


def load_causal_lm(
    path: str | os.PathLike[str],
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    name: str | None = None,
    load_format: str = "auto",
    quantize: str | None = None,
) -> LoadedModel:
    """Load model and tokenizer from the local directory `path` (never downloads). `load_format`
    `dummy`: random weights from the directory's config instead of its weights (vLLM's `dummy`).
    `quantize` (fp8, awq, gptq; None: what the checkpoint holds): a quantized checkpoint's format, which
    must be the one its config.json names, or fp8 made at load from float weights (models/quantized_load.py).

    A vision-language model (a config with a vision tower) loads with AutoModelForImageTextToText and its
    processor (on the PIL image backend: models/vision.py), whose tokenizer is the model's tokenizer."""
    path = Path(path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    spec = (dtype or "").strip().lower()
    int8, int4 = spec == "int8", spec == "int4"
    if int8 and (torch_device.type != "cpu" or not int8_available()):
        raise ModelLoadError("dtype int8 (weight-only int8) runs on CPU only, with torch's int8 kernel")
    if int4 and (torch_device.type != "cpu" or not int4_available()):
        raise ModelLoadError("dtype int4 (weight-only int4) runs on CPU only, with lmiserve's compiled kernels (numba)")
    quant = checkpoint_quantization(path, quantize, load_format)
    if quant is not None and (int8 or int4):
        raise ModelLoadError(f"dtype {spec} does not combine with quantize {quant.method}: leave dtype auto")
    start = time.monotonic()
    common = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    processor = None
    quant_summary = None
    try:
        config = AutoConfig.from_pretrained(path, **common)
        auto_class, tokenizer, processor = _model_class(path, config, common)
        # int8: quantized from fp32 weights (the scales are then exact), the rest cast to bf16 after
        load_dtype = torch.float32 if int8 else torch_dtype
        # int4 of a GGUF's codes: built without the fp32 linears the codes replace (None: no codes)
        from_codes = load_int4_from_codes(path, trust_remote_code) if int4 and load_format != "dummy" else None
        if load_format == "dummy":
            model = _dummy_model(path, load_dtype, torch_device, common, auto_class)
        elif from_codes is not None:
            model = from_codes[0]  # type: ignore[assignment]  # AutoModelForCausalLM's, typed as a Module
        elif quant is not None and not quant.dynamic:
            model, quant_summary = load_quantized(path, quant, torch_dtype, torch_device, trust_remote_code, auto_class)  # type: ignore[assignment]
        else:
            model = _load_model(path, load_dtype, common, auto_class)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"could not load the model in {path}: {exc}") from exc
    model.to(torch_device)  # type: ignore[arg-type]  # transformers wraps `to` with @wraps(Module.to): the stub wants `self` again
    model.train(False)  # eval mode (what `model.eval()` does; transformers leaves `eval` unannotated)
    if int8:
        count = quantize_linears(model, torch_dtype)
        logger.info("int8: %d linear layers quantized (per-channel symmetric), activations in bf16", count)
    if int4:
        logger.info("%s", from_codes[1] if from_codes is not None else quantize_int4(model, path))
    if int8 or int4:
        _warn_unquantized_experts(model, "int8" if int8 else "int4")
    if quant is not None and quant.source in ("dynamic", "dummy"):
        quant_summary = quantize_at_load(model, quant, torch_dtype, torch_device)
    if quant_summary is not None:
        logger.info("quantize: %s", quant_summary)

    loaded = _loaded(model, tokenizer, torch_device, torch_dtype, name or path.name, path, processor)
    logger.info(
        "loaded %s (%s, %s on %s, context %d) in %.1f s",
        path,
        type(model).__name__,
        "int8 weights, bfloat16 activations"
        if int8
        else "int4 weights, float32 activations"
        if int4
        else str(torch_dtype).removeprefix("torch."),
        torch_device,
        loaded.max_context,
        time.monotonic() - start,
    )
    return loaded


def load_model_shell(
    path: str | os.PathLike[str],
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    name: str | None = None,
) -> LoadedModel:
    """`path`'s tokenizer, config and generation config around a model without weights (its parameters on
    torch's meta device; its buffers, such as RoPE's frequencies, real): what the serving process of
    tensor-parallel workers needs, the weights being theirs; a worker fills in its shard's
    (`engine.model.shard_checkpoint.load_shard_weights`). `device` and `dtype` are those the model will run in.
    A vision-language model's shell is AutoModelForImageTextToText's, with its processor (the serving process
    expands a prompt's images with it)."""
    from accelerate import init_empty_weights
    from transformers import GenerationConfig

    path = Path(path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    quant = checkpoint_quantization(path, None)
    common = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    processor = None
    try:
        config = AutoConfig.from_pretrained(path, **common)
        auto_class, tokenizer, processor = _model_class(path, config, common)
        # a float shell: each worker makes its shard's quantized layers (shard_quantized.py)
        if quant is not None and hasattr(config, "quantization_config"):
            del config.quantization_config
        with init_empty_weights(include_buffers=False):
            model = auto_class.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"could not load the model in {path}: {exc}") from exc
    with contextlib.suppress(OSError):  # no generation_config.json: the config's own
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return _loaded(model, tokenizer, torch_device, torch_dtype, name or path.name, path, processor)


def _model_class(path: Path, config: Any, common: dict[str, bool]) -> tuple[Any, PreTrainedTokenizerBase, Any]:
    """The auto class that makes `path`'s model, its tokenizer and its processor: AutoModelForCausalLM and the
    tokenizer (no processor), or for a vision-language model AutoModelForImageTextToText and its processor (on the PIL
    image backend: models/vision.py), whose tokenizer is the model's."""
    if is_vision_config(config):
        processor = load_processor(path, config, common["trust_remote_code"])
        return AutoModelForImageTextToText, processor.tokenizer, processor
    return AutoModelForCausalLM, AutoTokenizer.from_pretrained(path, **common), None


def _loaded(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    dtype: torch.dtype,
    name: str,
    path: Path,
    processor: Any | None = None,
) -> LoadedModel:
    """The `LoadedModel` of `model` and `tokenizer` (which pads with its end-of-sequence token when it has
    no padding token); `processor`: a vision-language model's (its tokenizer is `tokenizer`)."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        max_context=_max_context(model, tokenizer),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        name=name,
        path=path,
        processor=processor,
    )


def _load_model(
    path: Path, dtype: torch.dtype, common: dict[str, bool], auto_class: Any = AutoModelForCausalLM
) -> PreTrainedModel:
    """`path`'s model by `auto_class` (AutoModelForCausalLM, or AutoModelForImageTextToText for a VLM)."""
    return sdpa_or_default(path, lambda **sdpa: auto_class.from_pretrained(path, dtype=dtype, **common, **sdpa))


_DUMMY_SEED = 20260526  # any fixed seed (not a test fixture's, so a dummy never equals a saved model)


def _dummy_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    common: dict[str, bool],
    auto_class: Any = AutoModelForCausalLM,
) -> PreTrainedModel:
    """The architecture of `path`'s config.json with random weights (transformers' own initialisation,
    seeded), built directly on `device` so an 8B shape needs no host copy."""
    # the same weights every time (as vLLM's dummy loader seeds its own), so two loads of one shape
    # (a server and its baseline, two executors) compute the same tokens; the caller's RNG is untouched
    devices = [device] if device.type == "cuda" else []
    remote = common["trust_remote_code"]

    def seeded(**sdpa: str) -> PreTrainedModel:  # (a fresh config each time: a failed attempt leaves "sdpa" in it)
        torch.manual_seed(_DUMMY_SEED)
        config = AutoConfig.from_pretrained(path, **common)
        return auto_class.from_config(config, dtype=dtype, trust_remote_code=remote, **sdpa)

    with torch.random.fork_rng(devices=devices), device:
        model = sdpa_or_default(path, seeded)
    logger.warning("load_format=dummy: %s has random weights; its output is noise", path)
    return model


def _warn_unquantized_experts(model: torch.nn.Module, dtype: str) -> None:
    """Say so when `dtype`'s quantization left a mixture of experts' weights (3-D tensors, most of such a model)
    as they were: it quantizes linear layers."""
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3 and p.is_floating_point())
    if experts:
        share = experts / sum(p.numel() for p in model.parameters())
        kept = str(next(p.dtype for p in model.parameters() if p.dim() == 3)).removeprefix("torch.")
        logger.warning(
            "dtype=%s: the experts' weights (%.0f%% of the model's) stay %s: lmiserve quantizes linear layers, not "
            "a mixture of experts",
            dtype,
            100 * share,
            kept,
        )


def _max_context(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    config = model.config.get_text_config()
    for attr in _CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < _SANE_MAX_CONTEXT:
        return value
    return DEFAULT_MAX_CONTEXT


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    sources = [getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id]
    if generation_config is None:
        sources.append(getattr(model.config, "eos_token_id", None))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
