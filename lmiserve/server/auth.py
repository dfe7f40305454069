"""Optional API key: with `api_key` set, a guarded route (see `lmiserve.server.guard`) needs
``Authorization: Bearer <key>`` (the whole value compared case-insensitively, as TGI does); otherwise
`Unauthorized`, which each protocol's renderer answers (TGI and OpenAI: a bare 401, empty body).
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from lmiserve.core.errors import Unauthorized


def key_accepted(request: Request) -> bool:
    """True when no key is configured or the request carries it."""
    key = request.app.state.settings.api_key
    if not key:
        return True
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.lower().encode(), f"bearer {key}".lower().encode())


def require_api_key(request: Request) -> None:
    """`Unauthorized` unless the request may pass."""
    if not key_accepted(request):
        raise Unauthorized("missing or wrong API key")
