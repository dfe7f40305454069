"""`dtype=int4`: the model's linear layers as 4-bit (and 8-bit) group codes, from a GGUF file's own
codes where the model came from one (issue #41), else quantized from its float weights.

From a GGUF file (`gguf_codes.gguf_quant_forms`): every layer linear whose tensor is Q4_0, Q4_1 or Q4_K
becomes an `Int4Linear` of the file's codes, scales and minimums as they are; Q8_0 and Q6_K (the 6-bit
tensors of a Q4_K_M file: attn_v and half the ffn_down) become a `Q8Linear` of the file's codes, so no
weight is re-quantized: the product computes with what the file holds. The output projection: the
file's `output` tensor, or its token embedding when the two are tied (SmolLM2's Q8_0), as a `Q8Linear`
(Q8_0, Q6_K) or `Int4Linear` (Q4_*); the input embedding keeps the converted floats (it is a gather).

Everything else, and every linear of a model that did not come from a GGUF file, is quantized from its
float weights: layer linears to `Int4Linear` (Q4_1's rule), the output projection to `Q8Linear`
(Q8_0's rule, what llama.cpp's quantizer keeps for it at 8 bits or 6): the vocabulary matrix is the
largest product of a decode step (SmolLM2-135M: 113 MB in fp32, 30 MB as 8-bit codes, 2.5 times the
time of all the layers' int4 products in fp32).

`load_int4_from_codes` builds such a model without the fp32 copy of the linears the file's codes replace
(a 7B Q4_K_M: 4 GB of codes, 28 GB of fp32 linears): the architecture on torch's meta device (its
non-persistent buffers, RoPE's frequencies, real), the linears made from the codes, and only the other
tensors (embeddings, norms, biases, linears without a form) read from the converted safetensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lmiserve.engine.model.quantize import (
    Int4Linear,
    Q8Linear,
    install_output_q8,
    quantize_linears_int4,
    quantize_output_q8,
)
from lmiserve.models.attention_choice import sdpa_or_default
from lmiserve.models.gguf_codes import Q4Form, Q8Form, QuantForm, gguf_quant_forms

logger = logging.getLogger(__name__)


def quantize_int4(
    model: torch.nn.Module,
    model_dir: Path,
    forms: Mapping[str, QuantForm] | None = None,
    fill: Callable[[torch.nn.Module], None] | None = None,
) -> str:
    """Replace `model`'s linears in place (see the module's docstring); a one-line account of what came
    from where, for the log. `forms`: the directory's GGUF forms if already read; `fill`: called once the
    file's codes replaced what they could, to give the remaining (meta) weights their values."""
    if forms is None:
        forms = gguf_quant_forms(model_dir) or {}
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    from_file: Counter[str] = Counter()
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module is output:
            continue
        replacement = _from_form(forms.get(f"{name}.weight"), module)
        if replacement is not None:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
            from_file[type(replacement).__name__] += 1
    head = _output_from_file(model, forms.get("lm_head.weight"), output)
    if fill is not None:
        fill(model)
    quantized = quantize_linears_int4(model)
    if head is None:
        head = "q8 (quantized)" if quantize_output_q8(model) else "float"
    parts = [f"{count} {kind} of the file's own codes" for kind, count in sorted(from_file.items())]
    parts.append(f"{quantized} quantized from float (groups of 32, scale and minimum)")
    return f"int4: {', '.join(parts)}; output projection {head}; the rest fp32"


def _from_form(form: Q4Form | Q8Form | None, linear: torch.nn.Linear) -> torch.nn.Module | None:
    """The file's codes as a linear of the same shape, or None (quantized from float instead)."""
    if form is None or tuple(form.codes.shape) != tuple(linear.weight.shape):
        return None
    bias = None if linear.bias is None else linear.bias.detach().float()
    if isinstance(form, Q4Form):
        return Int4Linear.from_codes(form.codes, form.scale, form.min, bias)
    if form.min is None and bias is None:
        return Q8Linear.from_codes(form.codes, form.scale)
    return None  # Q5_1/Q5_K (codes with a minimum), or a biased 8-bit linear: quantized from float


