"""The paged KV cache on a real server whose pool is deliberately small (issue 20, "Tests and figures").

The server (`pool_server`) serves the tiny model whose EOS can never be generated, so every request makes
exactly `max_new_tokens` tokens, with a pool of `POOL_BLOCKS` blocks of `BLOCK_SIZE` tokens
(``kv_cache_memory_bytes`` computed from the model's shape: 2 layers, 2 KV heads, head_dim 16, fp32, K
and V) and room for `CONCURRENT` sequences in the running batch. `CONCURRENT` greedy requests at once
need several times the pool: the scheduler must preempt (recompute) and every request must still end
with 200 and the same tokens it gets alone; a request that needs more than the whole pool is refused at
once with its protocol's 4xx; the server's memory stays bounded.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.server import read_log, run_server
from lmiserve.engine.core.kv_blocks import bytes_per_block

BLOCK_SIZE = 4
POOL_BLOCKS = 16  # 64 tokens: a request below needs 8 or 9 blocks, the burst together 25 times the pool
CONCURRENT = 48
MAX_NEW_TOKENS = 24
# the tiny model: 2 layers, 2 KV heads of 16 dimensions, fp32 -> 2 KiB a block of 4 tokens
BLOCK_BYTES = bytes_per_block(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, block_size=BLOCK_SIZE)
TIMEOUT = 120.0  # seconds any one call may take (the burst runs a few seconds on two cores)
RSS_GROWTH_LIMIT = 200 * 2**20  # bytes the server may grow by over the burst
# prompt + max_new_tokens over the whole pool (64 tokens): refused at submission, never queued
TOO_LARGE = {"inputs": "Hello", "parameters": {"max_new_tokens": POOL_BLOCKS * BLOCK_SIZE}}
REFUSED_WITHIN = 5.0  # seconds (a loaded CI machine; it is answered before anything is queued)


@dataclass
class PoolServer:
    url: str
    name: str
    pid: int
    client: httpx.Client
    log: Path

    def metrics(self) -> defaultdict[str, float]:
        """This model's samples on /metrics, by sample name (labels model_name=<model>, engine="0"); 0 for
        a counter not exposed yet (a labelled counter appears at its first increment)."""
        response = self.client.get("/metrics")
        assert response.status_code == 200, response.text
        values: defaultdict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.labels == {"model_name": self.name, "engine": "0"}:
                    values[sample.name] = sample.value
        return values


def _server_pid(port: int) -> int:
    """The process of `python -m lmiserve serve ... --port <port>` (run_server does not expose it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lmiserve" in args and b"serve" in args and b"--port" in args:
            at = args.index(b"--port")
            if at + 1 < len(args) and args[at + 1] == str(port).encode():
                return int(entry.name)
    raise AssertionError(f"no lmiserve process listens on port {port}")


def _rss(pid: int) -> int:
    """Resident memory of `pid` and of its child processes (an engine process, if there is one), in bytes."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except OSError:
            continue
        total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
        for task in tasks:
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
    return total


@pytest.fixture(scope="module")
def pool_server(unreachable_eos_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    """A server of its own (its preemption counter and memory must be its own), with the small pool."""
    yield from _pool_server(unreachable_eos_model_dir, tmp_path_factory, [])


@pytest.fixture(scope="module")
def generic_pool_server(
    unreachable_eos_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PoolServer]:
    """The same pool under transformers' own forward (the generic runner over the blocks)."""
    yield from _pool_server(unreachable_eos_model_dir, tmp_path_factory, ["fast_path=false"])


def _pool_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, extra: list[str]) -> Iterator[PoolServer]:
    log = tmp_path_factory.mktemp("kv-pool") / "server.log"
    options = [
        "kv_cache=paged",
        f"kv_cache_memory_bytes={POOL_BLOCKS * BLOCK_BYTES}",
        f"block_size={BLOCK_SIZE}",
        f"max_rolling_batch_size={CONCURRENT}",
        *extra,
    ]
    args = ["--model-id", str(model_dir)]
    for option in options:
        args += ["-o", option]
    with (
        run_server(args, stderr_path=log) as url,
        httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as client,
    ):
        port = urlsplit(url).port
        assert port is not None
        yield PoolServer(url, model_dir.name, _server_pid(port), client, log)


def _prompt(i: int) -> str:
    """A different prompt per request, 5 to 9 tokens (2 or 3 blocks: the pool admits several at once,
    and they outgrow it as they decode); some share their first block."""
    return f"Hello {i}, " + "the " * (i % 3)


