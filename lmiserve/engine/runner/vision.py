"""A vision-language model over the block KV cache: transformers' forward of the VLM, its prompt's image
tokens fed the image encoder's features (docs/engine.md, "Vision-language models").

- **The encoder runs once per image, at admission.** A `NewRequest` carries its images as plain data
  (engine/text/images.py: the processor's tensors and the spans of the image tokens); the runner runs the
  family's own ``get_image_features`` on them (as the VLM's forward calls it) and keeps the features in
  the request's state, which a preemption leaves in place: the recompute takes the kept features.
- **Every step runs on embeddings**: the language model's embeddings of the step's tokens, the image
  features placed at the image-token positions the step covers (a chunk may begin or end inside an
  image), through the VLM's own forward with ``inputs_embeds`` (Qwen3-VL: its language model and head,
  which take the DeepStack features of the same positions, added there by integer positions found on the
  host: transformers' own step indexes by a boolean mask, which waits for the device).
- **M-RoPE** (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the prompt's 3-D positions come from the model's
  ``get_rope_index`` at admission; a generated token at position p takes p + the prompt's rope delta, as
  ``generate()`` does. The forward gets ``[4, 1, tokens]`` position ids (the 1-D positions first, as
  transformers' packed form); the KV blocks keep the 1-D positions.
- **Bidirectional image attention** (Gemma 3, where transformers' prefill lets an image's tokens see each
  other): the step's mask opens each image's block; such a step runs over the gathered blocks (not the
  kernel), and the scheduler never ends a chunk inside such an image (`ImageInputs.atomic`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmiserve.engine import host_copy
from lmiserve.engine.attention.backends import AttentionBackend
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.core.step import StepBatch, StepOutput
from lmiserve.engine.runner.generic import PagedGenericRunner, Span
from lmiserve.engine.runner.request_state import RequestState
from lmiserve.engine.text.images import ImageInputs, ImageSpan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

__all__ = ["ImageFeatures", "PagedVisionRunner", "bidirectional_images", "image_token_id", "is_vision_model"]


def is_vision_model(model: PreTrainedModel) -> bool:
    """Whether `model` is a vision-language model this runner serves (its base model encodes images)."""
    inner = getattr(model, "model", None)
    return callable(getattr(inner, "get_image_features", None)) and hasattr(model.config, "vision_config")


@dataclass
class ImageFeatures:
    """A request's image features as the runner keeps them (its state's `images`)."""

    rows: np.ndarray  # [prompt tokens] the feature row of each prompt position, -1 for a text token (host)
    features: torch.Tensor  # [image tokens, hidden], in prompt order
    deepstack: list[torch.Tensor] | None  # Qwen3-VL: a [image tokens, hidden] a DeepStack layer
    mrope: torch.Tensor | None  # [3, prompt tokens]: M-RoPE positions (None: the model has none)
    delta: int  # M-RoPE: a generated token's position offset (the prompt's rope delta)
    # M-RoPE: each prompt position's shift where its three positions agree (text: their position less its
    # own), `NO_SHIFT` where they do not (an image's tokens) (host; None: no M-RoPE)
    shifts: np.ndarray | None
    spans: tuple[ImageSpan, ...]  # the atomic spans (bidirectional attention), else none


NO_SHIFT = np.iinfo(np.int64).min  # `ImageFeatures.shifts` of a position whose three M-RoPE positions differ


def _named(function: Callable[..., Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `tensors` that `function` names among its parameters."""
    params = inspect.signature(function).parameters
    return {k: v for k, v in tensors.items() if k in params and params[k].kind is not inspect.Parameter.VAR_KEYWORD}


