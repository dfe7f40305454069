"""The one dispatcher of /invocations, /predictions/{m}[/{v}] and /models/{m}/invoke.

These routes take OpenAI, TGI, SageMaker and LMI bodies. `decode` reads the request once and says
which one it is, as an `Invocation`: `JsonBody`, `SageMakerRecords` or `LmiPayload`, each tagged with
its `Kind`; `HANDLERS` maps each kind to its protocol's handler, which takes the decoded payload and
whose errors its protocol's renderer answers. The protocols do not know each
other: what one lends another (LMI's requests for SageMaker's JSON Lines lines, TF Serving's
documents for SageMaker) is wired here.

Precedence (first match wins):
1. OPTIONS -> ``{}`` (no API key asked); every other method needs the API key (`server.guard`; LMI's
   renderer answers a bare 401, as TGI does on its /invocations);
2. a POST whose Content-Type is absent or application/json and whose body is a JSON object:
   `messages` -> OpenAI chat completion; `prompt` without `inputs` -> OpenAI completion; `inputs` on
   /invocations with tgi_compat and no LMI `parameters.output_formatter` -> TGI's POST /;
3. on /invocations only, SageMaker, for the model named by the custom attribute `tfs-model-name`
   (else `model_name` from the query or a header, else the default model; a name that is not served
   is LMI's 404 naming it, whatever the body; no default model leaves the request to LMI): the media
   type is that of Content-Type (or ContentType), JSON when absent;
   - an LLM: JSON Lines (unless the whole body is one JSON object asking to `stream`) and CSV;
   - a one-shot model: anything but text/plain and a JSON object with `inputs` (LMI's payloads);
   On these routes LMI's ways to name a LoRA adapter apply to OpenAI and TGI bodies that name none
   themselves: the `adapter` query parameter, then SageMaker's ``X-Amzn-SageMaker-Adapter-Identifier``
   header (read as OpenAI's `model` or TGI's `parameters.adapter_id`); a TGI body's LMI `adapters` field
   first (it wins over `parameters.adapter_id`, as in LMI's bodies). `decode` finds them once
   (`Elsewhere`) and the handler's protocol picks the adapter (`select_adapter`); no body is rewritten;
4. LMI, for the model named by the path, else `model_name` from the query or a header, else
   `tfs-model-name` (on /invocations), else the default model: it must exist (404 / 400) and be
   ready (503); the body is decoded as LMI does (424 if that fails); then a one-shot model, dynamic
   batching or the rolling batch (each input's LoRA adapter: the body's `adapters`, else
   `parameters.adapter_id`, else the `adapter` query parameter, else SageMaker's adapter header).
Only steps 3 (an unknown model name) and 4 fail while decoding; LMI's renderer answers those errors.
Every handler's errors are answered by its protocol (the OpenAI and TGI entry points answer their own).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core import jsondoc
from lmiserve.core.adapters import Elsewhere, Source
from lmiserve.core.errors import LmiServeError, ModelNotFound
from lmiserve.models.service import ModelService
from lmiserve.protocols.lmi import lines as lmi_lines
from lmiserve.protocols.lmi import parse as lmi_parse
from lmiserve.protocols.lmi import routes as lmi
from lmiserve.protocols.lmi import schema as lmi_schema
from lmiserve.protocols.lmi.errors import RENDERER as LMI_ERRORS
from lmiserve.protocols.openai import responses as openai_responses
from lmiserve.protocols.openai import routes as openai
from lmiserve.protocols.openai import schema as openai_schema
from lmiserve.protocols.openai.errors import RENDERER as OPENAI_ERRORS
from lmiserve.protocols.tensor.sagemaker import parse as sagemaker_parse
from lmiserve.protocols.tensor.sagemaker import routes as sagemaker
from lmiserve.protocols.tensor.sagemaker import schema as sagemaker_schema
from lmiserve.protocols.tensor.sagemaker.errors import RENDERER as SAGEMAKER_ERRORS
from lmiserve.protocols.tensor.tfserving import parse as tfserving_parse
from lmiserve.protocols.tgi import responses as tgi_responses
from lmiserve.protocols.tgi import routes as tgi
from lmiserve.protocols.tgi.errors import RENDERER as TGI_ERRORS
from lmiserve.server import apidoc
from lmiserve.server.errors import ErrorRenderer, protocol_routes, rendered_by
from lmiserve.server.lookup import model_service
from lmiserve.server.responses import raw_response


class Kind(Enum):
    CHAT = "chat"  # an OpenAI chat completion body
    COMPLETION = "completion"  # an OpenAI completion body
    TGI_COMPAT = "tgi_compat"  # TGI's POST / body (tgi_compat)
    SAGEMAKER_LLM = "sagemaker_llm"  # SageMaker JSON Lines / CSV records for an LLM
    SAGEMAKER_TENSOR = "sagemaker_tensor"  # SageMaker JSON / JSON Lines / CSV records for a one-shot model
    LMI_ROLLING = "lmi_rolling"  # an LMI text-generation request (continuous batching)
    LMI_DYNAMIC_BATCH = "lmi_dynamic_batch"  # an LMI request under rolling_batch=disable
    LMI_TENSOR = "lmi_tensor"  # an LMI payload for a one-shot model


@dataclass(frozen=True)
class JsonBody:
    """An OpenAI or TGI request: the body's JSON object, and where it names a LoRA adapter outside it."""

    kind: Kind  # CHAT, COMPLETION or TGI_COMPAT
    doc: dict
    elsewhere: Elsewhere


