"""A vision-language model's prompt: its images run through the model's processor into token ids and the
plain data the runner's image encoder takes (docs/engine.md, "Vision-language models").

`ImageCodec.encode` calls the processor as transformers' own examples do (``processor(text=[prompt],
images=[images])``): the prompt's image placeholders expanded to the image tokens the features replace,
and the family's tensors (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``,
...), kept as numpy arrays so a `NewRequest` stays plain, pickleable data. `ImageInputs.spans` says where
each image's tokens lie in the prompt and carries the image's digest: the prefix cache keys the blocks
those tokens fall in by it (engine/core/kv_blocks.py), and a model whose image tokens attend to each
other both ways (Gemma 3) has its spans `atomic`: the scheduler never ends a chunk inside one.

The codec is its processor's registered encoder (`core.image_prompt.encoder`): a protocol counts a
prompt's tokens with it, and its output is kept for the request (`core.tokenizer.remember`), so the
processor runs once a request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmiserve.core import image_prompt
from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import Image
from lmiserve.core.tokenizer import recall, remember

__all__ = ["ImageCodec", "ImageInputs", "ImageSpan", "PromptIds", "probe_prompt", "span_digests"]

_RECENT = 8  # prompts with images whose processing `ImageCodec` keeps (beside each request's own)
# processor outputs that are not the image encoder's (the ids are the prompt's; masks are the runner's)
_NOT_IMAGE_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class ImageSpan:
    """Image tokens ``offset .. offset + length - 1`` of a prompt (text tokens between them included, as
    Idefics3's tile markers), and the digest of the image(s) they stand for."""

    offset: int
    length: int
    digest: str

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """A prompt's images as the runner's side needs them, plain data: the processor's tensors for the
    image encoder (numpy), the id of the token the features replace, and the spans of the images' tokens.
    `atomic`: the model's image tokens attend to each other both ways (Gemma 3), so a chunk never ends
    inside a span."""

    tensors: dict[str, np.ndarray]
    image_token_id: int
    spans: tuple[ImageSpan, ...]
    atomic: bool = False
    digests: tuple[str, ...] = field(default_factory=tuple)  # the images', in prompt order


class PromptIds(list[int]):
    """A prompt's token ids that carry its images (`images`): what `PromptCodec.encode` returns for a
    request with images, so the ids and the images travel together to the request's sequences."""

    images: ImageInputs | None = None


def span_digests(spans: Sequence[ImageSpan] | None, start: int, end: int) -> list[str]:
    """The digests of the spans that overlap tokens ``start .. end - 1`` (a block's), in order."""
    if not spans:
        return []
    return [s.digest for s in spans if s.offset < end and s.end > start]


class ImageCodec:
    """A VLM's processor, called on the tokenizer thread (it tokenizes the prompt too)."""

    def __init__(self, processor: Any, image_token_id: int, *, atomic: bool = False) -> None:
        self.processor = processor
        self.image_token_id = int(image_token_id)
        self.atomic = atomic
        tokenizer = getattr(processor, "tokenizer", None)
        # the image token the processor expands, one an image (not `core.image_prompt.placeholder`, the
        # chat template's text for an image: Qwen2-VL's wraps this token in its vision start and end,
        # LLaVA-NeXT's adds a newline; a raw prompt may hold the bare token)
        placeholder = getattr(processor, "image_token", None) or getattr(tokenizer, "image_token", None)
        self.placeholder: str | None = placeholder
        # Gemma 3's template writes its begin-of-image marker, which the processor expands
        self.boi: str | None = getattr(processor, "boi_token", None)
        # the last few prompts processed, whichever request (each request also keeps its own: a protocol
        # counts its prompt, then the engine's `prepare` and `generate` encode it)
        self._recent: OrderedDict[tuple[str, tuple[str, ...]], PromptIds] = OrderedDict()
        image_prompt.register_encoder(processor, self.encode)

    def placeholders(self, prompt: str) -> int | None:
        """How many images `prompt` has room for (None: unknown)."""
        marker = self.boi or self.placeholder
        return prompt.count(marker) if marker else None

    def encode(self, prompt: str, images: Sequence[Image]) -> PromptIds:
        """The prompt's ids with its images' tokens expanded, carrying its `ImageInputs`;
        `InvalidRequest` when the images do not match the prompt's placeholders. What this request
        encoded already (its protocol's count, `prepare`), or one of the last few prompts, is not
        processed again."""
        key = (prompt, tuple(image.digest for image in images))
        recent = recall(self.processor, ("images", key))
        if not isinstance(recent, PromptIds):
            recent = self._recent.get(key)
            if recent is None:
                recent = self._recent[key] = self._process(prompt, images)
                while len(self._recent) > _RECENT:
                    self._recent.popitem(last=False)
            remember(self.processor, ("images", key), recent)
        prompt_ids = PromptIds(recent)
        prompt_ids.images = recent.images
        return prompt_ids

    def _process(self, prompt: str, images: Sequence[Image]) -> PromptIds:
        wanted = self.placeholders(prompt)
        if wanted is not None and wanted != len(images):
            raise InvalidRequest(
                f"the prompt has {wanted} image placeholder(s) for {len(images)} image(s): each image needs one"
            )
        try:
            out = self.processor(text=[prompt], images=[[image.pixels for image in images]], return_tensors="np")
        except (ValueError, TypeError, IndexError) as exc:
            raise InvalidRequest(f"the images do not fit the prompt: {str(exc)[:300]}") from None
        ids = [int(i) for i in np.asarray(out["input_ids"])[0]]
        tensors = {k: np.asarray(v) for k, v in out.items() if k not in _NOT_IMAGE_INPUTS and v is not None}
        digests = tuple(image.digest for image in images)
        prompt_ids = PromptIds(ids)
        prompt_ids.images = ImageInputs(tensors, self.image_token_id, self._spans(ids, digests), self.atomic, digests)
        return prompt_ids

    def _spans(self, ids: list[int], digests: tuple[str, ...]) -> tuple[ImageSpan, ...]:
        """One span an image where its tokens make one run each; else (tiles of an image split by text
        markers) one span from the first image token to the last, keyed by every image's digest."""
        runs: list[list[int]] = []
        for position, token in enumerate(ids):
            if token != self.image_token_id:
                continue
            if runs and runs[-1][1] == position:
                runs[-1][1] = position + 1
            else:
                runs.append([position, position + 1])
        if not runs:
            if digests:
                raise InvalidRequest("the prompt has no image tokens for its images")
            return ()
        if len(runs) == len(digests):
            return tuple(ImageSpan(a, b - a, d) for (a, b), d in zip(runs, digests))
        return (ImageSpan(runs[0][0], runs[-1][1] - runs[0][0], "+".join(digests)),)


# the side of the image a VLM's memory profile runs its encoder on (the processor resizes it as it does a client's)
PROBE_SIDE = 1024


def probe_prompt(codec: ImageCodec, side: int = PROBE_SIDE) -> PromptIds | None:
    """A prompt holding one `side` x `side` image, as a client's would reach the runner: what the engine's
    memory profile runs, so the image encoder's activations and features are in the measured peak
    (None: the processor did not take it)."""
    from PIL import Image as PILImage

    marker = codec.boi or codec.placeholder
    if not marker:
        return None
    image = Image(PILImage.new("RGB", (side, side), (128, 128, 128)), digest="memory-profile")
    try:
        return codec.encode(f"{marker}Describe the image.", [image])
    except InvalidRequest:
        return None


def chunk_length(images: ImageInputs | None, start: int, want: int) -> int:
    """A prompt chunk's length from `start`, `want` tokens asked: for `atomic` spans (image tokens that
    attend to each other both ways) the chunk ends before the span it would end inside, or, starting
    inside or at it, at its end (past `want`: a span is never split)."""
    if images is None or not images.atomic:
        return want
    end = start + want
    for span in images.spans:
        if span.offset < end < span.end:
            return span.offset - start if span.offset > start else span.end - start
    return want
