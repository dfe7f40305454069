"""Optional API key (reference tgi-openai.md §2): with `api_key` set, generation routes need
``Authorization: Bearer <key>`` (the whole value compared case-insensitively, as TGI does) and
answer a bare 401 with an empty body otherwise. Health, info and model listings stay open.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.responses import Response


def rejected(request: Request) -> Response | None:
    """None when the request may pass, else the 401 to send."""
    key = request.app.state.settings.api_key
    if not key:
        return None
    given = request.headers.get("authorization", "")
    if hmac.compare_digest(given.lower().encode(), f"bearer {key}".lower().encode()):
        return None
    return Response(status_code=401)