@dataclass(frozen=True)
class SageMakerRecords:
    """A SageMaker request: the addressed model and the body, read by SageMaker's handler."""

    kind: Kind  # SAGEMAKER_LLM or SAGEMAKER_TENSOR
    service: ModelService
    records: sagemaker.Records


@dataclass(frozen=True)
class LmiPayload:
    """An LMI request: the addressed (ready) model and the payload as LMI decodes the body."""

    kind: Kind  # LMI_ROLLING, LMI_DYNAMIC_BATCH or LMI_TENSOR
    service: ModelService
    payload: Any
    elsewhere: Elsewhere  # the adapter the query parameter or SageMaker's header names


Invocation = JsonBody | SageMakerRecords | LmiPayload


class Body:
    """The request body, read once; its JSON parsed at most once (on demand)."""

    def __init__(self, raw: bytes):
        self.raw = raw
        self._doc: Any = None
        self._error: Exception | None = None
        self._parsed = False

    def json(self) -> Any:
        """``jsondoc.loads(raw)``; raises what it raised (a ValueError), every time."""
        if not self._parsed:
            self._parsed = True
            try:
                self._doc = jsondoc.loads(self.raw)
            except ValueError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._doc

    def json_or_none(self) -> Any:
        """The JSON document, or None when the body is not JSON."""
        try:
            return self.json()
        except ValueError:
            return None


async def invocations(request: Request) -> Response:
    """Steps 3-4 of `decode` fail; the route group's renderer is LMI's (see `routes`)."""
    invocation = await decode(request)
    return await HANDLERS[invocation.kind](request, invocation)


async def options(request: Request) -> Response:
    return raw_response(b"{}")


async def decode(request: Request) -> Invocation:
    """The request as one `Invocation` (see the module docstring for the precedence). Raises LMI's
    errors: unknown or ambiguous model, model not ready, a body LMI cannot decode."""
    body = Body(await request.body())
    if _json_post(request):
        doc = body.json_or_none()
        if isinstance(doc, dict):
            if "messages" in doc:
                return JsonBody(Kind.CHAT, doc, _elsewhere(request))
            if "prompt" in doc and "inputs" not in doc:
                return JsonBody(Kind.COMPLETION, doc, _elsewhere(request))
            if "inputs" in doc and _tgi_compat(request, doc):
                return JsonBody(
                    Kind.TGI_COMPAT, doc, _elsewhere(request, lmi_parse.adapters_source(doc.get("adapters")))
                )
    if request.url.path == "/invocations":
        found = _sagemaker(request, body)
        if found is not None:
            return found
    return _lmi(request, body)


def _elsewhere(request: Request, first: Source | None = None) -> Elsewhere:
    """Where the request names a LoRA adapter outside its protocol's field: `first` before it (LMI's
    `adapters` on a TGI body), then the `adapter` query parameter and SageMaker's adapter header after it."""
    query = Source(lmi_parse.ADAPTER_QUERY, request.query_params.get(lmi_parse.ADAPTER_QUERY))
    header = Source(lmi_parse.SAGEMAKER_ADAPTER_HEADER, request.headers.get(lmi_parse.SAGEMAKER_ADAPTER_HEADER))
    return Elsewhere(first, (query, header))


def _json_post(request: Request) -> bool:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return request.method == "POST" and media in ("", "application/json")


