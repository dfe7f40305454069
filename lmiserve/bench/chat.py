"""The chat scenario's client and closed loop (`lmiserve bench --scenario chat`).

`ChatDialect`: ``POST /v1/chat/completions`` with ``stream: true``, ``max_tokens = min_tokens = N``,
``ignore_eos: true`` (vLLM's extensions, which lmiserve accepts) and ``stream_options.include_usage``.
A chunk whose ``delta.content`` is a string counts as one token (a role-only first chunk, as
llama.cpp's servers send, does not); ``usage.completion_tokens`` is the count when the server reports
it. A server that ignores the forcing fields may end a reply early: its tokens/s and latencies use
the tokens that really arrived, and the level reports them against the expected count.

Each client of a level runs its conversations one after another (see `conversations.py`), every turn
resending the whole history with the streamed reply appended; the first `warmup` requests of a client
are single-turn warm-up conversations (the first with a staggered length, as in the completion
scenario) whose numbers no measured conversation uses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from lmiserve.bench.clients import first_model_id, make_client, probe_failed, stagger, stream_clients, stream_openai
from lmiserve.bench.conversations import Conversation, conversation_number
from lmiserve.bench.stats import RequestRecord

WARMUP_CONVERSATIONS = 1_000_000  # warm-up conversation numbers start here


@dataclass
class ChatDialect:
    """Any OpenAI-compatible ``/v1/chat/completions`` server (lmiserve, vLLM, llama.cpp...)."""

    url: str
    name: str
    model: str | None = None
    kind: str = "openai-chat"
    api_key: str | None = field(default=None, repr=False)

    async def resolve_model(self, client: httpx.AsyncClient) -> str:
        """The configured model, else the first id of ``GET /v1/models``, else "default"."""
        self.model = self.model or await first_model_id(client, self.url) or "default"
        return self.model

    def payload(self, messages: list[dict[str, Any]], max_new_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model or "default",
            "messages": messages,
            "max_tokens": max_new_tokens,
            "min_tokens": max_new_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def stream(
        self, client: httpx.AsyncClient, messages: list[dict[str, Any]], max_new_tokens: int, record: RequestRecord
    ) -> None:
        """Send one chat request and fill `record` (token times, text, usage, error)."""
        body = self.payload(messages, max_new_tokens)
        await stream_openai(client, f"{self.url}/v1/chat/completions", body, record, read_chunk)


def read_chunk(obj: dict[str, Any], now: float, record: RequestRecord) -> None:
    """One ``chat.completion.chunk``: its content token (if any) and its usage (if any)."""
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str) and (content or not choice.get("finish_reason")):
            record.token_times.append(now)
            record.text.append(content)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            record.usage_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]


async def chat_request(
    dialect: ChatDialect,
    client: httpx.AsyncClient,
    conversation: Conversation,
    max_new_tokens: int,
    *,
    client_id: int = 0,
    index: int = 0,
    warmup: bool = False,
    start: float | None = None,
) -> RequestRecord:
    """Ask the conversation's next question, stream the reply, append it to the history."""
    turn = conversation.turn
    messages = conversation.ask()
    record = RequestRecord(
        client=client_id,
        index=index,
        warmup=warmup,
        expected_tokens=max_new_tokens,
        start=time.perf_counter() if start is None else start,
        turn=turn,
        conversation=conversation.number,
    )
    try:
        await dialect.stream(client, messages, max_new_tokens, record)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
    record.end = time.perf_counter()
    conversation.reply("".join(record.text))
    return record


async def run_chat_level(
    dialect: ChatDialect,
    concurrency: int,
    max_new_tokens: int,
    *,
    turns: int = 4,
    conversations_per_client: int = 1,
    duration: float | None = None,
    warmup: int = 1,
    request_timeout: float = 600.0,
    conversation: Callable[[int], Conversation] = Conversation,
    share: tuple[int, int] = (0, 1),
) -> tuple[list[RequestRecord], float]:
    """Closed loop: `concurrency` clients, each running `conversations_per_client` conversations of
    `turns` turns (with `duration`: conversations until `duration` seconds after the last client's
    warm-up, stopping mid-conversation at the deadline). A client stops at its first failed request.
    `conversation` makes conversation number k (the vision scenario's: a one-turn request with image k).
    ``share=(n, N)``: only the clients c with c % N == n run here (bench/client_processes.py)."""
    records: list[RequestRecord] = []
    ids = range(share[0], concurrency, share[1])
    warmed = asyncio.Event()
    state = {"left": len(ids), "at": time.perf_counter()}
    if warmup == 0:
        warmed.set()

    def finished_warmup(at: float) -> None:
        state["left"] -= 1
        if state["left"] == 0:
            state["at"] = at
            warmed.set()

    async def client_loop(client: httpx.AsyncClient, client_id: int) -> None:
        index = 0
        for w in range(warmup):
            tokens = stagger(client_id, concurrency, max_new_tokens) if w == 0 else max_new_tokens
            conv = conversation(WARMUP_CONVERSATIONS + client_id + w * concurrency)
            record = await chat_request(dialect, client, conv, tokens, client_id=client_id, index=index, warmup=True)
            records.append(record)
            index += 1
            if record.error is not None or w == warmup - 1:
                finished_warmup(record.end or time.perf_counter())
            if record.error is not None:
                return
        conv_index = 0
        while duration is not None or conv_index < conversations_per_client:
            conv = conversation(conversation_number(client_id, conv_index, concurrency))
            for _ in range(turns):
                now = time.perf_counter()
                if duration is not None and warmed.is_set() and now >= state["at"] + duration:
                    return
                record = await chat_request(
                    dialect, client, conv, max_new_tokens, client_id=client_id, index=index, start=now
                )
                records.append(record)
                index += 1
                if record.error is not None:
                    return
            conv_index += 1

    async with stream_clients(len(ids), request_timeout, dialect.api_key) as clients:
        if clients:
            await dialect.resolve_model(clients[0])  # a server answers only for a model it serves
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, c) for client, c in zip(clients, ids, strict=True)))
    return records, time.perf_counter() - start


async def probe_chat(
    dialect: ChatDialect, max_new_tokens: int = 4, conversation: Callable[[int], Conversation] = Conversation
) -> RequestRecord:
    """One short chat request before the levels: fails fast (BenchError) if the server cannot serve."""
    async with make_client(1, 120.0, dialect.api_key) as client:
        await dialect.resolve_model(client)
        record = await chat_request(dialect, client, conversation(WARMUP_CONVERSATIONS - 1), max_new_tokens)
    if record.error is not None:
        raise probe_failed(dialect, "a chat probe request", record.error)
    return record
