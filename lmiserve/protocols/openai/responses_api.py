"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

The request is read by `responses_request`, generated like a chat completion (admission, grammar
prepared before the answer starts, the reasoning parser), and answered by `responses_output` (whole or
as its typed event stream); finished responses asked to be stored go to `responses_store`. Errors are
OpenAI's error object (`errors.RENDERER`) before a stream starts, and ``error`` + ``response.failed``
events after. See docs/protocols/responses.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.adapters import Source
from lmiserve.core.errors import NotFound, excerpt
from lmiserve.core.tokenizer import tokenizing
from lmiserve.protocols.openai.errors import RENDERER, PreviousResponseNotFound, model_not_found
from lmiserve.protocols.openai.reasoning import Reasoning
from lmiserve.protocols.openai.responses_input import image_sources, input_items
from lmiserve.protocols.openai.responses_output import Head, ResponseEncoder, ResponseStreamEncoder
from lmiserve.protocols.openai.responses_request import ResponsesRequest, responses_call
from lmiserve.protocols.openai.responses_store import Stored, response_store
from lmiserve.protocols.textgen.admission import enter
from lmiserve.protocols.textgen.body import json_payload, parse
from lmiserve.protocols.textgen.generation import generate as engine_events
from lmiserve.protocols.textgen.generation import prepare
from lmiserve.protocols.textgen.reasoning import Thinking
from lmiserve.protocols.textgen.served import served
from lmiserve.protocols.textgen.timing import Timer
from lmiserve.protocols.textgen.wire import SSE_HEADERS, dumps
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes
from lmiserve.server.pipeline import respond
from lmiserve.server.responses import raw_response
from lmiserve.server.sse import keepalive


async def create(request: Request) -> Response:
    req = parse(ResponsesRequest, await json_payload(request))
    timer = Timer()
    model = served(request)
    lora = model.model_adapter(Source("model", req.model), not_found=model_not_found)
    store = response_store(request)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise PreviousResponseNotFound(
                f"Previous response with id '{excerpt(req.previous_response_id)}' not found."
            )
        history = previous.items
    with enter(request) as slot:
        stored = req.store and store.enabled
        images = await model.load_images(image_sources(history + input_items(req.input)))
        call = await tokenizing(
            responses_call,
            req,
            history,
            model.limits,
            model.counter(images),
            model.render_chat,
            model.service.name,
            stored=stored,
            parser=model.tool_parser,
            adapter=lora,  # the adapter `model` names (None: the base model)
            thinking=Thinking.of(Reasoning, model.service.settings, model.tokenizer),
            images=images,
        )
        model.check_tools(call.tools)
        reasoning = call.reasoning
        await prepare(model.engine, [call.call.request])  # bad grammar, too large: 4xx before the stream
        timer.mark_validated()

        def keep(response: dict[str, Any], output: list[dict[str, Any]]) -> None:
            if stored:
                store.put(Stored(response, call.items + output))

        head = Head(call.echo)
        tools = call.tools
        events = engine_events(model.engine, [call.call.request])
        if call.stream:
            return await respond(
                request,
                events,
                ResponseStreamEncoder(head, reasoning, tools, keep),
                headers={**SSE_HEADERS, "x-compute-type": model.compute_type},
                in_band=True,
                heartbeat=keepalive(model.service.settings.sse_keepalive_interval),
                on_close=slot.release,
            )
        whole = ResponseEncoder(head, reasoning, tools, keep)
        whole.characters = len(call.prompt)

        def headers() -> dict[str, str]:
            return timer.headers(model.compute_type, whole.characters, whole.prompt_tokens, whole.generated_tokens)

        return await respond(request, timer.watch(events), whole, headers=headers, on_close=slot.release)


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{excerpt(response_id)}' not found.")


async def retrieve(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = response_store(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return raw_response(dumps(stored.response))


async def delete(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not response_store(request).delete(response_id):
        raise _not_found(response_id)
    return raw_response(dumps({"id": response_id, "object": "response", "deleted": True}))


# --- the API document ---------------------------------------------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens: prompt tokens the prefix cache supplied
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens (0 without a reasoning parser)
    total_tokens: int


class ResponseObject(_Open):
    """A response (`object: "response"`); the request's parameters are echoed after `output`."""

    id: str  # resp_<32 hex>
    object: str  # response
    created_at: int
    status: str  # completed, incomplete (max_output_tokens), in_progress (stream start), failed (stream)
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[dict[str, Any]]  # message, function_call and reasoning items
    usage: ResponseUsage | None


class ResponseStreamEvent(_Open):
    """One event of a response stream (its `event:` line is its `type`)."""

    type: str  # response.created, response.output_text.delta, ..., response.completed, error
    sequence_number: int


class DeletedResponse(BaseModel):
    id: str
    object: str  # response
    deleted: bool


CREATE = apidoc.Operation(
    "Create a model response (OpenAI Responses API; `stream: true`: typed server-sent events)",
    "OpenAI",
    apidoc.ok(
        "The response",
        {
            apidoc.JSON: ResponseObject,
            **apidoc.sse(
                "`event: <type>` and `data: <JSON>` events, sequence numbers from 0, the last response.completed, "
                "response.incomplete or response.failed (after an error event)",
                ResponseStreamEvent,
            ),
        },
    ),
    body=apidoc.json(ResponsesRequest),
)
RETRIEVE = apidoc.Operation(
    "A stored response (404 when it is not stored)",
    "OpenAI",
    apidoc.ok("The response as it was answered", {apidoc.JSON: ResponseObject}),
    method="GET",
)
DELETE = apidoc.Operation(
    "Forget a stored response", "OpenAI", apidoc.ok("Deleted", {apidoc.JSON: DeletedResponse}), method="DELETE"
)


def routes() -> Sequence[BaseRoute]:
    return protocol_routes(
        RENDERER,
        [
            apidoc.document(Route("/v1/responses", create, methods=["POST"]), CREATE),
            apidoc.document(Route("/v1/responses/{response_id}", retrieve, methods=["GET"]), RETRIEVE),
            apidoc.document(Route("/v1/responses/{response_id}", delete, methods=["DELETE"]), DELETE),
        ],
    )
