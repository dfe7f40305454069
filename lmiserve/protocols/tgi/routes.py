"""TGI's native routes: POST /generate, /generate_stream, / (compat), /tokenize, /chat_tokenize;
GET /info, /health and /. Errors are answered by `errors.RENDERER` (GET /v1/models is OpenAI's:
`lmiserve.protocols.openai.models`).

`/tokenize` is vLLM's route too: a body with `prompt` or `messages` and no `inputs` goes to the
handler `routes(tokenize_other=...)` is given (app.py wires vLLM's, whose errors are its own); every
other body is TGI's, answered as TGI answers it."""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve import __version__
from lmiserve.core.adapters import NOWHERE, Elsewhere, Source
from lmiserve.core.media import Image
from lmiserve.core.tokenizer import tokenizing
from lmiserve.models.service import ModelService
from lmiserve.protocols.textgen import images as vision
from lmiserve.protocols.textgen.admission import enter
from lmiserve.protocols.textgen.body import json_payload, parse
from lmiserve.protocols.textgen.chat import ChatRequest
from lmiserve.protocols.textgen.generation import generate as engine_events
from lmiserve.protocols.textgen.generation import prepare
from lmiserve.protocols.textgen.served import Served, ready_llm, served
from lmiserve.protocols.textgen.timing import Timer
from lmiserve.protocols.textgen.tools.prompt import render_conversation
from lmiserve.protocols.textgen.tools.spec import tool_spec
from lmiserve.protocols.textgen.wire import SSE_HEADERS, dumps
from lmiserve.protocols.tgi import errors, responses
from lmiserve.protocols.tgi.encoders import AnswerShape, GenerateEncoder, StreamEncoder
from lmiserve.protocols.tgi.errors import RENDERER
from lmiserve.protocols.tgi.parse import validate
from lmiserve.protocols.tgi.schema import GenerateRequest
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes, rendered_by
from lmiserve.server.lookup import default_llm
from lmiserve.server.pipeline import respond
from lmiserve.server.responses import raw_response
from lmiserve.server.sse import keepalive

UNHEALTHY = dumps({"error": "unhealthy", "error_type": "healthcheck"})
ADAPTER_ID = "adapter_id"  # the field of `parameters` that names the LoRA adapter


async def generate(request: Request) -> Response:
    return await _generate(request, stream=False)


async def generate_stream(request: Request) -> Response:
    return await _generate(request, stream=True)


async def root(request: Request) -> Response:
    """POST / is TGI's compat route (a one-element list, or the stream with ``stream: true``); GET / is
    `health`."""
    return await _generate(request, stream=None)


async def _generate(request: Request, *, stream: bool | None) -> Response:
    timer = Timer()
    req = parse(GenerateRequest, await json_payload(request))
    return await answer(
        request, req, stream=req.stream if stream is None else stream, compat=stream is None, timer=timer
    )


async def invoke_compat(request: Request, payload: dict, elsewhere: Elsewhere = NOWHERE) -> Response:
    """An already decoded body answered like POST / (the /invocations dispatcher, API key checked),
    errors in TGI's shapes. `elsewhere`: the LoRA adapter the request names outside `parameters.adapter_id`
    (LMI's `adapters` field before it, the `adapter` query parameter and SageMaker's header after it)."""

    async def compat(request: Request) -> Response:
        timer = Timer()
        req = parse(GenerateRequest, payload)
        return await answer(request, req, stream=req.stream, compat=True, timer=timer, elsewhere=elsewhere)

    return await rendered_by(RENDERER, compat)(request)


async def answer(
    request: Request,
    req: GenerateRequest,
    *,
    stream: bool,
    compat: bool,
    timer: Timer,
    elsewhere: Elsewhere = NOWHERE,
) -> Response:
    """Validate, generate and answer one decoded TGI request."""
    model = served(request)
    # the adapter first, even on a stream: an unknown one is a 404 response, not an in-band error; TGI's
    # message names its own field, whichever source named the adapter
    sources = elsewhere.around(Source(ADAPTER_ID, req.effective_parameters().adapter_id))
    adapter = model.adapter(*(Source(ADAPTER_ID, source.value) for source in sources))
    if stream:
        errors.errors_in_band(request)
    with enter(request) as slot:
        prompt, images = await _with_images(model, req.inputs)
        call = await tokenizing(
            validate,
            req,
            model.limits,
            model.counter(images),
            stream=stream,
            adapter=adapter,
            prompt=prompt,
            images=images,
        )
        await prepare(model.engine, [call.request])  # refused (bad grammar, too large) before the stream
        timer.mark_validated()
        shape = AnswerShape.of(req.inputs, call)
        events = engine_events(model.engine, [call.request])
        if stream:
            sse_headers = {
                **SSE_HEADERS,
                "x-compute-type": model.compute_type,
                "x-compute-characters": str(len(req.inputs)),
            }
            return await respond(
                request,
                events,
                StreamEncoder(shape, model.special_text),
                headers=sse_headers,
                in_band=True,
                heartbeat=keepalive(model.service.settings.sse_keepalive_interval),
                on_close=slot.release,
            )
        encoder = GenerateEncoder(shape, model.special_text, compat=compat)

        def timing_headers() -> dict[str, str]:
            assert encoder.best is not None  # set by close(), before the headers are asked for
            best = encoder.best.finish
            return timer.headers(model.compute_type, len(req.inputs), best.prompt_tokens, best.generated_tokens)

        return await respond(request, timer.watch(events), encoder, headers=timing_headers, on_close=slot.release)