class PagedVisionRunner(PagedGenericRunner):
    """`PagedGenericRunner` for a vision-language model: image features at admission, embeddings a step."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int],
        num_blocks: int,
        block_size: int,
        alone: bool = False,
        kv_format: KvFormat | None = None,
        scratch_blocks: int = 0,
    ) -> None:
        self.inner: Any = model.model  # the VLM's base model: get_image_features, get_rope_index
        self.mrope = callable(getattr(self.inner, "get_rope_index", None))
        language: Any = getattr(self.inner, "language_model", None)
        self.deepstack = callable(getattr(language, "_deepstack_process", None))
        self._step: list[RequestState] = []  # the rows' requests of the forward running now
        self._deepstack_at: torch.Tensor | None = None  # the step's image positions (`_deepstack_add`)
        if self.deepstack:
            self._deepstack_mask = language._deepstack_process  # transformers' (by the boolean mask)
            language._deepstack_process = self._deepstack_add
        super().__init__(
            model,
            eos_token_ids=eos_token_ids,
            num_blocks=num_blocks,
            block_size=block_size,
            alone=alone,
            kv_format=kv_format,
            scratch_blocks=scratch_blocks,
        )

    # ---- admission: the image encoder, once per request --------------------------------------------
    def _images_of(self, seq_id: int, images: ImageInputs, state: RequestState, out: StepOutput) -> None:
        try:
            state.images = self._encode(state.prompt_ids, images)
        except Exception as exc:  # noqa: BLE001 - this request fails, the step goes on
            log.exception("encoding the images of a request failed")
            out.errors[seq_id] = f"the images could not be encoded: {exc}"

    def _encode(self, prompt_ids: list[int], images: ImageInputs) -> ImageFeatures:
        dev, dtype = self.device, self.model.dtype
        tensors = {  # copied without a wait; a float converted on the device
            k: host_copy.to_device(v, dev).to(dtype if v.dtype.kind == "f" else None) for k, v in images.tensors.items()
        }
        out = self.inner.get_image_features(**_named(self.inner.get_image_features, tensors), return_dict=True)
        features = _flat(out.pooler_output)
        # which prompt positions take which feature row: counted on the host, where the prompt is (a count on
        # the device would make the host wait for the encoder and all queued before it)
        is_image = np.asarray(prompt_ids) == images.image_token_id
        if int(is_image.sum()) != features.shape[0]:
            raise ValueError(f"{int(is_image.sum())} image tokens for {features.shape[0]} image features")
        rows = np.where(is_image, np.cumsum(is_image) - 1, -1)
        deepstack = getattr(out, "deepstack_features", None) if self.deepstack else None
        mrope, delta, shifts = None, 0, None
        if self.mrope:
            ids = host_copy.to_device(prompt_ids, dev)
            types = tensors.get("mm_token_type_ids")
            if types is None:
                types = host_copy.to_device(is_image.astype(np.int32)[None], dev)
            given = {**tensors, "mm_token_type_ids": types}
            positions, deltas = self.inner.get_rope_index(ids[None], **_named(self.inner.get_rope_index, given))
            mrope = positions[:, 0].to(dev)
            # the positions and the delta in one copy to the host (admission waits for it once)
            host = torch.cat([mrope.reshape(-1), deltas.reshape(-1)[:1].to(mrope)]).cpu().numpy()
            three, delta = host[:-1].reshape(3, -1), int(host[-1])
            text = (three[0] == three[1]) & (three[1] == three[2]) & ~is_image
            shifts = np.where(text, three[0] - np.arange(three.shape[1]), NO_SHIFT)
        return ImageFeatures(
            rows,
            features,
            [_flat(layer) for layer in deepstack] if deepstack else None,
            mrope,
            delta,
            shifts,
            images.spans if images.atomic else (),
        )

    # ---- each step: embeddings with the features in ------------------------------------------------
    def _forward_lora(
        self,
        batch: StepBatch,
        part: list[int],
        rows: list[tuple[list[int], int, list[int], int]],
        backend: AttentionBackend | None,
    ) -> torch.Tensor:
        self._step = [self._requests[batch.rows[i].seq_id] for i in part]
        try:
            if backend is not None and any(self._opens(s, r[1], len(r[2])) for s, r in zip(self._step, rows)):
                backend = None  # an image's tokens attend both ways: the gathered path's mask says so
            return super()._forward_lora(batch, part, rows, backend)
        finally:
            self._step = []

    @staticmethod
    def _opens(state: RequestState, start: int, count: int) -> bool:
        """Whether the row's tokens meet an image whose tokens attend to each other both ways."""
        return bool(opened_spans(state, start, count))

    def _model_inputs(self, ids: list[int], positions: list[int], spans: list[Span]) -> dict[str, Any]:
        if not self._step:  # the start-up probes: text
            return super()._model_inputs(ids, positions, spans)
        dev = self.device
        host_ids = np.array(ids, dtype=np.int64)
        found = self._image_rows(self._step, spans)
        index: torch.Tensor | None = None
        take_rows: list[tuple[ImageFeatures, torch.Tensor]] = []
        if found is not None:
            where, index, take_rows = found
            host_ids[where] = 0  # its embedding is replaced (an image token may lie outside the vocabulary)
        tokens = host_copy.to_device(host_ids, dev)
        embeds = self.model.get_input_embeddings()(tokens[None])
        inputs: dict[str, Any] = {"inputs_embeds": embeds}
        if index is not None:
            embeds[0, index] = torch.cat([f.features[r] for f, r in take_rows]).to(embeds.dtype)
        if self.deepstack:
            inputs["visual_pos_masks"] = None
            inputs["deepstack_visual_embeds"] = None
            self._deepstack_at = index
            if index is not None:
                mask = torch.zeros(1, len(ids), dtype=torch.bool, device=dev)
                mask[0, index] = True
                layers = len(take_rows[0][0].deepstack or [])
                inputs["visual_pos_masks"] = mask
                inputs["deepstack_visual_embeds"] = [
                    torch.cat([f.deepstack[layer][r] for f, r in take_rows if f.deepstack]).to(embeds.dtype)
                    for layer in range(layers)
                ]
        inputs["position_ids"] = self._positions(positions, spans)
        return inputs

    def _image_rows(
        self, states: list[RequestState], spans: list[Span]
    ) -> tuple[np.ndarray, torch.Tensor, list[tuple[ImageFeatures, torch.Tensor]]] | None:
        """The step's image-token indexes (row after row: the rows' `states` and `spans`), on the host and on the
        device, and each request's feature rows for them (on the device); None when the step has no image token.
        Found on the host (each request keeps its rows there): one copy to the device, not waited for."""
        at: list[np.ndarray] = []  # the step's image-token indexes, row after row
        take: list[tuple[ImageFeatures, np.ndarray]] = []  # and their feature rows
        for state, (first, count, start, _) in zip(states, spans):
            features = state.images
            if features is None:
                continue
            found = features.rows[start : start + count]
            hit = np.flatnonzero(found >= 0)
            if hit.size:
                at.append(first + hit)
                take.append((features, found[hit]))
        if not at:
            return None
        where = np.concatenate(at)
        both = host_copy.to_device(np.stack([where, np.concatenate([r for _, r in take])]), self.device)
        parts = torch.split(both[1], [len(r) for _, r in take])  # each request's part of the feature rows
        return where, both[0], [(f, part) for (f, _), part in zip(take, parts)]

    def _deepstack_add(
        self, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Qwen3-VL's DeepStack step (its language model's `_deepstack_process`: a layer's image features
        added at the image positions) at the step's image positions (`_deepstack_at`, found on the host, in
        the features' order), not by the mask: the same sums without the wait a boolean index makes."""
        index = self._deepstack_at
        if index is None:  # (not a step `_model_inputs` made)
            result: torch.Tensor = self._deepstack_mask(hidden_states, visual_pos_masks, visual_embeds)
            return result
        hidden_states = hidden_states.clone()
        hidden_states[0, index] = hidden_states[0, index] + visual_embeds.to(hidden_states.device, hidden_states.dtype)
        return hidden_states

    def _positions(self, positions: list[int], spans: list[Span]) -> torch.Tensor:
        """``[1, tokens]``; with M-RoPE ``[4, 1, tokens]``: the 1-D positions, then the three M-RoPE rows
        (an image prompt's from `get_rope_index`, past its prompt position + its delta; text: the 1-D)."""
        flat = host_copy.to_device(positions, self.device)
        if not self.mrope:
            return flat[None]
        three = flat[None].repeat(3, 1)
        for state, (first, count, start, _) in zip(self._step, spans):
            features = state.images
            if features is None or features.mrope is None:
                continue
            span = torch.arange(start, start + count, device=self.device)
            length = features.mrope.shape[1]
            inside = span < length
            three[:, first : first + count] = torch.where(
                inside, features.mrope[:, span.clamp(max=length - 1)], span + features.delta
            )
        return torch.cat([flat[None], three])[:, None, :]

    def _mask(self, spans: list[Span], tokens: int, keys: int) -> torch.Tensor | dict[str, torch.Tensor]:
        mask = super()._mask(spans, tokens, keys)
        if not self._step:
            return mask
        masks = list(mask.values()) if isinstance(mask, dict) else [mask]
        for state, (first, count, start, offset) in zip(self._step, spans):
            features = state.images
            for image in features.spans if features is not None else ():
                q0, q1 = max(image.offset, start), min(image.end, start + count)
                if q0 >= q1:
                    continue
                for m in masks:  # an image's tokens see each other (keys up to the chunk's end)
                    m[0, 0, first + q0 - start : first + q1 - start, offset + image.offset : offset + q1] = 0.0
        return mask

    def _logits(self, model_inputs: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        if not self.deepstack or "inputs_embeds" not in model_inputs:
            return super()._logits(model_inputs, **kwargs)
        # Qwen3-VL's forward makes its DeepStack inputs itself: its language model takes the step's
        hidden = self.inner.language_model(**model_inputs, **kwargs, use_cache=False).last_hidden_state
        logits: torch.Tensor = self.model.lm_head(hidden)[0]
        return logits


def opened_spans(state: RequestState, start: int, count: int) -> tuple[tuple[int, int], ...]:
    """The positions ``(first, end)`` among a row's (`start`, `count` tokens) of each image whose tokens see each
    other both ways (Gemma 3's; the scheduler never ends a chunk inside one)."""
    spans = state.images.spans if state.images is not None else ()
    return tuple(
        (max(s.offset, start), min(s.end, start + count)) for s in spans if s.offset < start + count and s.end > start
    )


def _flat(pooled: Any) -> torch.Tensor:
    """``[image tokens, hidden]`` from a ``get_image_features`` output (a tensor, or one a image)."""
    parts = list(pooled) if isinstance(pooled, (list, tuple)) else [pooled]
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])


def image_token_id(model: PreTrainedModel) -> int:
    """The id of the token a VLM's image features replace, whatever the family calls it."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(model.config).__name__} names no image token")


# families whose prefill lets an image's tokens attend to each other both ways (transformers' token_type_ids)
_BIDIRECTIONAL_IMAGES = ("gemma3",)


def bidirectional_images(model: PreTrainedModel) -> bool:
    """Whether `model`'s image tokens attend to each other both ways (a chunk must not split an image)."""
    return getattr(model.config, "model_type", None) in _BIDIRECTIONAL_IMAGES
