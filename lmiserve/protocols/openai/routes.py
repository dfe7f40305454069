"""OpenAI-compatible routes: POST /v1/chat/completions and /v1/completions. Errors are answered by
`errors.RENDERER`: before a stream starts as ordinary responses, after it in-band. Fields the request
gives and the server ignores are named in the answer's `warnings` header, or refused with a 400 under
`strict_openai_fields` (openai.fields)."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.adapters import NOWHERE, Elsewhere, Source, first_named
from lmiserve.core.tokenizer import tokenizing
from lmiserve.protocols.openai import fields, responses
from lmiserve.protocols.openai import parse as adapter
from lmiserve.protocols.openai.chat_encoders import ChatEncoder, ChatStreamEncoder, plain_answer
from lmiserve.protocols.openai.completion_encoders import CompletionEncoder, CompletionStreamEncoder
from lmiserve.protocols.openai.encoders import Envelope, completion_id
from lmiserve.protocols.openai.errors import RENDERER, IgnoredFields, model_not_found
from lmiserve.protocols.openai.reasoning import Reasoning
from lmiserve.protocols.openai.schema import ChatRequest, CompletionRequest
from lmiserve.protocols.openai.tool_calls import ToolChatStreamEncoder, tool_answer
from lmiserve.protocols.textgen.admission import enter
from lmiserve.protocols.textgen.body import json_payload, parse
from lmiserve.protocols.textgen.generation import generate as engine_events
from lmiserve.protocols.textgen.generation import prepare
from lmiserve.protocols.textgen.reasoning import Thinking
from lmiserve.protocols.textgen.served import served
from lmiserve.protocols.textgen.timing import Timer
from lmiserve.protocols.textgen.wire import SSE_HEADERS
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes, rendered_by
from lmiserve.server.pipeline import respond
from lmiserve.server.sse import keepalive


async def chat_completions(request: Request) -> Response:
    return await answer(request, parse(ChatRequest, await json_payload(request)))


async def completions(request: Request) -> Response:
    return await answer(request, parse(CompletionRequest, await json_payload(request)))


async def invoke(request: Request, payload: dict, *, chat: bool, elsewhere: Elsewhere = NOWHERE) -> Response:
    """An already decoded chat (`chat=True`) or completion body answered as the routes answer it (the
    /invocations dispatcher; API key checked by the caller), errors in these routes' shapes. `elsewhere`:
    the model (a LoRA adapter) the request names outside its body, which a body naming none takes."""

    async def endpoint(request: Request) -> Response:
        if chat:
            return await answer(request, parse(ChatRequest, payload), elsewhere)
        return await answer(request, parse(CompletionRequest, payload), elsewhere)

    return await rendered_by(RENDERER, endpoint)(request)


async def answer(request: Request, req: ChatRequest | CompletionRequest, elsewhere: Elsewhere = NOWHERE) -> Response:
    """Validate, generate and answer one decoded request."""
    chat = isinstance(req, ChatRequest)
    timer = Timer()
    model = served(request)
    ignored = req.ignored_fields
    if ignored and model.service.settings.strict_openai_fields:
        raise IgnoredFields(ignored)
    warnings = fields.headers(ignored)
    sources = elsewhere.around(Source("model", req.model))  # on /invocations also ?adapter=, SageMaker's header
    lora = model.model_adapter(*sources, not_found=model_not_found)  # the adapter answers (vLLM's)
    named = first_named(sources)
    with enter(request) as slot:
        if isinstance(req, ChatRequest):
            thinking = Thinking.of(Reasoning, model.service.settings, model.tokenizer)
            images = await model.load_images(req.image_sources())  # 400 for a model without vision
            call = await tokenizing(
                adapter.chat,
                req,
                model.limits,
                model.counter(images),
                model.render_chat,
                model.service.name,
                model.tool_parser,
                adapter=lora,
                model_name=named.value if named is not None else None,
                thinking=thinking,
                images=images,
            )
            model.check_tools(call.tools)
        else:
            call = await tokenizing(
                adapter.completion,
                req,
                model.limits,
                model.count_tokens,
                model.service.name,
                model.decode,
                adapter=lora,
            )
        reasoning = call.reasoning
        await prepare(model.engine, [c.request for c in call.calls])  # bad grammar, too large: 4xx before the stream
        timer.mark_validated()
        env = Envelope(call.model, model.system_fingerprint, id=completion_id(chat))
        events = engine_events(model.engine, [c.request for c in call.calls])
        if call.stream:
            stream: ChatStreamEncoder | CompletionStreamEncoder | ToolChatStreamEncoder
            if call.tools is not None:
                stream = ToolChatStreamEncoder(
                    env,
                    logprobs=call.logprobs,
                    include_usage=call.include_usage,
                    reasoning=reasoning,
                    tools=call.tools,
                )
            elif chat:
                stream = ChatStreamEncoder(
                    env, logprobs=call.logprobs, include_usage=call.include_usage, reasoning=reasoning
                )
            else:
                stream = CompletionStreamEncoder(
                    env,
                    logprobs=call.logprobs,
                    n=call.calls[0].best_of,
                    top_n=call.top_logprobs,
                    include_usage=call.include_usage,
                )
            return await respond(
                request,
                events,
                stream,
                headers={**SSE_HEADERS, "x-compute-type": model.compute_type, **warnings},
                in_band=True,
                heartbeat=keepalive(model.service.settings.sse_keepalive_interval),
                on_close=slot.release,
            )
        whole: ChatEncoder | CompletionEncoder
        if chat:
            answer = plain_answer if call.tools is None else tool_answer(call.tools)
            whole = ChatEncoder(
                env,
                call.prompts[0],
                logprobs=call.logprobs,
                answer=answer if reasoning is None else reasoning.answer(answer),
                prompt_logprobs=call.prompt_logprobs,
                reasoning=reasoning,
            )
        else:
            whole = CompletionEncoder(
                env,
                call.prompts,
                logprobs=call.logprobs,
                echo=call.echo,
                top_n=call.top_logprobs,
                score_only=call.score_only,
                prompt_logprobs=call.prompt_logprobs,
            )

        def headers() -> dict[str, str]:
            timing = timer.headers(model.compute_type, whole.characters, whole.prompt_tokens, whole.generated_tokens)
            return {**timing, **warnings}

        return await respond(request, timer.watch(events), whole, headers=headers, on_close=slot.release)


DONE_NOTE = "Server-sent events, then `data: [DONE]`; a failure after the start is a last error event"
CHAT = apidoc.Operation(
    "Chat completion (`stream: true`: server-sent chunks)",
    "OpenAI",
    apidoc.ok(
        "The completion",
        {
            apidoc.JSON: responses.ChatCompletion,
            **apidoc.sse(DONE_NOTE, responses.ChatCompletionChunk, responses.OpenAIStreamError, done=True),
        },
    ),
    body=apidoc.json(ChatRequest),
)
COMPLETION = apidoc.Operation(
    "Text completion of one prompt or several (`stream: true`: server-sent events)",
    "OpenAI",
    apidoc.ok(
        "The completion",
        {
            apidoc.JSON: responses.Completion,
            **apidoc.sse(DONE_NOTE, responses.Completion, responses.OpenAIStreamError, done=True),
        },
    ),
    body=apidoc.json(CompletionRequest),
)


def routes() -> Sequence[BaseRoute]:
    return protocol_routes(
        RENDERER,
        [
            apidoc.document(Route("/v1/chat/completions", chat_completions, methods=["POST"]), CHAT),
            apidoc.document(Route("/v1/completions", completions, methods=["POST"]), COMPLETION),
        ],
    )
