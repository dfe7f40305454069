"""What the TGI and OpenAI routes share: the served model in their terms (limits, token counting),
body decoding with TGI's plain-text rejections (reference tgi-openai.md §2.1), error responses,
admission and response headers (§4.1).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from lmiserve import __version__
from lmiserve.protocols.tgi.parse import TgiError, TgiLimits, overloaded
from lmiserve.core.errors import LmiServeError, ModelNotReady
from lmiserve.protocols.tgi.encoders import error_body
from lmiserve.server.responses import raw_response
from lmiserve.models.service import ModelService, default_llm
from lmiserve.server.streaming import Admission
from lmiserve.protocols.tgi.schema import deserialize_message

PLAIN = "text/plain; charset=utf-8"


class Rejected(Exception):
    """Carries a finished response out of body decoding."""

    def __init__(self, response: Response):
        self.response = response


def tgi_limits(service: ModelService) -> TgiLimits:
    """§13.2 defaults from the settings, bounded by the model: max_total_tokens <= context length,
    max_input_tokens < max_total_tokens and <= max_input_len when that LMI option is set."""
    s = service.settings
    context = service.loaded.max_context
    total = min(s.max_total_tokens or context, context)
    max_input = s.max_input_tokens or s.max_input_len or total - 1
    if s.max_input_len:
        max_input = min(max_input, s.max_input_len)
    return TgiLimits(
        max_concurrent_requests=s.max_concurrent_requests,
        max_best_of=s.max_best_of,
        max_stop_sequences=s.max_stop_sequences,
        max_top_n_tokens=s.max_top_n_tokens,
        max_input_tokens=min(max_input, total - 1),
        max_total_tokens=total,
        max_client_batch_size=s.max_client_batch_size,
    )


@dataclass
class Served:
    """The default model, ready, seen through TGI's eyes."""

    service: ModelService
    engine: Any
    limits: TgiLimits
    tokenizer: Any
    started: float = field(default_factory=time.monotonic)

    def count_tokens(self, text: str) -> int:
        """Prompt length as the engine will see it (special tokens added)."""
        return len(self.tokenizer(text)["input_ids"])

    def special_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], *, for_engine: bool = True) -> str:
        """The chat template applied (generation prompt added). `for_engine`: without a leading BOS when
        the tokenizer adds one itself (the engine tokenizes with special tokens), so it appears once."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise TgiError("Template error: template not found", 422, "template_error")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja errors of a model's own template
            raise TgiError(f"Template error: {exc}", 422, "template_error") from None
        bos = getattr(self.tokenizer, "bos_token", None)
        if for_engine and bos and text.startswith(bos) and self._adds_bos():
            text = text[len(bos):]
        return text

    def _adds_bos(self) -> bool:
        ids = self.tokenizer("a")["input_ids"]
        return bool(ids) and ids[0] == getattr(self.tokenizer, "bos_token_id", None)

    @property
    def compute_type(self) -> str:
        """``x-compute-type``: env COMPUTE_TYPE, else from the device (TGI's default is gpu+optimized)."""
        default = "cpu" if self.service.loaded.device.type == "cpu" else "gpu+optimized"
        return os.environ.get("COMPUTE_TYPE", default)

    @property
    def system_fingerprint(self) -> str:
        return f"{__version__}-{os.environ.get('DOCKER_LABEL') or 'native'}"


def served(request: Request) -> Served:
    """The ready default model; raises TgiError 503 while it loads or after it failed."""
    service = default_llm(request)
    try:
        engine = service.ready_engine()
    except ModelNotReady as exc:
        raise TgiError(exc.message, 503, "unhealthy") from None
    return Served(service, engine, tgi_limits(service), service.loaded.tokenizer)


def admission(request: Request) -> Admission:
    state = request.app.state
    if getattr(state, "tgi_admission", None) is None:
        state.tgi_admission = Admission(state.settings.max_concurrent_requests)
    return state.tgi_admission


def enter(request: Request):
    """A release function for a free slot, else TgiError 429 ``overloaded``."""
    release = admission(request).try_enter()
    if release is None:
        raise overloaded()
    return release


def error_response(exc: LmiServeError, headers: dict | None = None) -> Response:
    kind = exc.kind if isinstance(exc, TgiError) else "generation"
    return raw_response(error_body(exc.message, kind), exc.status, headers=headers)


async def json_payload(request: Request, *, require_json: bool = True) -> Any:
    """The decoded body, or `Rejected` with TGI's plain-text 415 / 413 / 400. `require_json=False`
    (the /invocations dispatch) accepts any Content-Type and size: LMI decides about those bodies."""
    ctype = request.headers.get("content-type", "")
    if require_json and ctype.split(";")[0].strip().lower() != "application/json":
        raise Rejected(raw_response(b"Expected request with `Content-Type: application/json`", 415, PLAIN))
    if require_json:
        limit = request.app.state.settings.payload_limit
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise Rejected(_too_large())
    body = await request.body()
    if require_json and len(body) > limit:
        raise Rejected(_too_large())
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        text = f"Failed to parse the request body as JSON: {exc}"
        raise Rejected(raw_response(text.encode(), 400, PLAIN)) from None


def _too_large() -> Response:
    return raw_response(b"Failed to buffer the request body: length limit exceeded", 413, PLAIN)


def parse(model, payload: Any):
    """Validate a decoded body against a schema, or `Rejected` with TGI's plain-text 422."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise Rejected(raw_response(deserialize_message(exc).encode(), 422, PLAIN)) from None


class Timer:
    """TGI's timing headers: validation, queue (until the first token, prefill included), inference."""

    def __init__(self):
        self.start = time.monotonic()
        self.validated = self.first = self.end = self.start

    def mark_validated(self) -> None:
        self.validated = self.first = time.monotonic()

    async def watch(self, events):
        seen = False
        try:
            async for event in events:
                if not seen:
                    seen, self.first = True, time.monotonic()
                yield event
        finally:
            self.end = time.monotonic()
            await events.aclose()

    def headers(self, compute_type: str, characters: int, prompt_tokens: int, generated: int) -> dict[str, str]:
        total, inference = self.end - self.start, self.end - self.first
        ms = lambda seconds: str(int(seconds * 1000))  # noqa: E731
        return {
            "x-compute-type": compute_type,
            "x-compute-time": repr(total),
            "x-compute-characters": str(characters),
            "x-total-time": ms(total),
            "x-validation-time": ms(self.validated - self.start),
            "x-queue-time": ms(self.first - self.validated),
            "x-inference-time": ms(inference),
            "x-time-per-token": ms(inference / generated if generated else 0.0),
            "x-prompt-tokens": str(prompt_tokens),
            "x-generated-tokens": str(generated),
        }