def _tgi_compat(request: Request, doc: dict) -> bool:
    """TGI's POST / on /invocations with tgi_compat, unless the body names an LMI output formatter."""
    params = doc.get("parameters")
    lmi_formatter = isinstance(params, dict) and params.get("output_formatter")
    return bool(request.app.state.settings.tgi_compat and request.url.path == "/invocations" and not lmi_formatter)


def _sagemaker(request: Request, body: Body) -> SageMakerRecords | None:
    attributes = sagemaker_parse.custom_attributes(request.headers.get(sagemaker_parse.CUSTOM_ATTRIBUTES))
    name = _tfs_model_name(request) or request.query_params.get("model_name") or request.headers.get("model_name")
    try:
        service = model_service(request, name)
    except ModelNotFound:  # a model named but not served: a 404 naming it (LMI's shape), whatever the body
        raise
    except LmiServeError:  # no name and no default model: LMI answers it in its own shape
        return None
    header = request.headers.get("content-type") or request.headers.get("contenttype")
    media, _ = sagemaker_parse.content_type(header)
    if service.is_llm:
        if media not in (sagemaker_parse.JSONLINES, sagemaker_parse.CSV) or _lmi_stream(media, body):
            return None
        kind = Kind.SAGEMAKER_LLM
    else:
        if media == "text/plain" or (
            media == sagemaker_parse.JSON and sagemaker_parse.is_lmi_document(body.json_or_none())
        ):
            return None  # LMI's own payloads stay LMI's
        kind = Kind.SAGEMAKER_TENSOR
    return SageMakerRecords(kind, service, sagemaker.Records(body.raw, header, attributes))


def _tfs_model_name(request: Request) -> str | None:
    """The model SageMaker's custom attribute `tfs-model-name` names (on /invocations only)."""
    if request.url.path != "/invocations":
        return None
    attributes = sagemaker_parse.custom_attributes(request.headers.get(sagemaker_parse.CUSTOM_ATTRIBUTES))
    return attributes.get("tfs-model-name") or None


def _lmi_stream(media: str, body: Body) -> bool:
    """A JSON Lines body that is one JSON object asking to stream is an LMI streaming request."""
    doc = body.json_or_none() if media == sagemaker_parse.JSONLINES else None
    return isinstance(doc, dict) and doc.get("stream") is True


def _lmi(request: Request, body: Body) -> LmiPayload:
    name = (
        request.path_params.get("model_name")
        or request.query_params.get("model_name")
        or request.headers.get("model_name")
        or _tfs_model_name(request)
    )
    service = model_service(request, name)
    service.ready_engine()
    payload = lmi_parse.decode_body(body.raw, request.headers.get("content-type"), load=body.json)
    if not service.is_llm:
        kind = Kind.LMI_TENSOR
    elif service.dynamic_batching:
        kind = Kind.LMI_DYNAMIC_BATCH
    else:
        kind = Kind.LMI_ROLLING
    return LmiPayload(kind, service, payload, _elsewhere(request))


# ---- the handlers of each kind ---------------------------------------------------------------------
# OpenAI and TGI answer their own errors (their entry points return a response); SageMaker's and LMI's
# handlers raise, and their protocol's renderer answers (LMI's names the model of a full job queue).


async def _chat(request: Request, invocation: JsonBody) -> Response:
    return await openai.invoke(request, invocation.doc, chat=True, elsewhere=invocation.elsewhere)


async def _completion(request: Request, invocation: JsonBody) -> Response:
    return await openai.invoke(request, invocation.doc, chat=False, elsewhere=invocation.elsewhere)


async def _tgi_compat_body(request: Request, invocation: JsonBody) -> Response:
    return await tgi.invoke_compat(request, invocation.doc, invocation.elsewhere)


async def _sagemaker_llm(request: Request, invocation: SageMakerRecords) -> Response:
    answer = functools.partial(sagemaker.invoke_llm, request, invocation.service, invocation.records, lmi_lines)
    return await _rendered(request, SAGEMAKER_ERRORS, answer)


async def _sagemaker_tensor(request: Request, invocation: SageMakerRecords) -> Response:
    answer = functools.partial(
        sagemaker.invoke_tensor, request, invocation.service, invocation.records, tfserving_parse
    )
    return await _rendered(request, SAGEMAKER_ERRORS, answer)


LmiHandler = Callable[[Request, ModelService, Any, Elsewhere], Awaitable[Response]]


