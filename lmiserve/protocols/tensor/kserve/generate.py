"""Triton's generate extension for LLMs: `/v2/models/{m}/generate` answers one JSON object,
`/generate_stream` answers SSE `data:` events, one per generated piece of text.

Request `{"id"?, "text_input": str, "image"?: str | [str], "parameters"?: {...}, <other keys>}`: other
top-level keys join the parameters (`parameters` wins); `image` (a vision model's: base64, or a data: or
http(s) URL) is placed as the LLM's `image` input places it (lmiserve/models/llm_tensor.py).
Parameters by LMI's names (max_new_tokens, temperature, do_sample, stop, ...) or by the spellings of
Triton's TensorRT-LLM and vLLM backends (`TRITON_ALIASES`: max_tokens, random_seed, stop_words,
ignore_eos, min_length, min_tokens, exclude_input_in_output; `lora_name`, like `adapter_id`, picks a
LoRA adapter of the model: 404 for one that is not served); a parameter that /generate cannot honour
(`bad_words`, `end_id`, beam search, logprobs or logits outputs, more than one sequence, ...) or does
not know is a 400 naming it, never ignored.
Answer `{"id"?, "model_name", "model_version", "text_output"}` (the id only when the request had one).

Both go through the response pipeline. The stream's status waits for the engine's first event: a
failure before it (validation, a full queue, a queue timeout) is an ordinary JSON error; from then on a
failure is a last `data: {"error": msg}` event under 200. Only the first sequence (index 0) is answered.

The same settings reach the LLM through `infer` (REST `/v2/models/{m}/infer`, gRPC `ModelInfer` and
`ModelStreamInfer`): as `parameters`, or as input tensors beside `text_input`, as TensorRT-LLM ensembles
and litellm's Triton provider send them (`max_tokens` INT32, `temperature` FP32, `stop_words` BYTES,
...: `SETTING_INPUTS`); `infer_parameters` maps both spellings the way /generate does, refusing what it
cannot honour with a 400 naming the field. TensorRT-LLM's empty word lists (`bad_words: [""]`,
`stop_words: [""]`, what litellm sends) mean no words.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import (
    IncompleteGeneration,
    InvalidInput,
    InvalidRequest,
    LmiServeError,
    SchemaViolation,
)
from lmiserve.core.events import StepEvent
from lmiserve.core.media import Image
from lmiserve.core.parameters import GenerationParameters
from lmiserve.core.request import GenerationRequest
from lmiserve.core.tensor_io import text_rows
from lmiserve.models.llm_tensor import IMAGE, INPUT, NOT_GENERATION
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve.errors import RENDERER
from lmiserve.protocols.tensor.kserve.models import ready_model
from lmiserve.server import sse
from lmiserve.server.pipeline import Tagged, is_error_finish, respond, tagged

_OWN_KEYS = ("id", "text_input", "parameters", "model_name", IMAGE)
# Triton backends' spellings (TensorRT-LLM's inputs, vLLM's SamplingParams) -> LMI's names.
TRITON_ALIASES = {
    "max_tokens": "max_new_tokens",
    "random_seed": "seed",
    "stop_words": "stop",
    "ignore_eos": "ignore_eos_token",
    "min_length": "min_new_tokens",
    "min_tokens": "min_new_tokens",
    "lora_name": "adapter_id",  # vLLM backend's LoRA adapter
}
# Output switches of those backends: accepted when false, refused when true (the answer has only text).
OUTPUT_SWITCHES = (
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "return_logprobs",
    "return_cumulative_logprob",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_perf_metrics",
    "details",
    "decoder_input_details",
)
# Known parameters that /generate cannot honour, and why: refused unless they hold their no-op value.
UNSUPPORTED = {  # {route}: the route or RPC that answers (/generate, /infer, ModelInfer, ...)
    "bad_words": "bad-word filtering is not supported (no token is banned)",
    "end_id": "a custom end token is not supported; use 'stop_token_ids'",
    "pad_id": "a custom padding token is not supported",
    "beam_width": "beam search is not supported (beam_width 1 only)",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "top_n_tokens": "{route} answers text only; use /generate on the LMI or TGI routes for top tokens",
    "n": "{route} answers one sequence (n 1 only)",
    "best_of": "{route} answers one sequence (best_of 1 only)",
    "output_formatter": "{route} has its own answer shape (no output_formatter)",
}
_NO_OP = {"beam_width": (1,), "length_penalty": (1, 1.0), "n": (1, None), "best_of": (1,), "top_n_tokens": (0,)}
_KNOWN = frozenset(GenerationParameters.model_fields) | {"stream", "adapter_id"}
# Input tensors an LLM's infer request may carry beside text_input: every setting named above.
SETTING_INPUTS = (
    _KNOWN | TRITON_ALIASES.keys() | set(OUTPUT_SWITCHES) | UNSUPPORTED.keys() | {"exclude_input_in_output"}
) - {INPUT}
# Settings that hold a list: a tensor of them gives all its elements (any other setting tensor holds one).
LIST_SETTINGS = frozenset({"stop_words", "bad_words", "stop", "stop_sequences", "stop_token_ids"})
STREAM_TYPE = "text/event-stream; charset=utf-8"
STREAM_HEADERS = {"cache-control": "no-cache"}
# What an error finish without a message of its own says.
UNSPECIFIED_FAILURE = "generation failed"


@dataclass
class GenerateCall:
    svc: ModelService
    prompt: str
    request_id: str | None
    full_text: bool  # `return_full_text`: the prompt comes first
    request: GenerationRequest
    engine: Any  # the model's AsyncEngine

    def answer(self, text: str) -> dict:
        body = {"id": self.request_id} if self.request_id is not None else {}
        return {**body, "model_name": self.svc.name, "model_version": kserve.VERSION, "text_output": text}


async def parse(request: Request) -> GenerateCall:
    """The addressed LLM and the generation it is asked for; 400 for a bad body, 404 / 503 as for infer."""
    svc, model = ready_model(request)
    check_llm(svc, model)
    doc = kserve.load_header(await request.body())
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise SchemaViolation("'parameters' must be a JSON object")
    params = {**{k: v for k, v in doc.items() if k not in _OWN_KEYS}, **params}
    images = await request_images(model, doc.get(IMAGE))
    return generate_call(svc, model, doc.get("text_input"), params, doc.get("id"), images=images)


async def request_images(model: Any, value: Any) -> tuple[Image, ...]:
    """A vision model's images for one prompt: `image` (a string: base64 or a data: or http(s) URL, or a
    list of them; None: none), loaded; a 400 naming the model when it takes none."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in values):
        raise SchemaViolation(f"'{IMAGE}' must be a string (base64, or a data: or http(s) URL) or a list of them")
    array = np.empty(len(values), dtype=object)
    array[:] = values
    (images,) = await model.images(array, 1)
    return tuple(images)


