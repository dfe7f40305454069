"""Triton's generate extension for LLMs: `/v2/models/{m}/generate` answers one JSON object,
`/generate_stream` answers SSE `data:` events, one per generated piece of text.

Request `{"id"?, "text_input": str, "parameters"?: {...}, <other keys>}`: other top-level keys join the
parameters (LMI generation parameter names: max_new_tokens, temperature, do_sample, stop, ...).
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
from lmiserve.core.request import GenerationRequest
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve.errors import RENDERER
from lmiserve.protocols.tensor.kserve.models import ready_model
from lmiserve.server import sse
from lmiserve.server.pipeline import Tagged, is_error_finish, respond, tagged

_OWN_KEYS = ("id", "text_input", "parameters", "model_name")
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
    params = {**{k: v for k, v in doc.items() if k not in _OWN_KEYS}, **params}
    params.pop("stream", None)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise SchemaViolation("'id' must be a string")
    sampling, full_text = model.sampling(params)
    engine = svc.ready_engine()
    return GenerateCall(svc, prompt, request_id, full_text, GenerationRequest(prompt, sampling), engine)


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
