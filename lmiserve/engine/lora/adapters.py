"""LoRA adapters on one base model: read from PEFT's files, applied per row inside one batch.

An adapter is PEFT's folder (`adapter_config.json` and `adapter_model.safetensors`): for each target
linear of the base model a pair ``A [r, in]``, ``B [out, r]`` whose product, times ``alpha / r``
(``alpha / sqrt(r)`` with rsLoRA), is added to the linear's output: ``y = W x + s B (A x)``.
`read_adapter` checks an adapter against the served model (every target module exists and is a linear,
every shape fits, the rank is at most `max_lora_rank`, nothing PEFT can write that lmiserve would ignore:
DoRA, trained biases, `modules_to_save`, embedding targets) and keeps ``A`` and ``s B`` in the
model's dtype. Nothing is merged into the base weights: rows of several adapters, and rows of none,
share one step.

A step's products are batched by adapter (engine/lora/batch.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.engine.core.step import AdapterRef
from lmiserve.engine.model.checkpoint_names import renamer
from lmiserve.engine.model.language_model import language_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ATTENTION_MODULES",
    "FAST_PATH_MODULES",
    "AdapterError",
    "LoraAdapter",
    "linear_shape",
    "read_adapter",
    "read_config",
]

log = logging.getLogger(__name__)

# the linears lmiserve's own Llama-family forward applies adapters to (engine/model/fast_llama.py; Phi-3's
# q/k/v and gate/up are one linear each; Starcoder2's MLP is c_fc and c_proj)
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")  # (all it adapts of a mixture of experts)
FAST_PATH_MODULES = (
    *ATTENTION_MODULES,
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "c_fc",
    "c_proj",
)
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B)(?:\.[^.]+)?\.weight$")
_ids = itertools.count(1)


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why (a 400)."""


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter: for each target module (its path in the base model) ``A [r, in]`` and the
    scaled ``B [out, r]``, in the model's dtype on its device. `id` is new at every load (the prefix
    cache keys blocks by it, so an adapter loaded again from other files never shares KV)."""

    name: str
    path: Path
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int  # the largest rank of its modules
    alpha: float
    base_model: str | None
    load_seconds: float
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def target_modules(self) -> list[str]:
        """The short names of the linears it adapts (``q_proj``, ...), sorted."""
        return sorted({path.rsplit(".", 1)[-1] for path in self.modules})

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())

    @property
    def ref(self) -> AdapterRef:
        """This load as the step contract names it (engine/core/step.py): the runner's side reads it by itself."""
        return AdapterRef(self.name, self.id, str(self.path))


def linear_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear (torch's, lmiserve's int8/int4, GPT-2's Conv1D); None otherwise. A tensor-parallel
    rank's quantized linear says the whole linear's (`lora_shape`), as a cut float linear's features do."""
    if isinstance(module, torch.nn.Embedding):
        return None
    whole = getattr(module, "lora_shape", None)
    if isinstance(whole, tuple):
        return whole
    fan_in, fan_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(fan_in, int) and isinstance(fan_out, int):
        return fan_in, fan_out
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])  # Conv1D keeps [in, out]
    return None


def lora_out_features(module: torch.nn.Module) -> int:
    """The output width of a linear an adapter targets (checked by `read_adapter`)."""
    shape = linear_shape(module)
    if shape is None:
        raise ValueError(f"{type(module).__name__} is not a linear layer")
    return shape[1]


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `rank_pattern`/`alpha_pattern` lookup: the first pattern that matches the module's path
    at a name boundary."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def read_config(folder: Path) -> dict[str, Any]:
    """`folder`'s `adapter_config.json`, checked to describe a LoRA adapter lmiserve serves (AdapterError)."""
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    if not file.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} of {folder.name} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} of {folder.name} is not a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"adapter {folder.name} is a {kind} adapter; only LoRA adapters are served")
    refused = [
        (config.get("use_dora"), "uses DoRA (use_dora)"),
        (config.get("bias", "none") not in ("none", None), f"trains biases (bias={config.get('bias')!r})"),
        (config.get("modules_to_save"), f"saves whole modules ({config.get('modules_to_save')})"),
        (config.get("layer_replication"), "replicates layers (layer_replication)"),
        (config.get("use_qalora"), "uses QALoRA"),
    ]
    for present, why in refused:
        if present:
            raise AdapterError(f"adapter {folder.name} {why}, which lmiserve does not serve")
    return config


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            loaded = torch.load(str(file), map_location="cpu", weights_only=True)  # no pickled code runs
        except Exception as exc:  # noqa: BLE001 - a damaged file is the adapter's fault: a 400
            raise AdapterError(f"{name} of {folder.name} cannot be read: {type(exc).__name__}: {exc}") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise AdapterError(f"{name} of {folder.name} is not a dictionary of tensors")
        return loaded
    raise AdapterError(f"{folder} has no {' or '.join(WEIGHT_FILES)}")


