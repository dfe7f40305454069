"""Engine events -> OpenAI Responses API objects: the whole response (JSON) or its typed event stream.
The output items and their events are built by `responses_items.OutputBuilder`.

The response's ``status`` is ``completed`` or ``incomplete`` with ``incomplete_details: {"reason":
"max_output_tokens"}``.

Stream (``event: <type>`` then ``data: <JSON>``, each with the next ``sequence_number`` from 0; no
``[DONE]``): ``response.created``, ``response.in_progress``; the events of every item
(responses_items.py); last ``response.completed`` or ``response.incomplete`` with the whole response. A
failure after the stream started is an ``error`` event and then ``response.failed`` (``status:
"failed"``, ``error: {code, message}``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmiserve.core.errors import IncompleteGeneration, LmiServeError
from lmiserve.core.events import Finish, FinishReason, StepEvent
from lmiserve.protocols.openai.errors import RENDERER
from lmiserve.protocols.openai.reasoning import Reasoning
from lmiserve.protocols.openai.responses_items import Event, OutputBuilder, new_id
from lmiserve.protocols.textgen.tools.spec import ToolSpec
from lmiserve.protocols.textgen.wire import SSE_CONTENT_TYPE, dumps

# where the echoed request fields go in the response object (OpenAI's order; the rest between output and usage)
ECHO_BEFORE_OUTPUT = ("instructions", "max_output_tokens", "max_tool_calls", "model")
ECHO_LAST = ("user", "metadata")


@dataclass
class Head:
    """What every response object of one request shares: its id, creation time and the echoed request."""

    echo: dict[str, Any]
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        *,
        incomplete: bool = False,
        error: dict[str, Any] | None = None,
        completed_at: int | None = None,
    ) -> dict[str, Any]:
        """The response object, OpenAI's fields in OpenAI's order."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": completed_at,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        }
        for key in ECHO_BEFORE_OUTPUT:
            body[key] = self.echo[key]
        body["output"] = output
        for key, value in self.echo.items():
            if key not in ECHO_BEFORE_OUTPUT and key not in ECHO_LAST:
                body[key] = value
        body["usage"] = usage
        for key in ECHO_LAST:
            body[key] = self.echo[key]
        return body


def usage(finish: Finish, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": finish.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens},
        "output_tokens": finish.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": finish.prompt_tokens + finish.generated_tokens,
    }


def error_code(exc: LmiServeError) -> str:
    """The response object's ``error.code`` for a failure (OpenAI's codes)."""
    status = RENDERER.status(exc)
    if status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= status < 500 else "server_error"


# --- encoders (lmiserve.server.pipeline.Encoder) -----------------------------------------------------

Finished = Callable[[dict[str, Any], list[dict[str, Any]]], None]  # (response object, output items)


class _Base:
    def __init__(
        self, head: Head, reasoning: Reasoning | None, tools: ToolSpec | None, on_finished: Finished | None = None
    ):
        self.head = head
        self.builder = OutputBuilder(reasoning, tools)
        self.on_finished = on_finished
        self.finish: Finish | None = None
        self.prompt_tokens = self.generated_tokens = self.characters = 0

    def _feed(self, event: StepEvent) -> None:
        if event.token is not None:
            self.builder.token(event.token.text, event.token.special)
        if event.finish is not None and self.finish is None:
            self.finish = event.finish
            self.builder.finish(event.finish.reason is FinishReason.LENGTH)

    def _final(self) -> dict[str, Any]:
        """The finished response object (kept by `on_finished`)."""
        finish = self.finish
        assert finish is not None
        self.prompt_tokens, self.generated_tokens = finish.prompt_tokens, finish.generated_tokens
        incomplete = finish.reason is FinishReason.LENGTH
        output = self.builder.output()
        body = self.head.response(
            "incomplete" if incomplete else "completed",
            output,
            usage(finish, self.builder.reasoning_tokens),
            incomplete=incomplete,
            completed_at=None if incomplete else int(time.time()),
        )
        if self.on_finished is not None:
            self.on_finished(body, output)
        return body


class ResponseEncoder(_Base):
    """The whole response object."""

    content_type = "application/json"
    streaming = False

    def on_event(self, index: int, event: StepEvent) -> bytes:
        self._feed(event)
        self.builder.take()
        return b""

    def close(self) -> bytes:
        if self.finish is None:
            raise IncompleteGeneration("Incomplete generation")
        return dumps(self._final())

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.body(exc)


class ResponseStreamEncoder(_Base):
    """The typed event stream (see the module docstring)."""

    content_type = SSE_CONTENT_TYPE
    streaming = True

    def __init__(
        self, head: Head, reasoning: Reasoning | None, tools: ToolSpec | None, on_finished: Finished | None = None
    ):
        super().__init__(head, reasoning, tools, on_finished)
        self.sequence = 0
        self.started = self.ended = False

    def _sse(self, event: Event) -> bytes:
        body = {"type": event["type"], **{k: v for k, v in event.items() if k != "type"}}
        body["sequence_number"] = self.sequence
        self.sequence += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + dumps(body) + b"\n\n"

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        snapshot = self.head.response("in_progress", [])
        return self._sse({"type": "response.created", "response": snapshot}) + self._sse(
            {"type": "response.in_progress", "response": snapshot}
        )

    def on_event(self, index: int, event: StepEvent) -> bytes:
        if self.ended:
            return b""
        head = self._start()
        self._feed(event)
        chunks = [self._sse(e) for e in self.builder.take()]
        if self.finish is not None:
            self.ended = True
            body = self._final()
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            chunks.append(self._sse({"type": kind, "response": body}))
        return head + b"".join(chunks)

    def close(self) -> bytes:
        if not self.ended:
            raise IncompleteGeneration("Incomplete generation")
        return b""

    def error(self, exc: LmiServeError) -> bytes:
        self.ended = True
        head = self._start()
        detail = RENDERER.error(exc)["error"]
        error_event = {"type": "error", "code": detail["code"] or detail["type"], "message": detail["message"]}
        error_event["param"] = detail["param"]
        failed = self.head.response(
            "failed", self.builder.output(), error={"code": error_code(exc), "message": detail["message"]}
        )
        return head + self._sse(error_event) + self._sse({"type": "response.failed", "response": failed})
