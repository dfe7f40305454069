"""Anthropic Messages routes: POST /v1/messages (whole or ``stream: true``) and POST
/v1/messages/count_tokens, over the chat pipeline the OpenAI routes use (`lmiserve.protocols.textgen`).
Errors are answered by `errors.RENDERER`: before a stream starts as ordinary responses, after it as the
stream's last event. The API key may come as ``x-api-key`` (Anthropic's clients) or ``Authorization:
Bearer``. See docs/protocols/anthropic.md."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.adapters import Source
from lmiserve.core.errors import ModelNotFound, SchemaViolation
from lmiserve.core.tokenizer import tokenizing
from lmiserve.protocols.anthropic import encoders as enc
from lmiserve.protocols.anthropic import parse as adapter
from lmiserve.protocols.anthropic import responses
from lmiserve.protocols.anthropic.errors import RENDERER
from lmiserve.protocols.anthropic.schema import CountTokensRequest, MessagesRequest
from lmiserve.protocols.textgen.admission import enter
from lmiserve.protocols.textgen.body import json_payload
from lmiserve.protocols.textgen.generation import generate as engine_events
from lmiserve.protocols.textgen.generation import prepare
from lmiserve.protocols.textgen.reasoning import Reasoning, Thinking, markers
from lmiserve.protocols.textgen.served import Served, served
from lmiserve.protocols.textgen.timing import Timer
from lmiserve.protocols.textgen.wire import SSE_HEADERS, dumps
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes
from lmiserve.server.pipeline import respond
from lmiserve.server.responses import raw_response
from lmiserve.server.sse import keepalive

M = TypeVar("M", bound=BaseModel)
_UNION_MEMBER = re.compile(r"[\[\]]|^(str|function-\w+)$")  # pydantic's names of union members in a location
MAX_ERRORS = 3  # problems named in one message


def parse(model: type[M], payload: Any) -> M:
    """`payload` validated against `model`, else `SchemaViolation` naming each problem as Anthropic does
    (``messages.0.content: Field required``)."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        problems = []
        errors = exc.errors()
        if len(errors) > 1:  # a block list given: not also "should be a valid string" for its other choice
            errors = [e for e in errors if not e["loc"] or e["loc"][-1] != "str"] or errors
        for err in errors:
            where = ".".join(str(p) for p in err["loc"] if not _UNION_MEMBER.search(str(p)))
            problems.append(f"{where}: {err['msg']}" if where else str(err["msg"]))
        unique = list(dict.fromkeys(problems))
        more = f" (and {len(unique) - MAX_ERRORS} more)" if len(unique) > MAX_ERRORS else ""
        raise SchemaViolation("; ".join(unique[:MAX_ERRORS]) + more) from None


def _model(request: Request, name: str) -> tuple[Served, str | None]:
    """The served model and the LoRA adapter `model` names (None: the model itself); 404 otherwise."""
    model = served(request)
    return model, model.model_adapter(
        Source("model", name), not_found=lambda n: ModelNotFound(adapter.model_not_found(n))
    )


async def messages(request: Request) -> Response:
    req = parse(MessagesRequest, await json_payload(request))
    timer = Timer()
    model, lora = _model(request, req.model)
    settings = model.service.settings
    with enter(request) as slot:
        images = await model.load_images(adapter.image_sources(req))  # 400 for a model without vision
        call = await tokenizing(
            adapter.messages,
            req,
            model.limits,
            model.counter(images),
            model.render_chat,
            thinking=Thinking.of(Reasoning, settings, model.tokenizer),
            parser=model.tool_parser,
            adapter=lora,
            images=images,
        )
        model.check_tools(call.tools)
        reasoning = call.reasoning
        await prepare(model.engine, [call.call.request])  # a bad tool schema, too large: 400 before the stream
        timer.mark_validated()
        msg_id = enc.message_id()
        events = engine_events(model.engine, [call.call.request])
        if call.stream:
            stream = enc.MessageStreamEncoder(
                msg_id, call.model, call.call.input_length, tools=call.tools, reasoning=reasoning
            )
            return await respond(
                request,
                events,
                stream,
                headers={**SSE_HEADERS, "x-compute-type": model.compute_type},
                in_band=True,
                heartbeat=keepalive(settings.sse_keepalive_interval),
                on_close=slot.release,
            )
        whole = enc.MessageEncoder(msg_id, call.model, tools=call.tools, reasoning=reasoning)

        def headers() -> dict[str, str]:
            return timer.headers(model.compute_type, len(call.prompt), whole.prompt_tokens, whole.generated_tokens)

        return await respond(request, timer.watch(events), whole, headers=headers, on_close=slot.release)


async def count_tokens(request: Request) -> Response:
    req = parse(CountTokensRequest, await json_payload(request))
    model, _ = _model(request, req.model)  # an adapter counts with its model's tokenizer
    thinks = markers(model.service.settings) is not None
    images = await model.load_images(adapter.image_sources(req))  # counted as the tokens they become

    def count() -> int:
        text = adapter.prompt(req, model.render_chat, thinks=thinks, parser=model.tool_parser).text
        return model.counter(images)(text)

    return raw_response(dumps({"input_tokens": await tokenizing(count)}))


STREAM_NOTE = (
    "Server-sent events (`event:` and `data:` lines): message_start, content blocks (content_block_start, "
    "ping, content_block_delta, content_block_stop), message_delta, message_stop; a failure after the start "
    "is a last `error` event"
)
MESSAGES = apidoc.Operation(
    "Anthropic Messages (`stream: true`: Anthropic's server-sent events)",
    "Anthropic",
    apidoc.ok(
        "The message",
        {apidoc.JSON: responses.Message, **apidoc.sse(STREAM_NOTE, *responses.STREAM_EVENTS)},
    ),
    body=apidoc.json(MessagesRequest),
)
COUNT_TOKENS = apidoc.Operation(
    "The number of tokens of the prompt a Messages request would render",
    "Anthropic",
    apidoc.ok("The count", {apidoc.JSON: responses.TokenCount}),
    body=apidoc.json(CountTokensRequest),
)


def routes() -> Sequence[BaseRoute]:
    return protocol_routes(
        RENDERER,
        [
            apidoc.document(Route("/v1/messages", messages, methods=["POST"]), MESSAGES),
            apidoc.document(Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]), COUNT_TOKENS),
        ],
    )
