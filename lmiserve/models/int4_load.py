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
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from lmiserve.engine.model.quantize import (
    Int4Linear,
    Q8Linear,
    install_output_q8,
    quantize_linears_int4,
    quantize_output_q8,
)
from lmiserve.models.gguf_codes import Q4Form, Q8Form, gguf_quant_forms

logger = logging.getLogger(__name__)


def quantize_int4(model: torch.nn.Module, model_dir: Path) -> str:
    """Replace `model`'s linears in place (see the module's docstring); a one-line account of what came
    from where, for the log."""
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
    quantized = quantize_linears_int4(model)
    head = _output_from_file(model, forms.get("lm_head.weight"), output)
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
        model.set_output_embeddings(Int4Linear.from_codes(form.codes, form.scale, form.min))  # type: ignore[operator]
        return f"{form.qtype} of the file's own codes"
    return None