def _generate(client: httpx.Client, i: int, max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[int, object]:
    """Request `i`, greedy: even ones on LMI's /invocations, odd ones on TGI's /generate with details or
    (every fourth) streamed from /generate_stream. Returns the status and what must be the same alone and
    in the burst (the text; TGI's token ids too)."""
    parameters = {"max_new_tokens": max_new_tokens, "do_sample": False}
    if i % 2 == 0:
        response = client.post("/invocations", json={"inputs": _prompt(i), "parameters": parameters})
        if response.status_code != 200:
            return response.status_code, response.text
        return 200, response.json()["generated_text"]
    if i % 4 == 3:  # a preempted stream goes on later without a gap, a repeat or a changed token
        with client.stream("POST", "/generate_stream", json={"inputs": _prompt(i), "parameters": parameters}) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode()
            events = [json.loads(line[len("data:") :]) for line in r.iter_lines() if line.startswith("data:")]
        assert [e["index"] for e in events] == list(range(1, max_new_tokens + 1)), events
        text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
        assert text == events[-1]["generated_text"], events
        return 200, (events[-1]["generated_text"], [e["token"]["id"] for e in events])
    response = client.post("/generate", json={"inputs": _prompt(i), "parameters": {**parameters, "details": True}})
    if response.status_code != 200:
        return response.status_code, response.text
    body = response.json()
    details = body["details"]
    assert details["finish_reason"] == "length", body
    assert details["generated_tokens"] == max_new_tokens, body
    return 200, (body["generated_text"], [t["id"] for t in details["tokens"]])


def test_the_pool_is_the_size_the_budget_buys(pool_server: PoolServer):
    lines = read_log(pool_server.log)
    assert any(f"KV cache: {POOL_BLOCKS} blocks of {BLOCK_SIZE} tokens" in line for line in lines), lines[-20:]
    info = pool_server.client.get("/info").json()  # TGI's meaning: the tokens the KV cache holds
    assert info["max_batch_total_tokens"] == POOL_BLOCKS * BLOCK_SIZE, info


def test_a_burst_several_times_the_pool_finishes_with_the_tokens_of_each_request_alone(pool_server: PoolServer):
    _burst(pool_server)


def test_the_same_burst_under_transformers_forward_over_the_blocks(generic_pool_server: PoolServer):
    lines = read_log(generic_pool_server.log)
    assert any("generic path over the paged KV cache" in line for line in lines), lines[-20:]
    _burst(generic_pool_server)


def _burst(pool_server: PoolServer) -> None:
    """48 concurrent requests whose KV is several times the pool: each finishes with its tokens alone,
    preempting; usage in whole blocks; every block back; RSS bounded; a request larger than the pool
    refused at once."""
    client = pool_server.client
    alone = {}
    for i in range(CONCURRENT):
        status, result = _generate(client, i)
        assert status == 200, result
        alone[i] = result
    before = pool_server.metrics()
    rss_before = _rss(pool_server.pid)

    usages: list[float] = []  # vllm:kv_cache_usage_perc while the burst runs

    def watch(done: threading.Event) -> None:
        while not done.is_set():
            usages.append(pool_server.metrics()["vllm:kv_cache_usage_perc"])
            time.sleep(0.05)

    def too_large() -> tuple[int, float]:
        started = time.monotonic()
        response = client.post("/invocations", json=TOO_LARGE)
        return response.status_code, time.monotonic() - started

    done = threading.Event()
    with ThreadPoolExecutor(CONCURRENT + 2) as workers:
        watcher = workers.submit(watch, done)
        started = time.monotonic()
        results = workers.map(lambda i: _generate(client, i), range(CONCURRENT))
        refused = workers.submit(too_large)  # while the pool is full: refused at once all the same
        together = dict(zip(range(CONCURRENT), results))
        elapsed = time.monotonic() - started
        done.set()
        watcher.result()

    rss_after = _rss(pool_server.pid)
    after = pool_server.metrics()
    for i in range(CONCURRENT):
        status, result = together[i]
        assert status == 200, f"request {i}: {result}"
        assert result == alone[i], f"request {i} changed in the burst"
    preempted = after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]
    assert preempted > 0, f"no preemption in {elapsed:.1f} s although the burst needs several times the pool"
    # vLLM's meaning: blocks in use / the pool, so whole blocks of 1 / POOL_BLOCKS, never above 1
    assert any(usage > 0 for usage in usages), usages
    assert all(0 <= usage <= 1 and (usage * POOL_BLOCKS).is_integer() for usage in usages), usages
    assert after["vllm:kv_cache_usage_perc"] == 0  # every block back in the pool
    assert 0 <= after["lmiserve_prefix_cache_usage_perc"] <= 1  # cached free blocks / pool
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == CONCURRENT * MAX_NEW_TOKENS  # a preempted sequence's tokens are not generated twice
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, (rss_before, rss_after)
    status, took = refused.result()
    assert status == 424 and took < REFUSED_WITHIN, (status, took)


def test_prefix_cache_counts_tokens_in_whole_blocks_of_the_pool(pool_server: PoolServer):
    client, name = pool_server.client, pool_server.name
    prompt = "A prompt sent twice shares its full blocks: 1, 2, 3, 4, 5"
    before = pool_server.metrics()
    usages = []
    for _ in range(2):
        r = client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    after = pool_server.metrics()
    prompt_tokens = usages[0]["prompt_tokens"]
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # whole blocks, never the last token
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert queries == 2 * prompt_tokens
    assert hits == usages[0]["prompt_tokens_details"]["cached_tokens"] + cached
    assert 0 < after["lmiserve_prefix_cache_usage_perc"] <= 1


