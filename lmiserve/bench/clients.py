"""Streaming clients (two dialects) and the closed-loop load of one concurrency level.

- `LmiDialect`: LMI ``POST /invocations`` with ``"stream": true`` and ``max_new_tokens = N``,
  ``ignore_eos_token = true``; the jsonlines formatter sends one line per token (a ``data:``
  prefix, as the sse formatter sends it, is tolerated); an ``error`` line fails the request.
- `OpenAIDialect`: ``POST /v1/completions`` with ``stream: true``, ``max_tokens = min_tokens = N``,
  ``ignore_eos: true`` (vLLM's extension) and ``stream_options.include_usage``; SSE ``data:``
  events until ``data: [DONE]``; one token per chunk with text (or without a finish reason), and
  ``usage.completion_tokens`` as the count when the server reports it.

With a JSON schema (`lmiserve bench --json-schema`), every request of a dialect made with
`constrained(schema)` also carries it: LMI as ``parameters.json_schema`` (DJL Serving's spelling),
OpenAI as ``response_format`` ``json_schema``. A constrained request may end before N tokens when its
grammar completes (the builtin schema cannot complete within N tokens, so it streams exactly N).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx

from lmiserve.bench.prompts import client_prompt, soak_prompt
from lmiserve.bench.stats import RequestRecord

DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds a single streamed request may take


class BenchError(RuntimeError):
    """The benchmark cannot go on (server unreachable, wrong answers); the message says why."""


class Reached(Protocol):
    """A server the bench sends requests to, in any dialect."""

    name: str
    url: str
    api_key: str | None  # sent as a bearer token on every request (the server's API key)


class Dialect(Reached, Protocol):
    kind: str
    json_schema: dict[str, Any] | None

    async def stream(self, client: httpx.AsyncClient, prompt: str, max_new_tokens: int, record: RequestRecord) -> None:
        """Send one request and fill `record.token_times` / `usage_tokens` / `error`."""


def _error_text(response_body: bytes, status: int) -> str:
    text = response_body.decode("utf-8", errors="replace").strip().replace("\n", " ")
    return f"HTTP {status}: {text[:300]}" if text else f"HTTP {status} (no body)"


def _sse_payload(line: str) -> str | None:
    """The data of an SSE ``data:`` line (None for other lines)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


@dataclass
class LmiDialect:
    """lmiserve / DJL LMI streaming (``/invocations``)."""

    url: str
    name: str = "lmiserve"
    kind: str = "lmi"
    json_schema: dict[str, Any] | None = None
    adapters: list[str] = field(default_factory=list)  # LoRA adapters the requests name in turn
    api_key: str | None = field(default=None, repr=False)
    _sent: int = field(default=0, repr=False)  # requests sent (a plain int: the dialect goes to client processes)

    async def stream(self, client: httpx.AsyncClient, prompt: str, max_new_tokens: int, record: RequestRecord) -> None:
        parameters: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos_token": True}
        if self.json_schema is not None:
            parameters["json_schema"] = self.json_schema
        payload: dict[str, Any] = {"inputs": prompt, "parameters": parameters, "stream": True}
        if self.adapters:
            payload["adapters"] = self.adapters[self._sent % len(self.adapters)]
            self._sent += 1
        async with client.stream("POST", f"{self.url}/invocations", json=payload) as response:
            if response.status_code != 200:
                record.error = _error_text(await response.aread(), response.status_code)
                return
            async for line in response.aiter_lines():
                now = time.perf_counter()
                line = line.strip()
                if not line:
                    continue
                data = _sse_payload(line) if line.startswith("data:") else line
                try:
                    obj = json.loads(data or "")
                except json.JSONDecodeError:
                    record.error = f"not a JSON line: {line[:200]}"
                    return
                if not isinstance(obj, dict):
                    record.error = f"not a JSON object: {line[:200]}"
                    return
                if "error" in obj:
                    record.error = f"error in stream: {str(obj['error'])[:300]}"
                    return
                if "token" in obj:
                    record.token_times.append(now)


@dataclass
class OpenAIDialect:
    """Any OpenAI-compatible ``/v1/completions`` server (vLLM, TGI, lmiserve's OpenAI routes...)."""

    url: str
    name: str
    model: str | None = None
    kind: str = "openai"
    json_schema: dict[str, Any] | None = None
    api_key: str | None = field(default=None, repr=False)

    async def resolve_model(self, client: httpx.AsyncClient) -> str:
        """The configured model, else the first id of ``GET /v1/models``, else "default"."""
        self.model = self.model or await first_model_id(client, self.url) or "default"
        return self.model

    async def stream(self, client: httpx.AsyncClient, prompt: str, max_new_tokens: int, record: RequestRecord) -> None:
        payload: dict[str, Any] = {
            "model": self.model or "default",
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "min_tokens": max_new_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.json_schema is not None:
            payload["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": self.json_schema},
            }
        await stream_openai(client, f"{self.url}/v1/completions", payload, record, _read_completion_chunk)


