"""Triton's generate extension for LLMs: `/v2/models/{m}/generate` answers one JSON object,
`/generate_stream` answers SSE `data:` events, one per generated piece of text.

Request `{"id"?, "text_input": str, "parameters"?: {...}, <other keys>}`: other top-level keys join the
parameters (`parameters` wins). Parameters by LMI's names (max_new_tokens, temperature, do_sample, stop,
...) or by the spellings of Triton's TensorRT-LLM and vLLM backends (`TRITON_ALIASES`: max_tokens,
random_seed, stop_words, ignore_eos, min_length, min_tokens, exclude_input_in_output; `lora_name`, like
`adapter_id`, picks a LoRA adapter of the model: 404 for one that is not served); a parameter that
/generate cannot honour (`bad_words`, `end_id`, beam search, logprobs or logits outputs, more than one
sequence, ...) or does not know is a 400 naming it, never ignored.
Answer `{"id"?, "model_name", "model_version", "text_output"}` (the id only when the request had one).

Both go through the response pipeline. The stream's status waits for the engine's first event: a
failure before it (validation, a full queue, a queue timeout) is an ordinary JSON error; from then on a
failure is a last `data: {"error": msg}` event under 200. Only the first sequence (index 0) is answered.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import (
    IncompleteGeneration,
    InvalidRequest,
    LmiServeError,
    SchemaViolation,
)
from lmiserve.core.events import StepEvent
from lmiserve.core.parameters import GenerationParameters
from lmiserve.core.request import GenerationRequest
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve.errors import RENDERER
from lmiserve.protocols.tensor.kserve.models import ready_model
from lmiserve.server import sse
from lmiserve.server.pipeline import Tagged, is_error_finish, respond, tagged

_OWN_KEYS = ("id", "text_input", "parameters", "model_name")
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
UNSUPPORTED = {
    "bad_words": "bad-word filtering is not supported (no token is banned)",
    "end_id": "a custom end token is not supported; use 'stop_token_ids'",
    "pad_id": "a custom padding token is not supported",
    "beam_width": "beam search is not supported (beam_width 1 only)",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "top_n_tokens": "/generate answers text only; use /generate on the LMI or TGI routes for top tokens",
    "n": "/generate answers one sequence (n 1 only)",
    "best_of": "/generate answers one sequence (best_of 1 only)",
    "output_formatter": "/generate has its own answer shape (no output_formatter)",
}
_NO_OP = {"beam_width": (1,), "length_penalty": (1, 1.0), "n": (1, None), "best_of": (1,), "top_n_tokens": (0,)}
_KNOWN = frozenset(GenerationParameters.model_fields) | {"stream", "adapter_id"}
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
    if model.kind != "llm":
        raise InvalidRequest(
            f"model '{svc.name}' is a {model.kind} model: generate needs an LLM; use /v2/models/{svc.name}/infer"
        )
    doc = kserve.load_header(await request.body())
    prompt = doc.get("text_input")
    if not isinstance(prompt, str) or not prompt:
        raise SchemaViolation("'text_input' must be a non-empty string")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise SchemaViolation("'parameters' must be a JSON object")
    params = triton_parameters({**{k: v for k, v in doc.items() if k not in _OWN_KEYS}, **params})
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise SchemaViolation("'id' must be a string")
    sampling, full_text = model.sampling(params)
    adapter = model.adapter(params)  # 404 for a LoRA adapter that is not served
    engine = svc.ready_engine()
    generation = GenerationRequest(prompt, sampling, adapter=adapter)
    return GenerateCall(svc, prompt, request_id, full_text, generation, engine)


def triton_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """`params` with Triton's spellings turned into LMI's; InvalidRequest (400) for a parameter that
    /generate cannot honour or does not know, or two spellings of one parameter that disagree."""
    out = dict(params)
    out.pop("stream", None)  # the route says whether it streams
    for name in OUTPUT_SWITCHES:
        if name in out:
            value = out.pop(name)
            if not isinstance(value, bool):
                raise SchemaViolation(f"'{name}' must be a boolean")
            if value:
                raise InvalidRequest(f"'{name}' is not supported: /generate answers text_output only")
    if "exclude_input_in_output" in out:
        exclude = out.pop("exclude_input_in_output")
        if not isinstance(exclude, bool):
            raise SchemaViolation("'exclude_input_in_output' must be a boolean")
        _set(out, "exclude_input_in_output", "return_full_text", not exclude)
    for alias, name in TRITON_ALIASES.items():
        if alias in out:
            _set(out, alias, name, out.pop(alias))
    for name, why in UNSUPPORTED.items():
        if name in out:
            value = out.pop(name)
            if value in _NO_OP.get(name, ()) or (name == "bad_words" and value in ([], "", None)):
                continue
            raise InvalidRequest(f"parameter '{name}' is not supported: {why}")
    unknown = sorted(k for k in out if k not in _KNOWN)
    if unknown:
        raise InvalidRequest(f"unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    return out


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
    return tagged(_first_sequence(call.engine.generate(call.request)))


async def _first_sequence(events: AsyncGenerator[StepEvent, None]) -> AsyncIterator[StepEvent]:
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
        token = event.token
        if token is not None and token.text and not token.special:
            return head + _sse(self.call.answer(token.text))
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
