"""Optional API key: with `api_key` set, generation routes need ``Authorization: Bearer <key>`` (the
whole value compared case-insensitively, as TGI does); otherwise `Unauthorized`, which the TGI and
OpenAI renderers answer with a bare 401 and an empty body. Health, info and model listings stay open.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.responses import Response

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


def rejected(request: Request) -> Response | None:
    """None when the request may pass, else the bare 401 to send (for callers outside a route group
    whose renderer answers `Unauthorized`)."""
    return None if key_accepted(request) else Response(status_code=401)