async def served_model(url: str, api_key: str | None = None) -> str | None:
    """The first model an OpenAI-compatible server at `url` lists (``GET /v1/models``), None when it
    lists none or cannot be asked."""
    async with make_client(1, 30.0, api_key) as client:
        return await first_model_id(client, url)


async def first_model_id(client: httpx.AsyncClient, url: str) -> str | None:
    """The first id of an OpenAI-compatible server's ``GET /v1/models``, None when it has none."""
    try:
        response = await client.get(f"{url}/v1/models", timeout=30)
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError):
        return None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return None


def _read_completion_chunk(obj: dict[str, Any], now: float, record: RequestRecord) -> None:
    for choice in obj.get("choices") or ():
        if choice.get("text") or choice.get("finish_reason") in (None, ""):
            record.token_times.append(now)
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.usage_tokens = usage["completion_tokens"]


async def stream_openai(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    read_chunk: Callable[[dict[str, Any], float, RequestRecord], None],
) -> None:
    """POST one streaming OpenAI request and hand each chunk (a JSON object) to `read_chunk` with its
    arrival time; a refusal, a malformed event, an error event or a missing ``[DONE]`` sets
    `record.error`."""
    done = False
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            record.error = _error_text(await response.aread(), response.status_code)
            return
        async for line in response.aiter_lines():
            now = time.perf_counter()
            data = _sse_payload(line.strip())
            if not data:
                continue
            if data == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                record.error = f"not a JSON event: {data[:200]}"
                return
            if not isinstance(obj, dict):
                record.error = f"not a JSON object: {data[:200]}"
                return
            if obj.get("error"):
                record.error = f"error in stream: {str(obj['error'])[:300]}"
                return
            read_chunk(obj, now, record)
    if not done:
        record.error = "stream ended without data: [DONE]"


def constrained(dialect: Dialect, schema: dict[str, Any]) -> Dialect:
    """A copy of `dialect` whose every request carries `schema`."""
    return replace(dialect, json_schema=schema)  # type: ignore[type-var]


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default context, made once: every new client would load the CA bundle again (~20 ms)."""
    return httpx.create_ssl_context()


def make_client(
    concurrency: int, request_timeout: float = DEFAULT_REQUEST_TIMEOUT, api_key: str | None = None
) -> httpx.AsyncClient:
    """A client with `concurrency` kept-alive connections (plus spares); never through a proxy; with
    `api_key`, every request it sends carries ``Authorization: Bearer <api_key>``."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(connect=30.0, read=request_timeout, write=60.0, pool=None)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers, trust_env=False, verify=_ssl_context())


