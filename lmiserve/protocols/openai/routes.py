"""OpenAI-compatible routes (reference tgi-openai.md §6): POST /v1/chat/completions, /v1/completions.

Errors before the stream starts (validation, template, overload) are HTTP 4xx JSON in TGI's shape;
after it started they are ``data: {"error":{...}}`` followed by ``data: [DONE]`` (§9.3).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lmiserve.protocols.openai import parse as adapter
from lmiserve.protocols.tgi.parse import TgiError
from lmiserve.protocols.openai import encoders as fmt
from lmiserve.protocols.tgi.encoders import sequences
from lmiserve.server import auth
from lmiserve.protocols.tgi import routes as tgi_routes
from lmiserve.server.textgen import Rejected, Timer, enter, error_response, json_payload, parse, served
from lmiserve.server.pipeline import ClientDisconnected
from lmiserve.server.responses import raw_response
from lmiserve.server.streaming import SseResponse, collect, guarded
from lmiserve.protocols.openai.schema import ChatRequest, CompletionRequest
from lmiserve.core.aio import merge_tagged
from starlette.routing import Route


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def _handle(request: Request, *, chat: bool, payload: Any = None) -> Response:
    if (denied := auth.rejected(request)) is not None:
        return denied
    try:
        if payload is None:
            payload = await json_payload(request)
        req = parse(ChatRequest if chat else CompletionRequest, payload)
    except Rejected as rejected:
        return rejected.response
    return await answer(request, req)


async def answer(request: Request, req: ChatRequest | CompletionRequest) -> Response:
    """Validate, generate and answer (also used by /invocations for `messages` / `prompt` bodies)."""
    chat = isinstance(req, ChatRequest)
    timer = Timer()
    release = None
    try:
        model = served(request)
        release = enter(request)
        if chat:
            call = adapter.chat(req, model.limits, model.count_tokens, model.render_chat, model.service.name)
        else:
            call = adapter.completion(req, model.limits, model.count_tokens, model.service.name)
    except TgiError as exc:
        if release is not None:
            release()
        return error_response(exc)
    timer.mark_validated()
    env = fmt.Envelope(call.model, model.system_fingerprint)
    engine = model.engine
    if chat:
        events = engine.generate(call.calls[0].request)
    elif len(call.calls) == 1:
        events = _tagged(engine.generate(call.calls[0].request))
    else:
        events = merge_tagged([engine.generate(c.request) for c in call.calls])
    if call.stream:
        if chat:
            stream = fmt.ChatStream(env, logprobs=call.logprobs, include_usage=call.include_usage)
        else:
            stream = fmt.CompletionStream(env, logprobs=call.logprobs, n=call.calls[0].best_of)
        chunks = guarded(events, stream.on_event, lambda e: fmt.stream_error(e.message), stream.close)
        return SseResponse(chunks, interval=model.service.settings.sse_keepalive_interval,
                           headers={"x-compute-type": model.compute_type}, on_close=release)
    try:
        collected = await collect(request, timer.watch(events))
    except ClientDisconnected:
        return Response(status_code=499)
    except TgiError as exc:
        return error_response(exc)
    finally:
        release()
    if len(_finished_prompts(collected)) < len(call.calls):
        return error_response(TgiError("Incomplete generation", 500, "incomplete_generation"))
    if chat:
        seqs = sequences(collected)
        body = fmt.chat_body(seqs, env, logprobs=call.logprobs)
        prompt_tokens = seqs[0].finish.prompt_tokens
        generated = sum(s.finish.generated_tokens for s in seqs)
        characters = len(call.prompts[0])
    else:
        per_prompt = [sequences(e for i, e in collected if i == p) for p in range(len(call.calls))]
        body = fmt.completion_body(per_prompt, call.prompts, env, logprobs=call.logprobs, echo=call.echo)
        prompt_tokens = sum(seqs[0].finish.prompt_tokens for seqs in per_prompt)
        generated = sum(s.finish.generated_tokens for seqs in per_prompt for s in seqs)
        characters = sum(len(p) for p in call.prompts)
    headers = timer.headers(model.compute_type, characters, prompt_tokens, generated)
    return raw_response(body, headers=headers)


async def _tagged(events):
    """One prompt's events tagged with prompt index 0 (no merging task in between)."""
    try:
        async for event in events:
            yield 0, event
    finally:
        await events.aclose()


def _finished_prompts(collected: list) -> set[int]:
    """Indexes of the prompts whose events include a finish (chat events come untagged: prompt 0)."""
    tagged = [item if isinstance(item, tuple) else (0, item) for item in collected]
    return {index for index, event in tagged if event.finish is not None}


async def invoke(request: Request, payload: dict, *, chat: bool) -> Response:
    """An already decoded chat (`chat`) or completion body from the /invocations dispatcher."""
    return await _handle(request, chat=chat, payload=payload)


async def dispatch_invocation(request: Request) -> Response | None:
    """/invocations: a `messages` body is a chat completion, a `prompt` body a completion, and with
    tgi_compat an `inputs` body is TGI's POST /; None leaves the request to LMI. The API key applies
    to every form."""
    if (denied := auth.rejected(request)) is not None:
        return denied
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method != "POST" or ctype not in ("", "application/json"):
        return None
    try:
        payload = await json_payload(request, require_json=False)
    except Rejected:
        return None  # not JSON: LMI decides (text/plain, its own parse errors)
    if not isinstance(payload, dict):
        return None
    if "messages" in payload:
        return await _handle(request, chat=True, payload=payload)
    if "prompt" in payload and "inputs" not in payload:
        return await _handle(request, chat=False, payload=payload)
    settings = request.app.state.settings
    params = payload.get("parameters")
    lmi_formatter = isinstance(params, dict) and params.get("output_formatter")
    if "inputs" in payload and settings.tgi_compat and request.url.path == "/invocations" and not lmi_formatter:
        return await tgi_routes.compat_payload(request, payload)
    return None


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