def _lmi_handler(handler: LmiHandler) -> Callable[[Request, LmiPayload], Awaitable[Response]]:
    async def run(request: Request, invocation: LmiPayload) -> Response:
        answer = functools.partial(handler, request, invocation.service, invocation.payload, invocation.elsewhere)
        return await _rendered(request, LMI_ERRORS.for_model(invocation.service.name), answer)

    return run


async def _rendered(request: Request, renderer: ErrorRenderer, answer: Callable[[], Awaitable[Response]]) -> Response:
    """`answer()`, its lmiserve errors answered by `renderer`."""

    async def endpoint(_: Request) -> Response:
        return await answer()

    return await rendered_by(renderer, endpoint)(request)


HANDLERS: dict[Kind, Callable[[Request, Any], Awaitable[Response]]] = {
    Kind.CHAT: _chat,
    Kind.COMPLETION: _completion,
    Kind.TGI_COMPAT: _tgi_compat_body,
    Kind.SAGEMAKER_LLM: _sagemaker_llm,
    Kind.SAGEMAKER_TENSOR: _sagemaker_tensor,
    Kind.LMI_ROLLING: _lmi_handler(lmi.rolling),
    Kind.LMI_DYNAMIC_BATCH: _lmi_handler(lmi.dynamic_batch),
    Kind.LMI_TENSOR: _lmi_handler(lmi.one_shot),
}

INFER = ["GET", "POST", "PUT"]  # LMI accepts any method on inference routes (and OPTIONS, answered `{}`)
PATHS = [
    "/invocations",
    "/predictions/{model_name}",
    "/predictions/{model_name}/{version}",
    "/models/{model_name}/invoke",
]


# --- the API document: every body the dispatcher takes, every answer its handlers give ----------------

_REQUEST = {
    apidoc.JSON: lmi_schema.LmiRequest | openai_schema.ChatRequest | openai_schema.CompletionRequest,
    sagemaker_parse.JSONLINES: apidoc.STRING,
    sagemaker_parse.CSV: apidoc.STRING,
    apidoc.TEXT: apidoc.STRING,
}
_ANSWER = {
    apidoc.JSON: lmi_schema.LmiAnswer
    | list[lmi_schema.LmiAnswer]
    | openai_responses.ChatCompletion
    | openai_responses.Completion
    | list[tgi_responses.GenerateResponse]
    | sagemaker_schema.Predictions
    | list[Any],
    sagemaker_parse.JSONLINES: apidoc.Events(
        "JSON Lines: LMI's stream (one record per token), or SageMaker's answer (one object per record)",
        lmi_schema.LmiStreamRecord,
    ),
    **apidoc.sse(
        "Server-sent events: LMI's `sse` formatter, or the OpenAI or TGI stream",
        lmi_schema.LmiStreamRecord,
        openai_responses.ChatCompletionChunk,
        openai_responses.Completion,
        openai_responses.OpenAIStreamError,
        tgi_responses.StreamResponse,
        tgi_responses.TgiStreamError,
        done=True,
    ),
    sagemaker_parse.CSV: apidoc.STRING,
}
_DESCRIPTION = (
    "One route for every body: an OpenAI chat (`messages`) or completion (`prompt`) body is answered as "
    "/v1/chat/completions or /v1/completions; with tgi_compat, an `inputs` body on /invocations as TGI's "
    "POST /; SageMaker's JSON Lines and CSV records (Content-Type) on /invocations; anything else is "
    "LMI's request (`inputs`, `parameters`, `stream`) for the model the path, the `model_name` query "
    "parameter or header names. Each answers in its protocol's shapes."
)


def _infer_doc(method: str) -> apidoc.Operation:
    return apidoc.Operation(
        "Run the model (LMI, OpenAI, TGI or SageMaker body)",
        "LMI",
        apidoc.ok("The answer", _ANSWER),
        body=_REQUEST,
        description=_DESCRIPTION,
        method=method,
        params=[apidoc.Param("model_name", "The model to run (default: the served model)")],
        errors=[OPENAI_ERRORS, TGI_ERRORS, SAGEMAKER_ERRORS],
    )


_OPTIONS = apidoc.Operation("CORS preflight", "LMI", apidoc.ok("`{}`", apidoc.json({"type": "object"})))


def routes() -> list[BaseRoute]:
    """The inference routes (right after /ping, before the management API's /models routes)."""
    return protocol_routes(
        LMI_ERRORS,
        [apidoc.document(Route(path, invocations, methods=INFER), *map(_infer_doc, INFER)) for path in PATHS],
        public=[apidoc.document(Route(path, options, methods=["OPTIONS"]), _OPTIONS) for path in PATHS],
    )
