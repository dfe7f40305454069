"""A vision-language model's decoder and output projection seen as a causal LM, so that lmiserve's own forward
(engine/model/fast_llama.py) runs a VLM's language model: what that forward reads of a model is `model` (the
decoder: ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``), `lm_head`, `config` (here the text config),
`device` and `dtype`. The view holds the VLM's own modules: no weight is copied.

LLaVA, LLaVA-NeXT, Mistral 3, Gemma 3 and the Qwen VLs keep their decoder as ``model.language_model``, Idefics3 as
``model.text_model``; each has its ``lm_head`` on the VLM itself."""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["LanguageModel", "language_model", "text_part"]

_VIEWS: weakref.WeakKeyDictionary[torch.nn.Module, LanguageModel] = weakref.WeakKeyDictionary()


class LanguageModel:
    """The decoder and head of a VLM, as a causal LM's attributes (`language_model` makes it)."""

    def __init__(
        self, decoder: torch.nn.Module, lm_head: torch.nn.Module, config: Any, vlm: torch.nn.Module, path: str
    ) -> None:
        self.model = decoder
        self.decoder_path = path  # the decoder's module path in the VLM (its adapters' modules are under it)
        self.lm_head = lm_head
        self.config = config
        self._vlm = weakref.ref(vlm)  # (weak: the views are kept by their VLM)
        # transformers' VLM forwards take the head's logits as they are: Gemma 3's text config may name a soft
        # cap that its Gemma3ForCausalLM applies and its Gemma3ForConditionalGeneration does not
        self.caps_logits = False

    @property
    def device(self) -> torch.device:
        """The VLM's device now (a tensor-parallel rank's shell is made on the meta device, then filled)."""
        device: torch.device = self._owner().device
        return device

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self._owner().dtype
        return dtype

    def _owner(self) -> Any:
        vlm = self._vlm()
        if vlm is None:
            raise RuntimeError("the vision-language model of this view is gone")
        return vlm

    def __repr__(self) -> str:
        return f"LanguageModel({type(self.model).__name__}, {self.config.model_type})"


def language_model(vlm: torch.nn.Module) -> LanguageModel | None:
    """`vlm`'s decoder and head seen as a causal LM (one view a model: its fused layers are made once, as a
    causal LM's are), None when it names neither."""
    view = _VIEWS.get(vlm)
    if view is not None:
        return view
    inner = getattr(vlm, "model", None)
    path = (
        "model.language_model"
        if isinstance(getattr(inner, "language_model", None), torch.nn.Module)
        else "model.text_model"
    )
    decoder = getattr(inner, path.rpartition(".")[2], None)
    head = getattr(vlm, "lm_head", None)
    get_text_config = getattr(getattr(vlm, "config", None), "get_text_config", None)
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module) or get_text_config is None:
        return None
    view = _VIEWS[vlm] = LanguageModel(decoder, head, get_text_config(), vlm, path)
    return view


def text_part(model: torch.nn.Module) -> torch.nn.Module:
    """What a quantization made at load (``quantize=fp8``, a dummy model's 4-bit codes) replaces the linears of: a
    vision-language model's decoder, its vision tower and projector kept float (as the quantized VLMs published keep
    them: they run once an image, and their shapes need not suit fp8's or 4-bit codes' kernels); else `model`."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return model
    view = language_model(model)
    if view is None:
        raise ValueError(f"the decoder of this vision-language model ({config.model_type}) is not found")
    return view.model
