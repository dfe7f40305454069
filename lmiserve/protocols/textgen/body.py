"""Reading a TGI/OpenAI request body: JSON only, within the payload limit, then the route's schema.
Failures raise the neutral errors (the protocols answer them with TGI's plain-text rejections, whose
exact text is the message): `UnsupportedMediaType` (not application/json), `PayloadTooLarge`,
`MalformedBody` (not JSON), `SchemaViolation` (does not fit the schema)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from lmiserve.core import jsondoc
from lmiserve.core.errors import MalformedBody, PayloadTooLarge, SchemaViolation, UnsupportedMediaType
from lmiserve.server.guard import read_body

M = TypeVar("M", bound=BaseModel)


def _too_large() -> PayloadTooLarge:
    return PayloadTooLarge("Failed to buffer the request body: length limit exceeded")


async def json_payload(request: Request) -> Any:
    """The decoded JSON body."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaType("Expected request with `Content-Type: application/json`")
    body = await read_body(request, request.app.state.settings.payload_limit, _too_large)
    try:
        return jsondoc.loads(body)
    except ValueError as exc:  # not UTF-8, not JSON, too deep, a lone surrogate: jsondoc's message
        raise MalformedBody(f"Failed to parse the request body as JSON: {exc}") from None


def parse(model: type[M], payload: Any) -> M:
    """`payload` validated against `model`, else `SchemaViolation`."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise SchemaViolation(deserialize_message(exc)) from None


def parse_strict(model: type[M], payload: Any, prefix: str = "") -> M:
    """`payload` validated against `model` (whose unknown fields are refused), else `SchemaViolation`
    naming each field that does not fit once (an unknown one as such), after `prefix`."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "body"
            parts.append(f"{where}: {'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}")
        raise SchemaViolation(prefix + "; ".join(dict.fromkeys(parts))) from None


def deserialize_message(exc: ValidationError) -> str:
    """The pydantic error as one line, after TGI's ``Failed to deserialize ...`` prefix."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "Failed to deserialize the JSON body into the target type: " + "; ".join(parts)