@pytest.mark.parametrize(
    ("path", "status", "shape"),
    [
        ("/invocations", 424, {"error", "code"}),  # LMI: an invalid request is its compact 424
        ("/generate", 422, {"error", "error_type"}),  # TGI: a validation error
    ],
)
def test_a_request_larger_than_the_whole_pool_is_refused_at_once(pool_server: PoolServer, path, status, shape):
    started = time.monotonic()
    response = pool_server.client.post(path, json=TOO_LARGE)
    assert time.monotonic() - started < REFUSED_WITHIN
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == shape, body
    assert "more than the whole KV cache holds" in body["error"]
    if path == "/generate":
        assert body["error_type"] == "validation"
        assert body["error"].startswith("Input validation error: ")
    else:
        assert body["code"] == 424


def test_preemptions_count_no_prompt_token_twice(pool_server: PoolServer):
    counters = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")

    def moved(before: dict[str, float], after: dict[str, float]) -> tuple[float, ...]:
        return tuple(after[name] - before[name] for name in counters)

    client = pool_server.client
    first = pool_server.metrics()
    for i in range(CONCURRENT):  # the prompts alone: what each counts once (hits depend on what is cached)
        assert _generate(client, i, max_new_tokens=1)[0] == 200
    alone = pool_server.metrics()
    with ThreadPoolExecutor(CONCURRENT) as workers:
        assert all(status == 200 for status, _ in workers.map(lambda i: _generate(client, i), range(CONCURRENT)))
    burst = pool_server.metrics()
    assert burst["vllm:num_preemptions_total"] > alone["vllm:num_preemptions_total"]
    prompt_tokens, queries, hits = moved(alone, burst)
    expected_prompt, expected_queries, _ = moved(first, alone)
    assert (prompt_tokens, queries) == (expected_prompt, expected_queries)
    assert hits <= queries


_MESSAGES = [{"role": "user", "content": "Hello"}]
_TOO_MANY = POOL_BLOCKS * BLOCK_SIZE  # new tokens: with any prompt more than the whole pool


@pytest.mark.parametrize(
    ("path", "body", "status", "shape"),
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": _TOO_MANY}, 400, {"error"}),
        ("/v1/chat/completions", {"messages": _MESSAGES, "max_tokens": _TOO_MANY}, 400, {"error"}),
        ("/v1/messages", {"messages": _MESSAGES, "max_tokens": _TOO_MANY}, 400, {"type", "error"}),
        ("/v1/responses", {"input": "Hello", "max_output_tokens": _TOO_MANY}, 400, {"error"}),
        ("/invocations", TOO_LARGE, 424, {"error", "code"}),  # LMI: its compact 424
    ],
    ids=["openai-completions", "openai-chat", "anthropic", "responses", "lmi"],
)
def test_a_streamed_request_larger_than_the_pool_gets_the_same_4xx_as_the_whole_one(
    pool_server: PoolServer, path, body, status, shape
):
    """Issue 36, point 7: the streamed form of a request that never fits the pool is refused before its
    stream starts, with its protocol's 4xx and the body the whole form gets, not a 200 and an error event."""
    client = pool_server.client
    body = {"model": pool_server.name, **body} if path.startswith("/v1/") else body
    whole = client.post(path, json=body)
    assert whole.status_code == status, whole.text
    assert "more than the whole KV cache holds" in whole.text
    started = time.monotonic()
    with client.stream("POST", path, json={**body, "stream": True}) as streamed:
        streamed.read()
    assert time.monotonic() - started < REFUSED_WITHIN
    assert streamed.status_code == status, streamed.text
    assert not streamed.headers["content-type"].startswith("text/event-stream"), streamed.headers
    assert streamed.json() == whole.json()
    assert set(streamed.json()) == shape, streamed.json()


def test_a_tgi_stream_larger_than_the_pool_is_refused_before_anything_is_queued(pool_server: PoolServer):
    """TGI's native stream answers every invalid request in-band under 200 (as TGI does: one error event,
    no token, as for a bad grammar), the whole form 422; both now before anything is queued."""
    client = pool_server.client
    before = pool_server.metrics()
    with client.stream("POST", "/generate_stream", json=TOO_LARGE) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data:")]
    assert streamed.status_code == 200
    (event,) = [json.loads(line[len("data:") :]) for line in lines]
    assert event["error_type"] == "validation" and "more than the whole KV cache holds" in event["error"], event
    whole = client.post("/generate", json=TOO_LARGE)
    assert whole.status_code == 422 and whole.json() == event
    after = pool_server.metrics()
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"]  # nothing ran
