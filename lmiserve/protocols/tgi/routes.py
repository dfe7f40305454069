"""TGI native routes (reference tgi-openai.md §4): POST /generate, /generate_stream, / (compat),
/tokenize, /chat_tokenize; GET /info, /health, / and /v1/models."""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import Response

from lmiserve import __version__
from lmiserve.protocols.tgi import parse as adapter
from lmiserve.protocols.tgi.parse import TgiError
from lmiserve.protocols.tgi import encoders as fmt
from lmiserve.server import auth
from lmiserve.server.textgen import Rejected, Timer, enter, error_response, json_payload, parse, served
from lmiserve.server.pipeline import ClientDisconnected
from lmiserve.server.responses import raw_response
from lmiserve.core.errors import LmiServeError
from lmiserve.models.service import ModelService, default_llm
from lmiserve.server.streaming import SSE_HEADERS, SseResponse, collect, guarded
from lmiserve.protocols.openai.schema import ChatRequest
from lmiserve.protocols.tgi.schema import GenerateRequest
from starlette.routing import Route


async def generate(request: Request) -> Response:
    return await _generate(request, stream=False)


async def generate_stream(request: Request) -> Response:
    return await _generate(request, stream=True)


async def root(request: Request) -> Response:
    """GET / is a health check; POST / is TGI's compat route (array, or SSE with ``stream: true``)."""
    if request.method == "GET":
        return await health(request)
    return await _generate(request, stream=None)


async def _generate(request: Request, *, stream: bool | None) -> Response:
    if (denied := auth.rejected(request)) is not None:
        return denied
    timer = Timer()
    try:
        req = parse(GenerateRequest, await json_payload(request))
    except Rejected as rejected:
        return rejected.response
    return await answer(request, req, stream=req.stream if stream is None else stream, compat=stream is None,
                        timer=timer)


async def compat_payload(request: Request, payload) -> Response:
    """An already decoded body answered like POST / (/invocations with tgi_compat)."""
    timer = Timer()
    try:
        req = parse(GenerateRequest, payload)
    except Rejected as rejected:
        return rejected.response
    return await answer(request, req, stream=req.stream, compat=True, timer=timer)


async def invoke_compat(request: Request, payload: dict) -> Response:
    """An already decoded `inputs` body from the /invocations dispatcher (tgi_compat), answered like POST /."""
    return await compat_payload(request, payload)


async def answer(request: Request, req: GenerateRequest, *, stream: bool, compat: bool, timer: Timer) -> Response:
    """Validate, generate and answer one TGI request (also used by /invocations with tgi_compat)."""
    release = None
    try:
        model = served(request)
        release = enter(request)
        call = adapter.build(req.inputs, req.effective_parameters(), model.limits, model.count_tokens, stream=stream)
    except TgiError as exc:
        if release is not None:
            release()
        if stream and exc.status != 503:  # native streams report everything in-band under 200 (§9.3)
            return raw_response(fmt.StreamFormatter.error_event(exc.message, exc.kind), 200, SSE_HEADERS["content-type"],
                                {k: v for k, v in SSE_HEADERS.items() if k != "content-type"})
        return error_response(exc)
    timer.mark_validated()
    shape = fmt.AnswerShape(req.inputs, call.details, call.decoder_input_details, call.return_full_text,
                            call.top_n_tokens, call.sampling, call.input_length)
    events = model.engine.generate(call.request)
    if stream:
        formatter = fmt.StreamFormatter(shape, model.special_text)
        chunks = guarded(events, formatter.on_event, lambda e: formatter.error_event(e.message, e.kind), formatter.close)
        headers = {"x-compute-type": model.compute_type, "x-compute-characters": str(len(req.inputs))}
        return SseResponse(chunks, interval=model.service.settings.sse_keepalive_interval, headers=headers,
                           on_close=release)
    try:
        seqs = fmt.sequences(await collect(request, timer.watch(events)))
    except ClientDisconnected:
        return Response(status_code=499)
    except TgiError as exc:
        return error_response(exc)
    finally:
        release()
    if not seqs:
        return error_response(TgiError("Incomplete generation", 500, "incomplete_generation"))
    body = fmt.generate_body(seqs, shape, model.special_text)
    headers = timer.headers(model.compute_type, len(req.inputs), seqs[0].finish.prompt_tokens,
                            seqs[0].finish.generated_tokens)
    return raw_response(fmt.dumps([body] if compat else body), headers=headers)


# --- tokenizing -------------------------------------------------------------------------------------


def _byte_offsets(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character offsets (what fast tokenizers report) -> byte offsets into the UTF-8 text (TGI's)."""
    starts = [0]
    for ch in text:
        starts.append(starts[-1] + len(ch.encode()))
    return [(starts[a], starts[b]) for a, b in offsets]


def _tokens(tokenizer, text: str, *, special: bool) -> list[dict]:
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    raw = text.encode()
    out = []
    for token_id, (start, stop) in zip(enc["input_ids"], _byte_offsets(text, enc["offset_mapping"])):
        out.append({"id": token_id, "text": raw[start:stop].decode(errors="replace"), "start": start, "stop": stop})
    return out


async def tokenize(request: Request) -> Response:
    if (denied := auth.rejected(request)) is not None:
        return denied
    try:
        req = parse(GenerateRequest, await json_payload(request))
        model = served(request)
        return raw_response(fmt.dumps(_tokens(model.tokenizer, req.inputs, special=True)))
    except Rejected as rejected:
        return rejected.response
    except TgiError as exc:
        return error_response(exc)


async def chat_tokenize(request: Request) -> Response:
    try:
        req = parse(ChatRequest, await json_payload(request))
        model = served(request)
        text = model.render_chat([{"role": m.role, "content": m.text()} for m in req.messages], for_engine=False)
        body = {"tokenize_response": _tokens(model.tokenizer, text, special=False), "templated_text": text}
        return raw_response(fmt.dumps(body))
    except Rejected as rejected:
        return rejected.response
    except TgiError as exc:
        return error_response(exc)


# --- health and info --------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    """200 with an empty body when the model is ready, else 503 ``healthcheck`` (§4.5)."""
    try:
        service = default_llm(request)
    except LmiServeError:
        service = None
    if service is not None and service.status == ModelService.READY:
        return Response(status_code=200)
    return raw_response(fmt.error_body("unhealthy", "healthcheck"), 503)


async def info(request: Request) -> Response:
    """TGI 3.x fields in wire order, then the legacy 2.x ones (§11, §15)."""
    try:
        model = served(request)
    except TgiError:
        return raw_response(fmt.error_body("unhealthy", "healthcheck"), 503)
    limits, s = model.limits, model.service.settings
    label = os.environ.get("DOCKER_LABEL")
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
        "model_dtype": str(model.service.loaded.dtype),
        "model_device_type": model.service.loaded.device.type,
        "max_input_length": limits.max_input_tokens,
        "waiting_served_ratio": 0.0,
        "max_batch_total_tokens": None,
        "max_waiting_tokens": 0,
        "max_batch_size": s.batch_size if s.dynamic_batching else s.max_rolling_batch_size,
    }
    return raw_response(fmt.dumps(body))


async def models(request: Request) -> Response:
    names = [service.name for service in request.app.state.registry if service.is_llm]
    body = {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": name} for name in names]}
    return raw_response(fmt.dumps(body))


def routes() -> list[Route]:
    return [
        Route("/", root, methods=["GET", "POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/generate_stream", generate_stream, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/chat_tokenize", chat_tokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
