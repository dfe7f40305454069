"""Reading a JSON request document that must be an object."""

from __future__ import annotations

import json
from typing import Any

from lmiserve.core.errors import MalformedBody, SchemaViolation


def load_object(body: bytes, *, failed: str, too_deep: str, not_object: str) -> dict[str, Any]:
    """The decoded object. `MalformedBody` ("<failed>: <why>", or "<failed>: <too_deep>" for a
    document nested deeper than Python can parse) for bytes that are not JSON, `SchemaViolation`
    (`not_object`) for JSON that is not an object."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedBody(f"{failed}: {exc}") from None
    except RecursionError:
        raise MalformedBody(f"{failed}: {too_deep}") from None
    if not isinstance(doc, dict):
        raise SchemaViolation(not_object)
    return doc
