"""TRANSITIONAL: how /invocations hands chat, completion and TGI-compat bodies to those protocols
until `lmiserve/server/invocations.py` does it (delete this module then, and
`lmiserve.protocols.openai.routes.dispatch_invocation`).

A `messages` body is a chat completion, a `prompt` body a completion, and with tgi_compat an `inputs`
body on /invocations is TGI's POST /; None leaves the request to LMI. The API key applies to every form.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from lmiserve.protocols.openai import routes as openai_routes
from lmiserve.protocols.tgi import routes as tgi_routes
from lmiserve.server import auth


async def dispatch(request: Request) -> Response | None:
    if (denied := auth.rejected(request)) is not None:
        return denied
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method != "POST" or ctype not in ("", "application/json"):
        return None
    try:
        payload = json.loads(await request.body())
    except (ValueError, RecursionError):
        return None  # not JSON: LMI decides (text/plain, its own parse errors)
    if not isinstance(payload, dict):
        return None
    if "messages" in payload:
        return await openai_routes.invoke(request, payload, chat=True)
    if "prompt" in payload and "inputs" not in payload:
        return await openai_routes.invoke(request, payload, chat=False)
    settings = request.app.state.settings
    params = payload.get("parameters")
    lmi_formatter = isinstance(params, dict) and params.get("output_formatter")
    if "inputs" in payload and settings.tgi_compat and request.url.path == "/invocations" and not lmi_formatter:
        return await tgi_routes.invoke_compat(request, payload)
    return None