def _output_from_file(model: torch.nn.Module, form: Q4Form | Q8Form | None, output: object) -> str | None:
    """Make the file's output tensor `model`'s output projection; a description, or None if it cannot."""
    if form is None or type(output) is not torch.nn.Linear or output.bias is not None:
        return None
    if tuple(form.codes.shape) != tuple(output.weight.shape):
        return None
    if isinstance(form, Q8Form) and form.min is None:
        install_output_q8(model, form.codes, form.scale)
        return f"{form.qtype} of the file's own codes"
    if isinstance(form, Q4Form):
        config = getattr(model, "config", None)
        if config is not None:
            config.tie_word_embeddings = False
        model.set_output_embeddings(Int4Linear.from_codes(form.codes, form.scale, form.min))
        return f"{form.qtype} of the file's own codes"
    return None


def load_int4_from_codes(path: Path, trust_remote_code: bool = False) -> tuple[torch.nn.Module, str] | None:
    """The int4 model of the converted GGUF directory `path` and `quantize_int4`'s account, built without
    the fp32 weights of the linears the file's codes replace; None (load it in fp32, then `quantize_int4`)
    for a directory without forms or whose safetensors lack a tensor the model needs."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    forms = gguf_quant_forms(path)
    stored = safetensors_names(path)
    if forms is None or stored is None:
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    with init_empty_weights(include_buffers=False):  # buffers (RoPE's inv_freq) are computed, real
        model = sdpa_or_default(
            path, lambda **sdpa: AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, trust_remote_code=trust_remote_code, **sdpa
            )
        )  # fmt: skip
    model.tie_weights()  # as from_pretrained does (transformers 5's from_config leaves them apart)
    missing = [name for name, _ in meta_tensors(model) if name not in stored]
    if missing:
        logger.warning("int4: %s lacks %s; loading its fp32 weights first", path, ", ".join(missing[:5]))
        return None
    with contextlib.suppress(OSError):  # no generation_config.json: the config's own
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    model.config.name_or_path = str(path)
    with SafetensorsFiles(stored) as files:
        files.fill(model, keep_linear_weights=True)  # biases, norms, embeddings
        summary = quantize_int4(model, path, forms, fill=files.fill)
    left = [name for name, _ in meta_tensors(model)]
    if left:
        raise ValueError(f"int4: {', '.join(left[:5])} left without values")
    return model, summary


def meta_tensors(model: torch.nn.Module, keep_linear_weights: bool = False) -> list[tuple[str, torch.Tensor]]:
    """`model`'s parameters and buffers on the meta device, by first name (tied ones once); with
    `keep_linear_weights`, not the weights held only by plain linears (the codes may replace them)."""
    holders: dict[int, list[tuple[torch.nn.Module, str, torch.Tensor]]] = {}
    for name, module in model.named_modules():
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None and tensor.is_meta:
                holders.setdefault(id(tensor), []).append((module, f"{name}.{key}" if name else key, tensor))
    found = []
    for entries in holders.values():
        linear_only = all(type(m) is torch.nn.Linear and n.endswith(".weight") for m, n, _ in entries)
        if not (keep_linear_weights and linear_only):
            found.append(entries[0][1:])
    return found


def safetensors_names(path: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file of `path` that holds it; None without safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


class SafetensorsFiles(contextlib.ExitStack):
    """The directory's safetensors, opened once each, filling a meta model's tensors by name."""

    def __init__(self, stored: dict[str, Path], names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.stored = stored
        self.names = names or {}  # a tensor's name in `stored` -> its name in its file (absent: the same)
        self.handles: dict[Path, Any] = {}

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(self.names.get(name, name))

    def slice(self, name: str) -> Any:
        """The stored tensor `name` as a safetensors slice (only what is indexed is read)."""
        return self._handle(name).get_slice(self.names.get(name, name))

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.stored[name]
        if file not in self.handles:
            self.handles[file] = self.enter_context(safe_open(file, framework="pt"))
        return self.handles[file]

    def fill(self, model: torch.nn.Module, keep_linear_weights: bool = False) -> None:
        """Give `model`'s meta tensors (all, or all but plain linears' weights) the stored values, tied
        ones (an input and output embedding) staying one tensor."""
        replaced: dict[int, torch.Tensor] = {}
        for name, meta in meta_tensors(model, keep_linear_weights):
            value = self.tensor(name).to(meta.dtype)
            if isinstance(meta, torch.nn.Parameter):
                value = torch.nn.Parameter(value, requires_grad=meta.requires_grad)
            replaced[id(meta)] = value
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None and id(tensor) in replaced:
                        table[key] = replaced[id(tensor)]  # type: ignore[assignment]
