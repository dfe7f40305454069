"""The Responses API's stored responses: a bounded in-memory LRU, one per server.

A response asked to be stored (``store``, true unless the request says false) is kept once it has
finished (completed or incomplete; a failed or abandoned one is not), with the conversation it ends:
the items it was given (those of its `previous_response_id` first) and its output items. A later
request's `previous_response_id` continues that conversation; ``GET /v1/responses/{id}`` answers the
response object again and ``DELETE`` forgets it. At most `responses_store_size` responses are kept (the
least recently used, created or read, go first; 0 keeps none); nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response object as it was answered
    items: list[dict[str, Any]]  # the conversation: input items (earlier turns first), then the output items


class ResponseStore:
    """At most `size` responses by id, least recently used dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: Stored) -> None:
        if not self.enabled:
            return
        key = stored.response["id"]
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def response_store(request: Request) -> ResponseStore:
    """The server's store (made on first use, sized by `responses_store_size`)."""
    state = request.app.state
    if getattr(state, "openai_responses", None) is None:
        state.openai_responses = ResponseStore(state.settings.responses_store_size)
    store: ResponseStore = state.openai_responses
    return store