def check_llm(svc: ModelService, model: Any) -> None:
    if model.kind != "llm":
        raise InvalidRequest(
            f"model '{svc.name}' is a {model.kind} model: generate needs an LLM; use /v2/models/{svc.name}/infer"
        )


def generate_call(
    svc: ModelService,
    model: Any,
    prompt: object,
    params: dict[str, Any],
    request_id: object,
    route: str = "/generate",
    *,
    images: tuple[Image, ...] = (),
) -> GenerateCall:
    """The generation of `prompt` with `params` (LMI's or Triton's spellings) on the ready LLM `model`
    of `svc`; `route` names the route or RPC in the refusals; `images`: a vision model's, loaded."""
    check_llm(svc, model)
    if not isinstance(prompt, str) or not prompt:
        raise SchemaViolation("'text_input' must be a non-empty string")
    params = triton_parameters(params, route)
    if request_id is not None and not isinstance(request_id, str):
        raise SchemaViolation("'id' must be a string")
    sampling, full_text = model.sampling(params)
    adapter = model.adapter(params)  # 404 for a LoRA adapter that is not served
    engine = svc.ready_engine()
    text = model.prompt(prompt, images) if images else prompt  # the images' placeholders in place
    generation = GenerationRequest(text, sampling, adapter=adapter, images=images)
    return GenerateCall(svc, prompt, request_id, full_text, generation, engine)