def read_adapter(
    folder: Path,
    model: PreTrainedModel,
    *,
    name: str,
    max_rank: int,
    modules: Sequence[str] | None = None,
) -> LoraAdapter:
    """The LoRA adapter in `folder`, checked against `model`; `modules`: the short names of the linears
    the serving path applies adapters to (None: any linear). A module path the model does not have is looked for
    under the name transformers gives it on load (an adapter saved under an older transformers' names: LLaVA's
    ``language_model.model.layers.``). A vision-language model's adapter adapts its decoder alone (its vision tower
    runs once a request, at admission, without adapters). AdapterError says what does not fit."""
    started = time.perf_counter()
    config = read_config(folder)
    tensors = _read_weights(folder)
    rename = renamer(model)
    decoder = getattr(language_model(model), "decoder_path", None) if is_vision(model) else None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stripped = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        if ".lora_embedding_" in stripped or ".lora_magnitude_vector" in stripped:
            raise AdapterError(f"adapter {name} adapts {stripped.split('.lora_')[0]} in a way lmiserve does not serve")
        if stripped.endswith(".base_layer.weight"):
            raise AdapterError(
                f"adapter {name} holds base weights of {stripped.removesuffix('.base_layer.weight')} (PEFT saves "
                "them for a tied output layer): lmiserve serves adapters of LoRA matrices only"
            )
        match = _KEY.match(stripped)
        if match is None:
            raise AdapterError(f"adapter {name} holds tensor {key!r}, which is not a LoRA A or B matrix")
        target = _module_path(model, match["module"], rename)
        if decoder is not None and not target.startswith(f"{decoder}."):
            raise AdapterError(
                f"adapter {name} adapts {target}, outside the vision-language model's decoder ({decoder}): lmiserve "
                "serves adapters of a VLM's decoder"
            )
        pairs.setdefault(target, {})[match["part"]] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name} holds no LoRA weights")
    dtype = _activation_dtype(model)
    device = model.device
    base = config.get("base_model_name_or_path")
    made_for = f" (it was made for {base})" if base else ""
    alpha_default = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora"))
    loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for path, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name} has lora_{'A' if 'B' in pair else 'B'} of {path} without its pair")
        short = path.rsplit(".", 1)[-1]
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise AdapterError(f"adapter {name} targets {path}, which this model does not have{made_for}") from None
        shape = linear_shape(module)
        if shape is None:
            raise AdapterError(f"adapter {name} targets {path}, which is not a linear layer")
        if modules is not None and short not in modules:
            raise AdapterError(
                f"adapter {name} targets {short}; adapters on this model may target {', '.join(modules)}"
            )
        a, b = pair["A"], pair["B"]
        r = int(a.shape[0]) if a.dim() == 2 else -1
        fan_in, fan_out = shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or tuple(b.shape) != (fan_out, r):
            raise AdapterError(
                f"adapter {name} does not fit this model{made_for}: {path} is {fan_in} -> {fan_out}, its "
                f"LoRA matrices are {list(a.shape)} and {list(b.shape)}"
            )
        if r > max_rank:
            raise AdapterError(f"adapter {name} has rank {r} (at {short}), above max_lora_rank {max_rank}")
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, path, alpha_default))
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        loaded[path] = (
            a.to(device=device, dtype=dtype).contiguous(),
            (b.to(torch.float32) * scale).to(device=device, dtype=dtype).contiguous(),
        )
        rank = max(rank, r)
    return LoraAdapter(
        name=name,
        path=folder,
        modules=loaded,
        rank=rank,
        alpha=alpha_default,
        base_model=str(base) if base else None,
        load_seconds=time.perf_counter() - started,
    )


def _module_path(model: torch.nn.Module, path: str, rename: Callable[[str], str]) -> str:
    """`path` if `model` has that module, else the path transformers' renamings make of it (`rename`)."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return rename(f"{path}.weight").removesuffix(".weight")
    return path


def is_vision(model: torch.nn.Module) -> bool:
    """Whether `model` is a vision-language model (its config names a vision tower)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def _activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's activations (its embedding's; an int8/int4 model keeps float ones)."""
    getter = getattr(model, "get_input_embeddings", None)
    embed = getter() if callable(getter) else None
    weight = getattr(embed, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return next(p.dtype for p in model.parameters() if p.is_floating_point())
