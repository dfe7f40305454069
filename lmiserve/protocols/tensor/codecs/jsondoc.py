"""Reading a JSON request document that must be an object."""

from __future__ import annotations

from typing import Any

from lmiserve.core import jsondoc
from lmiserve.core.errors import MalformedBody, SchemaViolation


def load_object(body: bytes, *, failed: str, not_object: str) -> dict[str, Any]:
    """The decoded object (read by `lmiserve.core.jsondoc`). `MalformedBody` ("<failed>: <why>") for
    bytes that are not UTF-8 JSON, nested too deeply or holding a lone surrogate, `SchemaViolation`
    (`not_object`) for JSON that is not an object."""
    try:
        doc = jsondoc.loads(body)
    except ValueError as exc:
        raise MalformedBody(f"{failed}: {exc}") from None
    if not isinstance(doc, dict):
        raise SchemaViolation(not_object)
    return doc