async def _with_images(model: Served, inputs: str) -> tuple[str | None, tuple[Image, ...]]:
    """A vision model's markdown images in `inputs` (TGI's ``![](url)``), loaded: the prompt with the
    model's image placeholders in their place, and the images (None, none: `inputs` as it is; a text
    model reads markdown as text, as TGI does)."""
    if not model.takes_images:
        return None, ()
    text, sources = vision.markdown(inputs)
    if not sources:
        return None, ()
    images = await model.load_images(sources)
    return model.image_prompt(text), images


# --- tokenizing -------------------------------------------------------------------------------------


def _byte_offsets(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character offsets (what fast tokenizers report) -> byte offsets into the UTF-8 text (TGI's)."""
    starts = [0]
    for ch in text:
        starts.append(starts[-1] + len(ch.encode()))
    return [(starts[a], starts[b]) for a, b in offsets]


def _image_tokens(model: Served, text: str, images: tuple[Image, ...], *, special: bool = True) -> list[dict]:
    """The tokens of a prompt with images, as the processor expands it (each image's tokens included):
    each token's text decoded alone, its offsets those of its text in the joined texts (the expanded
    prompt is not the text the client sent)."""
    out, at = [], 0
    for token_id in model.encode_with_images(text, images, special=special):
        piece = model.special_text(token_id)
        size = len(piece.encode())
        out.append({"id": token_id, "text": piece, "start": at, "stop": at + size})
        at += size
    return out


def _tokens(tokenizer, text: str, *, special: bool) -> list[dict]:
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    raw = text.encode()
    out = []
    for token_id, (start, stop) in zip(enc["input_ids"], _byte_offsets(text, enc["offset_mapping"])):
        out.append({"id": token_id, "text": raw[start:stop].decode(errors="replace"), "start": start, "stop": stop})
    return out


@dataclass(frozen=True)
class OtherTokenize:
    """Another protocol's body on /tokenize: its handler (payload already decoded; it answers its own
    errors) and, for the API document, its request bodies and its answer."""

    handler: Callable[[Request, Any], Awaitable[Response]]
    bodies: tuple[Any, ...] = ()
    answer: Any = None
    errors: tuple[Any, ...] = ()  # the ErrorRenderers of its answers


def _is_other(payload: Any) -> bool:
    return isinstance(payload, dict) and "inputs" not in payload and ("prompt" in payload or "messages" in payload)


def tokenize_route(other: OtherTokenize | None) -> Callable[[Request], Awaitable[Response]]:
    async def tokenize(request: Request) -> Response:
        payload = await json_payload(request)
        if other is not None and _is_other(payload):
            return await other.handler(request, payload)
        req = parse(GenerateRequest, payload)
        model = served(request)
        prompt, images = await _with_images(model, req.inputs)
        if prompt is not None:
            return raw_response(dumps(await tokenizing(_image_tokens, model, prompt, images)))
        return raw_response(dumps(await tokenizing(_tokens, model.tokenizer, req.inputs, special=True)))

    return tokenize


async def chat_tokenize(request: Request) -> Response:
    """The chat template applied to the messages of a chat request, and its tokens."""
    req = parse(ChatRequest, await json_payload(request))
    model = served(request)
    spec = tool_spec(req.tools, req.tool_choice, req.parallel_tool_calls, req.tool_prompt, model.tool_parser)
    images = await model.load_images(req.image_sources())  # 400 for a model without vision

    def tokenized() -> dict:
        text = render_conversation(req.messages, spec, functools.partial(model.render_chat, for_engine=False))
        if images:  # the image tokens counted (the template's text keeps one placeholder per image)
            tokens = _image_tokens(model, text, images, special=False)
            return {"tokenize_response": tokens, "templated_text": text}
        return {"tokenize_response": _tokens(model.tokenizer, text, special=False), "templated_text": text}

    return raw_response(dumps(await tokenizing(tokenized)))


# --- health and info --------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    """200 with an empty body when the model is ready, else 503 ``healthcheck``."""
    if ready_llm(request) is not None:
        return Response(status_code=200)
    return raw_response(UNHEALTHY, 503)


async def info(request: Request) -> Response:
    """TGI 3.x fields in wire order, then the legacy 2.x ones, then lmiserve's prefix cache: on or not,
    its memory bound (bytes) and the tokens it holds at most; then speculative decoding."""
    service = default_llm(request)
    if service.status != ModelService.READY:
        return raw_response(UNHEALTHY, 503)
    model = Served.of(service)
    limits, s = model.limits, model.service.settings
    label = os.environ.get("DOCKER_LABEL")
    snap = model.service.ready_generator().snapshot()
    body = {
        "model_id": model.service.name,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": limits.max_concurrent_requests,
        "max_best_of": limits.max_best_of,
        "max_stop_sequences": limits.max_stop_sequences,
        "max_input_tokens": limits.max_input_tokens,
        "max_total_tokens": limits.max_total_tokens,
        "validation_workers": 1,
        "max_client_batch_size": limits.max_client_batch_size,
        "router": "lmiserve",
        "version": __version__,
        "sha": None,
        "docker_label": label,
        "model_dtype": str(model.service.ready_llm().dtype),
        "model_device_type": model.service.ready_llm().device.type,
        "max_input_length": limits.max_input_tokens,
        "waiting_served_ratio": 0.0,
        # TGI's meaning: the tokens the KV cache holds (the paged pool; unknown with the slot layout)
        "max_batch_total_tokens": snap.kv_capacity if snap.kv_blocks else None,
        "max_waiting_tokens": 0,
        "max_batch_size": s.batch_size if s.dynamic_batching else s.max_rolling_batch_size,
        "prefix_caching": snap.prefix_cache_capacity > 0,
        "prefix_cache_size": snap.prefix_cache_bytes,
        "prefix_cache_tokens": snap.prefix_cache_capacity,
        "speculative_decoding": snap.speculation,  # its method, state, acceptance rate and counters; None: off
        "tool_call_parser": model.tool_parser.name,  # how tool calls are read (`auto`: the template's format)
    }
    return raw_response(dumps(body))


# --- the route table and its API document -----------------------------------------------------------

TAG = "TGI"
TIMING = {
    name: "Timing and token counts (TGI's headers)"
    for name in ("x-compute-type", "x-total-time", "x-inference-time", "x-prompt-tokens", "x-generated-tokens")
}
STREAM = apidoc.sse(
    "Server-sent events: one per token, the last with the text (no [DONE]); a failure after the start is "
    "a last error event",
    responses.StreamResponse,
    responses.TgiStreamError,
)
HEALTH = apidoc.Operation("Health: 200 once the model is ready", TAG, apidoc.ok("Ready (no body)"))


def _op(summary: str, body: object, replies: dict) -> apidoc.Operation:
    return apidoc.Operation(summary, TAG, replies, body=apidoc.json(body))


def routes(tokenize_other: OtherTokenize | None = None) -> Sequence[BaseRoute]:
    """TGI's routes; `tokenize_other`: who answers another protocol's body on /tokenize (none: TGI's
    schema refuses it)."""
    doc = apidoc.document
    other = tokenize_other
    tokenize_body: Any = Union[(GenerateRequest, *other.bodies)] if other and other.bodies else GenerateRequest  # noqa: UP007
    tokens: Any = list[responses.TokenizedToken]
    tokenize_answer: Any = Union[tokens, other.answer] if other and other.answer is not None else tokens  # noqa: UP007
    return protocol_routes(
        RENDERER,
        [
            doc(
                Route("/", root, methods=["POST"]),
                _op(
                    "Generate (TGI's compat route): a one-element list, or the stream with `stream: true`",
                    GenerateRequest,
                    apidoc.ok("The answer", {apidoc.JSON: list[responses.GenerateResponse], **STREAM}, TIMING),
                ),
            ),
            doc(
                Route("/generate", generate, methods=["POST"]),
                _op(
                    "Generate text",
                    GenerateRequest,
                    apidoc.ok("The answer", apidoc.json(responses.GenerateResponse), TIMING),
                ),
            ),
            doc(
                Route("/generate_stream", generate_stream, methods=["POST"]),
                _op("Generate text, streamed token by token", GenerateRequest, apidoc.ok("The stream", STREAM)),
            ),
            doc(
                Route("/tokenize", tokenize_route(other), methods=["POST"]),
                apidoc.Operation(
                    "Tokenize `inputs` (TGI), or vLLM's `prompt` / `messages`: the body tells which",
                    TAG,
                    apidoc.ok("The tokens (TGI's list, or vLLM's object)", apidoc.json(tokenize_answer)),
                    body=apidoc.json(tokenize_body),
                    errors=other.errors if other else (),
                ),
            ),
            doc(
                Route("/chat_tokenize", chat_tokenize, methods=["POST"]),
                _op(
                    "Apply the chat template to `messages` and tokenize the text",
                    ChatRequest,
                    apidoc.ok("The templated text and its tokens", apidoc.json(responses.ChatTokenizeResponse)),
                ),
            ),
            doc(
                Route("/info", info, methods=["GET"]),
                apidoc.Operation(
                    "The served model and the server's limits", TAG, apidoc.ok("Info", apidoc.json(responses.Info))
                ),
            ),
        ],
        public=[
            doc(Route("/", health, methods=["GET"]), HEALTH),
            doc(Route("/health", health, methods=["GET"]), HEALTH),
        ],
    )