@contextlib.asynccontextmanager
async def stream_clients(
    concurrency: int, request_timeout: float, api_key: str | None = None
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One client of one kept-alive connection for each closed-loop client of a level, not one client
    pooling `concurrency` connections: httpcore's pool scans all its connections for every request it
    assigns and every response it ends, so at 128 streams the bench's own CPU tripled and its requests
    reached the server so slowly that the engine ran ~5 rows a step instead of 128 (benchmarks/README.md,
    "The benchmark's own client")."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(make_client(1, request_timeout, api_key)) for _ in range(concurrency)]


async def one_request(
    dialect: Dialect,
    client: httpx.AsyncClient,
    prompt: str,
    max_new_tokens: int,
    *,
    client_id: int = 0,
    index: int = 0,
    warmup: bool = False,
    start: float | None = None,
) -> RequestRecord:
    """Send one request and time it (from `start`, default now); transport errors become `record.error`."""
    record = RequestRecord(
        client=client_id,
        index=index,
        warmup=warmup,
        expected_tokens=max_new_tokens,
        exact=dialect.json_schema is None,
        start=time.perf_counter() if start is None else start,
    )
    try:
        await dialect.stream(client, prompt, max_new_tokens, record)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
    record.end = time.perf_counter()
    return record


def stagger(client_id: int, concurrency: int, max_new_tokens: int) -> int:
    """Tokens of a client's first warm-up request: (client + 1) / C of N, so that afterwards the
    clients' requests end at evenly spread times instead of all at once."""
    return max(1, round(max_new_tokens * (client_id + 1) / concurrency))


async def run_level(
    dialect: Dialect,
    concurrency: int,
    max_new_tokens: int,
    *,
    requests_per_client: int = 2,
    duration: float | None = None,
    warmup: int = 1,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    share: tuple[int, int] = (0, 1),
) -> tuple[list[RequestRecord], float]:
    """Closed loop: `concurrency` clients, each sending its next request when the last one ended.

    Each client sends `warmup` warm-up requests (see `stagger`) then `requests_per_client`
    measured ones, or, with `duration`, measured requests until `duration` seconds after the
    last client finished its warm-up. A client stops at its first failed request.
    Returns the records of every request and the level's wall time. ``share=(n, N)``: only the
    clients c with c % N == n run here (process n of N, bench/client_processes.py).
    """
    records: list[RequestRecord] = []
    ids = range(share[0], concurrency, share[1])
    warmed = asyncio.Event()
    warm_state = {"left": len(ids), "at": 0.0}
    if warmup == 0:
        warmed.set()
        warm_state["at"] = time.perf_counter()

    def finished_warmup(at: float | None) -> None:
        warm_state["left"] -= 1
        if warm_state["left"] == 0:
            warm_state["at"] = time.perf_counter() if at is None else at
            warmed.set()

    async def client_loop(client: httpx.AsyncClient, client_id: int) -> None:
        index = 0
        while True:
            # one clock reading decides whether to go on and is the request's start, so a request
            # starts (by its record) before the deadline exactly when it was allowed to
            now = time.perf_counter()
            is_warmup = index < warmup
            if not is_warmup:
                if duration is None and index >= warmup + requests_per_client:
                    return
                if duration is not None and warmed.is_set() and now >= warm_state["at"] + duration:
                    return
            tokens = stagger(client_id, concurrency, max_new_tokens) if index == 0 and warmup > 0 else max_new_tokens
            prompt = client_prompt(client_id, index, concurrency)
            record = await one_request(
                dialect, client, prompt, tokens, client_id=client_id, index=index, warmup=is_warmup, start=now
            )
            records.append(record)
            if is_warmup and index == warmup - 1:
                finished_warmup(record.end)  # the measured time starts when the last warm-up ended
            if record.error is not None:
                if is_warmup and index < warmup - 1:
                    finished_warmup(record.end)
                return
            index += 1

    async with stream_clients(len(ids), request_timeout, dialect.api_key) as clients:
        if isinstance(dialect, OpenAIDialect) and clients:
            await dialect.resolve_model(clients[0])  # a server answers only for a model it serves
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, c) for client, c in zip(clients, ids, strict=True)))
    return records, time.perf_counter() - start


async def probe(dialect: Dialect, max_new_tokens: int = 4) -> RequestRecord:
    """One short request before the levels: fails fast (BenchError) if the server cannot serve."""
    async with make_client(1, 120.0, dialect.api_key) as client:
        if isinstance(dialect, OpenAIDialect):
            await dialect.resolve_model(client)
        record = await one_request(dialect, client, client_prompt(0, 0, 1), max_new_tokens)
    if record.error is not None:
        raise probe_failed(dialect, "a probe request", record.error)
    return record


def probe_failed(dialect: Reached, what: str, error: str) -> BenchError:
    """The error of a failed probe; a refusal for want of a key says how to give one."""
    hint = ""
    if error.startswith(("HTTP 401", "HTTP 403")):
        hint = " (a wrong API key? --api-key KEY)" if dialect.api_key else " (it wants an API key: --api-key KEY)"
    return BenchError(f"{dialect.name} at {dialect.url} failed {what}: {error}{hint}")


async def run_soak(
    dialect: Dialect,
    concurrency: int,
    total: int,
    max_new_tokens: int,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
) -> tuple[list[RequestRecord], float]:
    """`total` short requests from `concurrency` closed-loop clients sharing one counter (a client
    stops at its first failed request)."""
    records: list[RequestRecord] = []
    counter = iter(range(total))

    async def client_loop(client: httpx.AsyncClient, client_id: int) -> None:
        for index in counter:
            record = await one_request(
                dialect, client, soak_prompt(index), max_new_tokens, client_id=client_id, index=index
            )
            records.append(record)
            if record.error is not None:
                return

    async with stream_clients(concurrency, request_timeout, dialect.api_key) as clients:
        if isinstance(dialect, OpenAIDialect):
            await dialect.resolve_model(clients[0])  # a server answers only for a model it serves
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(clients[c], c) for c in range(concurrency)))
    return records, time.perf_counter() - start