def triton_parameters(params: dict[str, Any], route: str = "/generate") -> dict[str, Any]:
    """`params` with Triton's spellings turned into LMI's; InvalidRequest (400) for a parameter that
    `route` cannot honour or does not know, or two spellings of one parameter that disagree."""
    out = dict(params)
    out.pop("stream", None)  # the route says whether it streams
    for name in OUTPUT_SWITCHES:
        if name in out:
            value = out.pop(name)
            if not isinstance(value, bool):
                raise SchemaViolation(f"'{name}' must be a boolean")
            if value:
                raise InvalidRequest(f"'{name}' is not supported: {route} answers text_output only")
    if "exclude_input_in_output" in out:
        exclude = out.pop("exclude_input_in_output")
        if not isinstance(exclude, bool):
            raise SchemaViolation("'exclude_input_in_output' must be a boolean")
        _set(out, "exclude_input_in_output", "return_full_text", not exclude)
    if "stop_words" in out:  # TensorRT-LLM's empty word: no word (litellm sends [""])
        out["stop_words"] = _words(out["stop_words"])
    for alias, name in TRITON_ALIASES.items():
        if alias in out:
            _set(out, alias, name, out.pop(alias))
    for name, why in UNSUPPORTED.items():
        if name in out:
            value = out.pop(name)
            if value in _NO_OP.get(name, ()) or (name == "bad_words" and _words(value) in ([], None)):
                continue
            raise InvalidRequest(f"parameter '{name}' is not supported: {why.format(route=route)}")
    unknown = sorted(k for k in out if k not in _KNOWN)
    if unknown:
        raise InvalidRequest(f"unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    return out


def _words(value: Any) -> Any:
    """A word list without TensorRT-LLM's empty words ("" alone, or "" in a list, means none)."""
    if value == "":
        return []
    if isinstance(value, list):
        return [word for word in value if word != ""]
    return value


def infer_parameters(parameters: dict[str, Any], tensors: dict[str, np.ndarray], route: str) -> dict[str, Any]:
    """An LLM infer request's parameters as the LLM takes them (LMI's names): its generation settings,
    given as `parameters` or as input `tensors` (`SETTING_INPUTS`), mapped as /generate maps them;
    InvalidRequest naming the field for one that `route` cannot honour, does not know, or that is given
    both ways with different values. The transport's own keys (content_type, ...) pass through."""
    return {
        **{k: v for k, v in parameters.items() if k in NOT_GENERATION},
        **triton_parameters(setting_values(parameters, tensors), route),
    }


def setting_values(parameters: dict[str, Any], tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """The generation settings of a request: its `parameters` but the transport's keys, and the values
    of its setting `tensors` (one value each, or a list for `LIST_SETTINGS`)."""
    out = {k: v for k, v in parameters.items() if k not in NOT_GENERATION or k == "stream"}
    for name, array in tensors.items():
        value = tensor_value(name, array)
        if name in out and out[name] != value:
            raise InvalidRequest(f"'{name}' is given as an input tensor and as a parameter, with different values")
        out[name] = value
    return out


def tensor_value(name: str, array: np.ndarray) -> Any:
    """The Python value of a setting tensor: text for BYTES (UTF-8), numbers, booleans; a list for
    `LIST_SETTINGS`, else the one element it must hold."""
    if array.dtype.kind in "OSU":
        values: list[Any] = text_rows(array, name) if array.size else []
    else:
        values = np.asarray(array).reshape(-1).tolist()
    if name in LIST_SETTINGS:
        return values
    if len(values) != 1:
        raise InvalidInput(f"input '{name}' must hold one value, got {len(values)} (shape {list(array.shape)})")
    return values[0]


def _set(params: dict[str, Any], alias: str, name: str, value: Any) -> None:
    """`params[name] = value`, refusing a different value already there under LMI's name."""
    if name in params and params[name] != value:
        raise InvalidRequest(f"'{alias}' and '{name}' disagree; give one of them")
    params[name] = value


async def generate(request: Request) -> Response:
    call = await parse(request)
    return await respond(request, _events(call), Answer(call))


async def generate_stream(request: Request) -> Response:
    call = await parse(request)
    return await respond(request, _events(call), Stream(call), headers=STREAM_HEADERS, wait_for="event")


def _events(call: GenerateCall) -> AsyncIterator[Tagged]:
    return tagged(sequence_events(call))


def sequence_events(call: GenerateCall) -> AsyncGenerator[StepEvent, None]:
    """The events of the call's first sequence, up to its last (closing it aborts the generation)."""
    return _first_sequence(call.engine.generate(call.request))


def piece(event: StepEvent) -> str | None:
    """The text a stream sends for `event` (None: nothing, e.g. a special token)."""
    token = event.token
    if token is not None and token.text and not token.special:
        return token.text
    return None


async def _first_sequence(events: AsyncGenerator[StepEvent, None]) -> AsyncGenerator[StepEvent, None]:
    """The events of sequence 0 up to its last one (the other sequences' are ignored)."""
    async with aclosing(events):  # closing aborts the sequences
        async for event in events:
            if event.index != 0:
                continue
            finish = event.finish
            if finish is not None and is_error_finish(event) and not finish.error:
                event = dataclasses.replace(event, finish=dataclasses.replace(finish, error=UNSPECIFIED_FAILURE))
            yield event
            if finish is not None:
                return


class Answer:
    """`/generate`: the whole text in one JSON object."""

    content_type = "application/json"
    streaming = False

    def __init__(self, call: GenerateCall):
        self.call = call
        self.text: str | None = None

    def on_event(self, index: int, event: StepEvent) -> bytes:
        if event.finish is not None:
            self.text = event.finish.generated_text
        return b""

    def close(self) -> bytes:
        if self.text is None:
            raise IncompleteGeneration("the generation ended without a final event")
        text = self.call.prompt + self.text if self.call.full_text else self.text
        return _json(self.call.answer(text))

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.body(exc)


class Stream:
    """`/generate_stream`: one SSE event per piece of text (the prompt first with `return_full_text`)."""

    content_type = STREAM_TYPE
    streaming = True

    def __init__(self, call: GenerateCall):
        self.call = call
        self.started = False

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return _sse(self.call.answer(self.call.prompt)) if self.call.full_text else b""

    def on_event(self, index: int, event: StepEvent) -> bytes:
        head = self._start()
        text = piece(event)
        if text is not None:
            return head + _sse(self.call.answer(text))
        return head

    def close(self) -> bytes:
        if not self.started:
            raise IncompleteGeneration("the generation ended without events")
        return b""

    def error(self, exc: LmiServeError) -> bytes:
        return self._start() + RENDERER.in_band(exc)


def _json(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def _sse(obj: dict) -> bytes:
    return sse.event(_json(obj))
