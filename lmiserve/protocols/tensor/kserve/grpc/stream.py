"""Triton's `ModelStreamInfer`: a bidirectional stream of `ModelInferRequest`s, each answered by its own
responses, as Triton serves decoupled models (a TensorRT-LLM or vLLM backend streaming tokens).

- On an LLM a request is the generation of its one `text_input` with the settings of REST's
  `generate_stream` (parameters, or input tensors beside `text_input`: kserve/generate.py): one response
  per piece of generated text (`text_output`, BYTES [1]), the prompt first with
  `exclude_input_in_output: false` / `return_full_text`. Every response carries Triton's
  ``triton_final_response``: false, true on the last one (which holds the last piece, or "" when the
  generation ended on a token without text), so a client always sees the end
  (``triton_enable_empty_final_response`` asks for nothing more). ``stream: false`` answers the whole
  text in one final response.
- On any other model a request is an inference answered by one final response.
- Requests run concurrently (their responses interleave; each carries its request's `id`). A request's
  error is its `error_message` and the stream stays open (Triton's way); a stream refused as a whole
  (API key, drain) ends with its status code. Closing the request side ends the stream once every
  request is answered; cancelling the call aborts its generations in the engine (their KV blocks are
  free at the next step).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc

from lmiserve.core.errors import (
    IncompleteGeneration,
    InternalError,
    InvalidInput,
    LmiServeError,
    SchemaViolation,
    ShuttingDown,
)
from lmiserve.core.request_context import RequestFacts
from lmiserve.core.tensor_io import bytes_column, text_rows
from lmiserve.models.llm_tensor import IMAGE, INPUT, OUTPUT
from lmiserve.protocols.tensor.kserve import generate
from lmiserve.protocols.tensor.kserve import infer as inference
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve.grpc import convert
from lmiserve.protocols.tensor.kserve.grpc import oip_pb2 as pb
from lmiserve.protocols.tensor.kserve.models import ready_in
from lmiserve.server.grpc_server import CLOSING, Access, Calls, metadata_of
from lmiserve.server.pipeline import failure_of, is_error_finish

log = logging.getLogger(__name__)

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
ROUTE = "ModelStreamInfer"
_STARTED, _ENDED = object(), object()  # queue markers: a request task began / one producer is done

Emit = Callable[[Any], None]


class StreamInfer:
    def __init__(self, calls: Calls, method: str) -> None:
        self.calls = calls
        self.method = method

    async def run(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The stream's responses (see the module docstring)."""
        metadata = metadata_of(context)
        try:
            self.calls.admit(metadata, Access.KEY)
        except LmiServeError as exc:  # the whole stream is refused: its own access line, then its status
            code = self.calls.code_of(exc)
            with self.calls.served(self.method, metadata) as facts:
                facts.status = code.value[0]
            await context.abort(code, exc.message)
        out: asyncio.Queue[Any] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        def ended(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            out.put_nowait(_ENDED)

        async def read() -> None:
            try:
                async for request in requests:
                    out.put_nowait(_STARTED)
                    task = asyncio.create_task(self._one(request, metadata, out.put_nowait))
                    tasks.add(task)
                    task.add_done_callback(ended)
            finally:
                out.put_nowait(_ENDED)

        reader = asyncio.create_task(read())
        self.calls.host.streams.add(out)
        producers, closing = 1, False
        try:
            while producers:
                if closing and producers == 1 and not reader.done():  # idle, and the port closes
                    break
                item = await out.get()
                if item is _STARTED:
                    producers += 1
                elif item is _ENDED:
                    producers -= 1
                elif item is CLOSING:
                    closing = True
                else:
                    yield item
        finally:  # the call is over (cancelled by its client too): abort what still runs
            self.calls.host.streams.discard(out)
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)
        if closing and producers:
            await context.abort(grpc.StatusCode.UNAVAILABLE, ShuttingDown().message)

    async def _one(self, request: Any, metadata: dict[str, str], emit: Emit) -> None:
        """Answer one request of the stream (its errors in-band), with its own access line and span."""
        with self.calls.served(self.method, metadata, request.model_name or None, request.id or None) as facts:
            try:
                if self.calls.drain.active:
                    raise ShuttingDown()
                await self._answer(request, emit, facts)
                facts.status, facts.completed = 0, True
            except LmiServeError as exc:
                facts.status = self.calls.code_of(exc).value[0]
                emit(_error(request, exc.message))
            except Exception as exc:  # noqa: BLE001 - an unforeseen failure ends this request only, with a message
                log.exception("unhandled error in %s", self.method)
                error = InternalError(str(exc) or type(exc).__name__)
                facts.status = self.calls.code_of(error).value[0]
                emit(_error(request, error.message))

    async def _answer(self, request: Any, emit: Emit, facts: RequestFacts) -> None:
        svc, model = ready_in(self.calls.registry, request.model_name, request.model_version)
        if EMPTY_FINAL in request.parameters:  # every last response is flagged final: nothing to add
            convert.value_of(request.parameters[EMPTY_FINAL], EMPTY_FINAL)
            del request.parameters[EMPTY_FINAL]
        doc, tail = convert.request_document(request, svc.name)
        if model.kind != "llm":
            outputs, plan = await inference.infer(doc, tail, svc.name, model, ROUTE)
            emit(
                _wrap(convert.infer_response(svc.name, outputs, plan, convert.wants_raw(request, plan), {FINAL: True}))
            )
            return
        tensor_request, plan, tensors = kserve.parse_infer(
            doc, tail, svc.name, model.signature, generate.SETTING_INPUTS
        )
        raw = convert.wants_raw(request, plan)
        settings = generate.setting_values(tensor_request.parameters, tensors)
        stream = settings.get("stream", True)
        if not isinstance(stream, bool):
            raise SchemaViolation("'stream' must be a boolean")
        if not stream:  # the whole text at once
            tensor_request.parameters = generate.infer_parameters(tensor_request.parameters, tensors, ROUTE)
            outputs = await model.infer(tensor_request)
            emit(_wrap(convert.infer_response(svc.name, outputs, plan, raw, {FINAL: True})))
            return
        prompts = text_rows(tensor_request.inputs[INPUT], INPUT)
        if len(prompts) != 1:
            raise InvalidInput(f"{ROUTE} streams the generation of one prompt: input '{INPUT}' holds {len(prompts)}")
        images = await model.images(tensor_request.inputs.get(IMAGE), 1)  # a vision model's `image` input
        call = generate.generate_call(svc, model, prompts[0], settings, request.id or None, ROUTE, images=images[0])

        def send(text: str, final: bool) -> None:
            outputs = {OUTPUT: bytes_column([text])}
            emit(_wrap(convert.infer_response(svc.name, outputs, plan, raw, {FINAL: final})))

        if call.full_text:
            send(call.prompt, False)
        async with aclosing(generate.sequence_events(call)) as events:  # closing it aborts the generation
            async for event in events:
                facts.observe(0, event)
                if is_error_finish(event):
                    raise failure_of(event)
                text = generate.piece(event)
                if event.finish is not None:
                    send(text or "", True)
                    return
                if text is not None:
                    send(text, False)
        raise IncompleteGeneration("the generation ended without a final event")


def _wrap(response: Any) -> Any:
    return pb.ModelStreamInferResponse(infer_response=response)


def _error(request: Any, message: str) -> Any:
    """A request's error on the stream, naming its request (id, model) for the client to match."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=response)
