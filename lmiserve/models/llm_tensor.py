"""The causal LM as a `TensorModel`: a BYTES tensor of prompts in, a BYTES tensor of completions out.

The one input `text_input` holds the prompts, one per element; an input of any other name is refused
(400 naming it, as Triton does). Generation parameters come from `TensorRequest.parameters` with the LMI names
and defaults (`max_new_tokens`, `temperature`, `do_sample`, `stop`, ...), validated by the LMI parser.
All rows go to the engine at once, so they share its continuous batch. The output `text_output` holds
each row's generated text (with the prompt in front when `return_full_text` is true). The `adapter_id`
parameter picks a LoRA adapter of the model for every row (404 for one that is not served).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from contextlib import aclosing
from typing import Any, TypeVar

import numpy as np

from lmiserve.core.adapters import Source, select_adapter
from lmiserve.core.engine import TextGenerator
from lmiserve.core.errors import GenerationFailed, InvalidRequest
from lmiserve.core.events import FinishReason
from lmiserve.core.parameters import Limits, parse_parameters, to_sampling
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.tensor_io import bytes_column, model_input, select_outputs, text_rows
from lmiserve.core.tensors import ModelSignature, TensorRequest, TensorSpec

INPUT = "text_input"
OUTPUT = "text_output"
SIGNATURE = ModelSignature(
    inputs=(TensorSpec(INPUT, "BYTES", (-1,)),),
    outputs=(TensorSpec(OUTPUT, "BYTES", (-1,)),),
)
# Keys protocols put next to generation parameters; not generation parameters themselves.
NOT_GENERATION = frozenset({"content_type", "headers", "binary_data_output", "stream", "signature_name"})

_T = TypeVar("_T")


class LlmTensorModel:
    """The `TensorModel` of a text generator (the LLM's AsyncEngine)."""

    kind: str = "llm"
    signature: ModelSignature = SIGNATURE

    def __init__(self, engine: TextGenerator, limits: Limits, name: str = "") -> None:
        self.engine = engine
        self.limits = limits
        self.name = name

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

    async def infer(self, request: TensorRequest) -> dict[str, np.ndarray]:
        prompts = text_rows(model_input(request, self.signature, INPUT, self.name), INPUT)
        if any(not p for p in prompts):
            raise InvalidRequest(f"input '{INPUT}' holds an empty prompt")
        sampling, full_text = self.sampling(request.parameters)
        adapter = self.adapter(request.parameters)
        requests = [GenerationRequest(p, sampling, adapter=adapter) for p in prompts]  # immutable: shared
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
