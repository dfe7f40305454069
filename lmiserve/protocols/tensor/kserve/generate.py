"""Triton's generate extension for LLMs (reference §3.10): /v2/models/{m}/generate answers one JSON
object, /generate_stream answers SSE `data:` events (one per generated piece of text).

Request `{"id"?, "text_input": str, "parameters"?: {...}, <other keys>}`: other top-level keys join the
parameters (LMI generation parameter names: max_new_tokens, temperature, do_sample, stop, ...).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.codecs.errors import TensorError, protocol_status
from lmiserve.core.errors import LmiServeError
from lmiserve.core.events import FinishReason
from lmiserve.core.request import GenerationRequest
from lmiserve.core.tensors import TensorRequest
from lmiserve.server.pipeline import DisconnectAwareStream
from lmiserve.server.responses import raw_response

_OWN_KEYS = ("id", "text_input", "parameters", "model_name")


def _error(message: str, status: int) -> Response:
    return raw_response(json.dumps({"error": message}, ensure_ascii=False).encode("utf-8"), status)


async def _parse(request: Request):
    from lmiserve.protocols.tensor.kserve.routes import ready_model

    svc, model = ready_model(request)
    if model.kind != "llm":
        raise TensorError(f"model '{svc.name}' is a {model.kind} model: generate needs an LLM; use /v2/models/{svc.name}/infer")
    doc = kserve.load_header(await request.body())
    prompt = doc.get("text_input")
    if not isinstance(prompt, str) or not prompt:
        raise TensorError("'text_input' must be a non-empty string")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise TensorError("'parameters' must be a JSON object")
    params = {**{k: v for k, v in doc.items() if k not in _OWN_KEYS}, **params}
    params.pop("stream", None)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise TensorError("'id' must be a string")
    return svc, model, prompt, params, request_id


def _body(svc, request_id: str | None, text: str) -> dict:
    body = {"id": request_id} if request_id is not None else {}
    return {**body, "model_name": svc.name, "model_version": kserve.VERSION, "text_output": text}


async def generate(request: Request) -> Response:
    try:
        svc, model, prompt, params, request_id = await _parse(request)
        prompts = np.empty(1, dtype=object)
        prompts[0] = prompt.encode("utf-8")
        outputs = await model.infer(TensorRequest(inputs={model.signature.inputs[0].name: prompts}, parameters=params))
        text = outputs[model.signature.outputs[0].name].reshape(-1)[0]
    except LmiServeError as exc:
        return _error(exc.message, protocol_status(exc))
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)
    return raw_response(json.dumps(_body(svc, request_id, text), ensure_ascii=False).encode("utf-8"))


async def generate_stream(request: Request) -> Response:
    try:
        svc, model, prompt, params, request_id = await _parse(request)
        sampling, full_text = model.sampling(params)
        engine = svc.ready_engine()
    except LmiServeError as exc:
        return _error(exc.message, protocol_status(exc))
    events = engine.generate(GenerationRequest(prompt, sampling))
    try:  # failures before the first event are ordinary JSON errors
        first = await anext(events)
    except LmiServeError as exc:
        await events.aclose()
        return _error(exc.message, protocol_status(exc))
    except StopAsyncIteration:
        return _error("the generation ended without events", 500)

    async def replay() -> AsyncIterator:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()  # aborts the sequence when the client goes away

    async def body() -> AsyncIterator[bytes]:
        async with aclosing(replay()) as stream:
            if full_text:
                yield _sse(_body(svc, request_id, prompt))
            async for event in stream:
                if event.index != 0:
                    continue
                if event.finish is not None and event.finish.reason == FinishReason.ERROR:
                    yield _sse({"error": event.finish.error or "generation failed"})
                    return
                if event.token is not None and event.token.text and not event.token.special:
                    yield _sse(_body(svc, request_id, event.token.text))

    return DisconnectAwareStream(body(), headers={"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"})


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"
