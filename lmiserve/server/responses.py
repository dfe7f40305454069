"""Responses with exact bytes: the one helper every route answers through."""

from __future__ import annotations

from starlette.responses import Response

JSON = "application/json"


def raw_response(body: bytes, status: int = 200, content_type: str = JSON, headers: dict | None = None) -> Response:
    """Exact bytes with exactly this Content-Type (starlette would append a charset to text/* types)."""
    return Response(body, status_code=status, headers={"content-type": content_type, **(headers or {})})
