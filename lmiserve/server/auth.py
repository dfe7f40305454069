"""Optional API key: with `api_key` set, a guarded route (see `lmiserve.server.guard`) needs
``Authorization: Bearer <key>`` (the whole value compared case-insensitively, as TGI does), or, on the
routes of a protocol whose clients send it in a header of its own (Anthropic's ``x-api-key``: the
renderer's `key_header`), the key alone in that header; otherwise `Unauthorized`, which each protocol's
renderer answers (TGI and OpenAI: a bare 401, empty body).
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from lmiserve.core.errors import Unauthorized


def key_accepted(request: Request, key_header: str | None = None) -> bool:
    """True when no key is configured or the request carries it (in `key_header` too, when given)."""
    key = request.app.state.settings.api_key
    if not key:
        return True
    if key_header is not None and key_header in request.headers:
        return hmac.compare_digest(request.headers[key_header].encode(), key.encode())
    return bearer_matches(request.headers.get("authorization", ""), key)


def bearer_matches(given: str, key: str) -> bool:
    """Whether an ``Authorization`` value (a header, or gRPC's ``authorization`` metadata) is ``Bearer
    <key>``: the whole value compared case-insensitively, in constant time."""
    return hmac.compare_digest(given.lower().encode(), f"bearer {key}".lower().encode())


def require_api_key(request: Request, key_header: str | None = None) -> None:
    """`Unauthorized` unless the request may pass."""
    if not key_accepted(request, key_header):
        raise Unauthorized("missing or wrong API key")
