"""A sequence's tokens -> OpenAI Responses API output items and the stream events that build them
(`OutputBuilder`); the whole answer is the same builder's final items, so a streamed response ends with
exactly the items a non-streamed one has (responses_output.py writes them).

Output items, in the order they are generated:

- ``reasoning`` (with a reasoning parser, `openai.reasoning`): ``{"type": "reasoning", "id": "rs_...",
  "summary": [], "content": [{"type": "reasoning_text", "text"}], "status"}``;
- ``message``: ``{"type": "message", "id": "msg_...", "status", "role": "assistant", "content":
  [{"type": "output_text", "text", "annotations": [], "logprobs": []}]}``; a response with no other
  item has an (empty) message;
- ``function_call`` (active tools, `openai.tool_calls` reads the answer): ``{"type": "function_call",
  "id": "fc_...", "call_id": "call_...", "name", "arguments": "<JSON text>", "status"}``.

An item's ``status`` is ``completed``, or ``incomplete`` for the item ``max_output_tokens`` cut (a cut
call keeps the arguments generated so far).

Events per item: ``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``; for
reasoning the same with ``response.reasoning_text.delta`` / ``.done``; for a call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``; then
``response.output_item.done``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from lmiserve.protocols.openai.reasoning import Reasoning, Splitter
from lmiserve.protocols.openai.tool_calls import new_call_id
from lmiserve.protocols.textgen.tools.output import Arguments, CallStart, Content, Piece
from lmiserve.protocols.textgen.tools.parsers import CallReader
from lmiserve.protocols.textgen.tools.spec import ToolSpec

__all__ = ["Event", "OutputBuilder", "new_id"]

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """A new object id as OpenAI spells them: ``resp_``, ``msg_``, ``rs_``, ``fc_`` + 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """One sequence's text, token by token, as output items and the stream events that build them."""

    def __init__(self, reasoning: Reasoning | None, tools: ToolSpec | None, call_ids: Callable[[], str] | None = None):
        self.items: list[dict[str, Any]] = []
        self.events: list[Event] = []  # not yet taken (`take`)
        self.splitter: Splitter | None = reasoning.splitter() if reasoning is not None else None
        self.tools: CallReader | None = tools.reader() if tools is not None else None
        self.call_ids = call_ids or (tools.format.call_id if tools is not None else new_call_id)
        # the format's markers are special tokens (`[TOOL_CALLS]`): their text is read too
        self.special = tools is not None and tools.format.reads_special_tokens
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # the tool output's call index -> its item

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.tokens if self.splitter is not None else 0

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    # --- reading ------------------------------------------------------------------------------------

    def token(self, text: str, special: bool) -> None:
        """One generated token's text."""
        if self.splitter is not None:
            thought, answer = self.splitter.token(self._readable(text, special))
            self._thought(thought)
        else:
            answer = self._readable(text, special)
        self._answer(answer)

    def _readable(self, text: str, special: bool) -> str:
        """A token's text as the answer's reader takes it (a special token's only when the format has some)."""
        return "" if special and self.tools is not None and not self.special else text

    def finish(self, incomplete: bool) -> None:
        """The sequence ended: what was held back, then every open item closed."""
        if self.splitter is not None:
            thought, answer = self.splitter.flush()
            self._thought(thought)
            self._answer(answer)
        if self.tools is not None:
            self._pieces(self.tools.finish())
        status = "incomplete" if incomplete else "completed"
        if self._reasoning is not None:
            self._close_reasoning(status)
        if self._message is not None:
            self._close_message(status)
        for item in self._calls.values():
            if not item["_done"]:
                item["status"] = "incomplete"
                self._done(item)
        if not self.items:  # nothing at all was generated: an empty message, as OpenAI answers
            self._text("", force=True)
            self._close_message(status)

    def _thought(self, text: str) -> None:
        if not text:
            return
        if self._reasoning is None:
            item: dict[str, Any] = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self._reasoning = self._add(item)
            self._event(
                "response.content_part.added", item, content_index=0, part={"type": "reasoning_text", "text": ""}
            )
            item["_text"] = ""
        item = self._reasoning
        item["_text"] += text
        self._event("response.reasoning_text.delta", item, content_index=0, delta=text)

    def _answer(self, text: str) -> None:
        if not text:
            return
        if self._reasoning is not None:
            self._close_reasoning("completed")
        if self.tools is None:
            self._text(text)
        else:
            self._pieces(self.tools.feed(text))

    def _pieces(self, pieces: list[Piece]) -> None:
        assert self.tools is not None
        for piece in pieces:
            if isinstance(piece, Content):
                self._text(piece.text)
            elif isinstance(piece, CallStart):
                item: dict[str, Any] = {
                    "id": new_id("fc"),
                    "type": "function_call",
                    "status": "in_progress",
                    "arguments": "",
                    "call_id": self.call_ids(),
                    "name": piece.name,
                }
                self._calls[piece.index] = self._add(item)
            elif isinstance(piece, Arguments):
                call = self._calls[piece.index]
                call["arguments"] += piece.text
                self._event("response.function_call_arguments.delta", call, delta=piece.text)
        for complete in self.tools.calls:
            done = self._calls.get(complete.index)
            if done is not None and not done["_done"]:
                done["arguments"], done["status"] = complete.arguments, "completed"
                self._event("response.function_call_arguments.done", done, arguments=done["arguments"])
                self._done(done)

    def _text(self, text: str, *, force: bool = False) -> None:
        if not text and not force:
            return
        if self._message is None:
            item: dict[str, Any] = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "content": [],
                "role": "assistant",
            }
            self._message = self._add(item)
            self._event("response.content_part.added", item, content_index=0, part=_output_text(""))
            item["_text"] = ""
        item = self._message
        if text:
            item["_text"] += text
            self._event("response.output_text.delta", item, content_index=0, delta=text, logprobs=[])

    # --- items --------------------------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        """A new item (`_index`: its output index; `_done`: its `output_item.done` was sent)."""
        self.events.append(
            {"type": "response.output_item.added", "output_index": len(self.items), "item": _public(item)}
        )
        item["_index"], item["_done"] = len(self.items), False
        self.items.append(item)
        return item

    def _event(self, kind: str, item: dict[str, Any], **fields: Any) -> None:
        self.events.append({"type": kind, "item_id": item["id"], "output_index": item["_index"], **fields})

    def _done(self, item: dict[str, Any]) -> None:
        item["_done"] = True
        self.events.append({"type": "response.output_item.done", "output_index": item["_index"], "item": _public(item)})

    def _close_reasoning(self, status: str) -> None:
        item, self._reasoning = self._reasoning, None
        assert item is not None
        text = item.pop("_text")
        part = {"type": "reasoning_text", "text": text}
        self._event("response.reasoning_text.done", item, content_index=0, text=text)
        self._event("response.content_part.done", item, content_index=0, part=part)
        item["content"], item["status"] = [part], status
        self._done(item)

    def _close_message(self, status: str) -> None:
        item, self._message = self._message, None
        assert item is not None
        text = item.pop("_text")
        self._event("response.output_text.done", item, content_index=0, text=text, logprobs=[])
        self._event("response.content_part.done", item, content_index=0, part=_output_text(text))
        item["content"], item["status"] = [_output_text(text)], status
        self._done(item)

    def output(self) -> list[dict[str, Any]]:
        """The items as the response object lists them."""
        return [_public(item) for item in self.items]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _public(item: dict[str, Any]) -> dict[str, Any]:
    """A copy of an item as sent (without the builder's own keys), taken now."""
    out = {k: v for k, v in item.items() if not k.startswith("_")}
    if out["type"] == "function_call":  # OpenAI's key order
        out = {k: out[k] for k in ("id", "type", "status", "arguments", "call_id", "name")}
    elif "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
