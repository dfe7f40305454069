"""The causal LM as a `TensorModel`: a BYTES tensor of prompts in, a BYTES tensor of completions out.

The one input `text_input` holds the prompts, one per element; an input of any other name is refused
(400 naming it, as Triton does). Generation parameters come from `TensorRequest.parameters` with the LMI names
and defaults (`max_new_tokens`, `temperature`, `do_sample`, `stop`, ...), validated by the LMI parser.
All rows go to the engine at once, so they share its continuous batch. The output `text_output` holds
each row's generated text (with the prompt in front when `return_full_text` is true). The `adapter_id`
parameter picks a LoRA adapter of the model for every row (404 for one that is not served).

A vision-language model also takes the optional input `image` (BYTES): one image per prompt, or any
number for a single prompt; each element base64, a data: or http(s) URL, or the file's bytes. A prompt
holding the model's image placeholder (``<image>``, ...) keeps it; one without gets one placeholder per
image first (`lmiserve.core.image_prompt.raw_prompt`). A text model answers an `image` input with a 400
naming the model.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Coroutine, Mapping
from contextlib import aclosing
from typing import Any, TypeVar

import numpy as np

from lmiserve.core.adapters import Source, select_adapter
from lmiserve.core.engine import TextGenerator
from lmiserve.core.errors import GenerationFailed, InvalidRequest
from lmiserve.core.events import FinishReason
from lmiserve.core.image_prompt import raw_prompt
from lmiserve.core.media import Image, ImageSource, MediaLimits
from lmiserve.core.parameters import Limits, parse_parameters, to_sampling
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.tensor_io import bytes_column, model_input, select_outputs, text_rows
from lmiserve.core.tensors import ModelSignature, TensorRequest, TensorSpec
from lmiserve.media import load_images

INPUT = "text_input"
OUTPUT = "text_output"
IMAGE = "image"  # a vision-language model's images (BYTES: base64, a data: or http(s) URL, or the file)
SIGNATURE = ModelSignature(
    inputs=(TensorSpec(INPUT, "BYTES", (-1,)),),
    outputs=(TensorSpec(OUTPUT, "BYTES", (-1,)),),
)
VISION_SIGNATURE = ModelSignature(
    inputs=(TensorSpec(INPUT, "BYTES", (-1,)), TensorSpec(IMAGE, "BYTES", (-1,), optional=True)),
    outputs=SIGNATURE.outputs,
)
# Keys protocols put next to generation parameters; not generation parameters themselves.
NOT_GENERATION = frozenset({"content_type", "headers", "binary_data_output", "stream", "signature_name"})

_T = TypeVar("_T")


class LlmTensorModel:
    """The `TensorModel` of a text generator (the LLM's AsyncEngine)."""

    kind: str = "llm"
    signature: ModelSignature = SIGNATURE

    def __init__(
        self,
        engine: TextGenerator,
        limits: Limits,
        name: str = "",
        *,
        processor: Any = None,
        media: MediaLimits | None = None,
    ) -> None:
        """`processor`: a vision-language model's (its signature then has the optional `image` input);
        `media`: the server's limits on images."""
        self.engine = engine
        self.limits = limits
        self.name = name
        self.processor = processor
        self.media = media if media is not None else MediaLimits()
        if processor is not None:
            self.signature = VISION_SIGNATURE

    def sampling(self, parameters: Mapping[str, Any] | None) -> tuple[SamplingParams, bool]:
        """LMI parameter mapping of the request's parameters; also whether to prepend the prompt."""
        raw = {k: v for k, v in (parameters or {}).items() if k not in NOT_GENERATION}
        params = parse_parameters(raw)
        return to_sampling(params, self.limits, stream=False), bool(params.return_full_text)

    def adapter(self, parameters: Mapping[str, Any] | None) -> str | None:
        """The LoRA adapter the `adapter_id` parameter names (None: the base model, also for this model's
        own name); `AdapterNotFound` (the protocol's 404) for one that is not served."""
        source = Source("adapter_id", (parameters or {}).get("adapter_id"))
        return select_adapter([source], getattr(self.engine, "adapters", None), (self.name,))

    async def images(self, array: Any, rows: int) -> list[tuple[Image, ...]]:
        """The images of `rows` prompts from an `image` input's elements (None: none): one per prompt, or
        any number for one prompt; each prompt's loaded under the media limits (400 for a model without
        vision, a bad image, too many)."""
        if array is None:
            return [()] * rows
        self.check_vision()
        values = list(np.asarray(array, dtype=object).reshape(-1))
        if not values:
            return [()] * rows
        if len(values) == rows:
            groups = [[value] for value in values]
        elif rows == 1:
            groups = [values]
        else:
            raise InvalidRequest(
                f"input '{IMAGE}' holds {len(values)} images for {rows} prompts: give one image per prompt, or "
                "any number of images with one prompt"
            )
        loads = [load_images(tuple(image_source(v) for v in group), self.media) for group in groups]
        return await _all_or_nothing(loads)

    def check_vision(self) -> None:
        """400 naming the model when it takes no images."""
        if self.processor is None:
            raise InvalidRequest(
                f"The model '{self.name}' does not take images (it is not a vision-language model): "
                f"input '{IMAGE}' is not accepted"
            )

    def prompt(self, text: str, images: tuple[Image, ...]) -> str:
        """A raw prompt with its images in place (`raw_prompt`: its own placeholders, else one per image first)."""
        return raw_prompt(text, len(images), self.processor)

    async def infer(self, request: TensorRequest) -> dict[str, np.ndarray]:
        if IMAGE in request.inputs:
            self.check_vision()
        prompts = text_rows(model_input(request, self.signature, INPUT, self.name), INPUT)
        if any(not p for p in prompts):
            raise InvalidRequest(f"input '{INPUT}' holds an empty prompt")
        sampling, full_text = self.sampling(request.parameters)
        adapter = self.adapter(request.parameters)
        groups = await self.images(request.inputs.get(IMAGE), len(prompts))
        requests = [  # immutable: one `sampling` shared
            GenerationRequest(self.prompt(p, g), sampling, adapter=adapter, images=g) for p, g in zip(prompts, groups)
        ]
        texts = await _all_or_nothing([self._complete(r) for r in requests])
        if full_text:
            texts = [p + t for p, t in zip(prompts, texts)]
        return select_outputs({OUTPUT: bytes_column(texts)}, request, self.signature)

    async def _complete(self, request: GenerationRequest) -> str:
        """The first sequence's generated text; its error as GenerationFailed."""
        async with aclosing(self.engine.generate(request)) as events:
            async for event in events:
                if event.finish is not None and event.index == 0:
                    if event.finish.reason == FinishReason.ERROR:
                        raise GenerationFailed(event.finish.error or "generation failed")
                    return event.finish.generated_text
        raise GenerationFailed("the generation ended without a final event")


def image_source(value: Any) -> ImageSource:
    """One element of an `image` input: a data: or http(s) URL, base64 text, or the image file's bytes."""
    text = value if isinstance(value, str) else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            return ImageSource(data=raw)  # the file itself (KServe's binary tensor data)
    if text is None:
        raise InvalidRequest(f"input '{IMAGE}' must hold images as BYTES (base64, a URL or the file)")
    text = text.strip()
    if not text:
        raise InvalidRequest(f"input '{IMAGE}' holds an empty element")
    if re.match(r"(?i)^(data|https?):", text):
        return ImageSource(url=text)
    return ImageSource(url=f"data:image/*;base64,{text}")


async def _all_or_nothing(coros: list[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run concurrently; on the first failure cancel the rest (aborting their sequences) and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
