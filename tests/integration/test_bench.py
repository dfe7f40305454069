"""`lmiserve bench` against real servers: a small OpenAI-style `/v1/completions` and
`/v1/chat/completions` SSE server written here (starlette + uvicorn, OpenAI's chunk formats; its chat
streams as llama.cpp's servers do: a role-only first chunk, an empty final delta), a real `lmiserve
serve` of the tiny model, and the whole command end to end (its own server, baselines, soak, compare
server, JSON, PNG; the chat scenario; a second lmiserve with --ab-option).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from helpers.server import free_port, run_server
from lmiserve.bench.chat import ChatDialect, probe_chat, run_chat_level
from lmiserve.bench.client_processes import run_clients
from lmiserve.bench.clients import BenchError, LmiDialect, OpenAIDialect, probe, run_level, run_soak, stagger
from lmiserve.bench.conversations import SYSTEM_PROMPT, chat_level_summary
from lmiserve.bench.stats import level_summary

pytestmark = pytest.mark.e2e  # the slowest tier: the benchmark end to end

WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")
BENCH_TIMEOUT = 600


# --- a small OpenAI-compatible completions server -----------------------------------------------


def _chunk(n: int, model: str, choices: list, usage=None, include_usage=False) -> str:
    body = {
        "id": f"cmpl-{n}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage
    return "data: " + json.dumps(body) + "\n\n"


async def completions(request: Request):
    """OpenAI's streamed completions: one chunk per token, `finish_reason` on the last token, a
    usage chunk with empty choices when `stream_options.include_usage`, then `data: [DONE]`.
    Without `ignore_eos` it "meets EOS" after half of max_tokens. The model name picks a fault:
    `no-usage` ignores stream_options, `error-midway` sends an error event after 2 tokens,
    `no-done` ends without [DONE], `reject` answers 400."""
    body = await request.json()
    model = body.get("model")
    if model == "reject" or not isinstance(body.get("max_tokens"), int) or body.get("stream") is not True:
        return JSONResponse({"error": {"message": "rejected", "type": "invalid_request_error"}}, status_code=400)
    n = body["max_tokens"]
    stop_at = n if body.get("ignore_eos") and body.get("min_tokens") == n else max(1, n // 2)
    include_usage = model != "no-usage" and bool((body.get("stream_options") or {}).get("include_usage"))
    prompt_tokens = len(str(body.get("prompt", "")).split())

    async def events():
        for i in range(stop_at):
            await asyncio.sleep(0.002)
            if model == "error-midway" and i == 2:
                yield "data: " + json.dumps({"error": {"message": "boom", "type": "server_error"}}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            finish = None if i < stop_at - 1 else ("length" if stop_at == n else "stop")
            choice = {"text": WORDS[i % len(WORDS)], "index": 0, "logprobs": None, "finish_reason": finish}
            yield _chunk(i, model, [choice], include_usage=include_usage)
        if include_usage:
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": stop_at,
                "total_tokens": prompt_tokens + stop_at,
            }
            yield _chunk(stop_at, model, [], usage=usage, include_usage=True)
        if model != "no-done":
            yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def chat_completions(request: Request):
    """OpenAI's streamed chat completions as llama.cpp's servers send them: a first chunk with only the
    role, one chunk per token, a last chunk with an empty delta and the finish reason, usage on request.
    Model `no-force` ignores `min_tokens`/`ignore_eos` (meets EOS after half of max_tokens). The prompt
    tokens are the words of all messages, so a resent history shows in `usage.prompt_tokens`."""
    body = await request.json()
    model, n = body.get("model"), body.get("max_tokens")
    messages = body.get("messages")
    if not isinstance(n, int) or not isinstance(messages, list) or body.get("stream") is not True:
        return JSONResponse({"error": {"message": "rejected", "type": "invalid_request_error"}}, status_code=400)
    forced = model != "no-force" and body.get("ignore_eos") and body.get("min_tokens") == n
    stop_at = n if forced else max(1, n // 2)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages)

    def chunk(delta: dict, finish=None, usage=None) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": model, "choices": choices}
        if usage is not None:
            event["usage"] = usage
        return "data: " + json.dumps(event) + "\n\n"

    async def events():
        yield chunk({"role": "assistant", "content": None})
        for i in range(stop_at):
            await asyncio.sleep(0.002)
            yield chunk({"content": WORDS[i % len(WORDS)]})
        yield chunk({}, finish="length" if forced else "stop")
        if include_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": stop_at, "total_tokens": prompt_tokens + n}
            yield chunk(None, usage=usage)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def models(request: Request):
    return JSONResponse(
        {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "test"}]}
    )


@pytest.fixture(scope="module")
def openai_url() -> Iterator[str]:
    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models),
        ]
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "OpenAI test server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


# --- OpenAI dialect ----------------------------------------------------------------------------


async def test_openai_dialect_counts_exact_tokens_under_closed_loop(openai_url):
    dialect = OpenAIDialect(url=openai_url, name="fake")
    await probe(dialect)
    assert dialect.model == "fake-model"  # from GET /v1/models
    records, elapsed = await run_level(dialect, 3, 7, requests_per_client=2, warmup=1)
    assert len(records) == 9 and elapsed > 0
    assert all(r.error is None and r.count_ok for r in records), [(r.error, r.tokens) for r in records]
    assert sorted(r.expected_tokens for r in records if r.warmup) == [2, 5, 7]  # staggered warm-up
    assert all(r.usage_tokens == r.expected_tokens == len(r.token_times) for r in records)
    level = level_summary(3, records, elapsed)
    assert level["token_count_errors"] == 0 and level["tokens_received"] == 2 + 5 + 7 + 6 * 7
    assert level["output_tokens_per_s"] > 0 and level["itl_ms"]["count"] > 0


async def test_openai_dialect_counts_chunks_without_usage(openai_url):
    dialect = OpenAIDialect(url=openai_url, name="fake", model="no-usage")
    records, _ = await run_level(dialect, 2, 5, requests_per_client=1, warmup=0)
    assert [(r.usage_tokens, r.tokens, r.count_ok) for r in records] == [(None, 5, True)] * 2


async def test_duration_mode_keeps_every_client_busy_until_the_deadline(openai_url):
    dialect = OpenAIDialect(url=openai_url, name="fake", model="fake-model")
    records, elapsed = await run_level(dialect, 2, 4, duration=0.3, warmup=1)
    warm_end = max(r.end for r in records if r.warmup)
    for client in (0, 1):
        mine = [r for r in records if r.client == client]
        assert [r.index for r in mine] == list(range(len(mine)))  # closed loop, in order
        measured = [r for r in mine if not r.warmup]
        assert measured, "every client sends measured requests"
        assert all(r.start < warm_end + 0.3 for r in measured)  # none started after the deadline
        assert mine[-1].end >= warm_end + 0.3 - 0.1  # and the loop ran until about the deadline
    assert all(r.count_ok for r in records) and elapsed >= 0.3


@pytest.mark.parametrize(
    ("model", "error"),
    [
        ("error-midway", "error in stream: {'message': 'boom'"),
        ("no-done", "stream ended without data: [DONE]"),
        ("reject", "HTTP 400: "),
    ],
)
async def test_openai_dialect_failures_fail_the_request(openai_url, model, error):
    dialect = OpenAIDialect(url=openai_url, name="fake", model=model)
    records, _ = await run_level(dialect, 1, 6, requests_per_client=3, warmup=0)
    assert len(records) == 1  # the client stops at its first failure
    assert records[0].error is not None and records[0].error.startswith(error) and not records[0].count_ok
    with pytest.raises(BenchError, match="failed a probe request"):
        await probe(dialect)


# --- chat scenario against the peer-like server ----------------------------------------------------


async def test_chat_conversations_resend_their_history(openai_url):
    dialect = ChatDialect(url=openai_url, name="fake")
    await probe_chat(dialect)
    assert dialect.model == "fake-model"
    records, elapsed = await run_chat_level(dialect, 2, 4, turns=3, conversations_per_client=2, warmup=1)
    assert len(records) == 2 * (1 + 2 * 3)
    assert all(r.error is None and r.count_ok for r in records), [(r.error, r.tokens) for r in records]
    measured = [r for r in records if not r.warmup]
    assert sorted({r.conversation for r in measured}) == [0, 1, 2, 3]
    for conv in range(4):
        mine = sorted((r for r in measured if r.conversation == conv), key=lambda r: r.index)
        assert [r.turn for r in mine] == [1, 2, 3]
        # each turn resends the history: the previous prompt, its reply (4 words) and a new question
        assert all(b.prompt_tokens > a.prompt_tokens + 4 for a, b in itertools.pairwise(mine))
        assert mine[0].prompt_tokens > len(SYSTEM_PROMPT.split())
        assert ["".join(r.text) for r in mine] == [" the quick brown fox"] * 3
    level = chat_level_summary(2, records, elapsed)
    assert [t["turn"] for t in level["turns"]] == [1, 2, 3] and level["token_count_errors"] == 0
    assert all(t["requests"] == 4 and t["ttft_ms"]["p50"] > 0 for t in level["turns"])
    assert level["ttft_p50_late_turns_ms"] > 0 and level["conversations"] == 4


async def test_chat_peer_that_does_not_force_tokens_is_counted_as_it_is(openai_url):
    dialect = ChatDialect(url=openai_url, name="fake", model="no-force")
    records, elapsed = await run_chat_level(dialect, 1, 6, turns=2, conversations_per_client=1, warmup=0)
    assert [(r.error, r.tokens, len(r.token_times), r.count_ok) for r in records] == [(None, 3, 3, False)] * 2
    level = chat_level_summary(1, records, elapsed)
    assert level["token_count_errors"] == 2 and level["tokens_received"] == 6 and level["tokens_expected"] == 12
    assert level["output_tokens_per_s"] > 0  # the tokens that arrived


# --- LMI dialect against a real lmiserve ---------------------------------------------------------

# The tiny model with a 4096-token context (`long_model_dir`, tests/integration/conftest.py): the
# longest prompts of the bench's set are ~600 tokens for the tiny model's 512-token vocabulary.


@pytest.fixture(scope="module")
def lmi_url(long_model_dir: Path) -> Iterator[str]:
    with run_server(["--model-id", str(long_model_dir), "-o", "max_rolling_batch_size=4"]) as url:
        yield url


async def test_lmi_dialect_forces_exactly_n_tokens(lmi_url):
    dialect = LmiDialect(url=lmi_url)
    records, elapsed = await run_level(dialect, 4, 9, requests_per_client=2, warmup=1)
    assert len(records) == 12
    assert all(r.error is None for r in records), [r.error for r in records]
    assert [len(r.token_times) for r in records] == [r.expected_tokens for r in records]
    assert sorted(r.expected_tokens for r in records if r.warmup) == [2, 4, 7, 9]
    level = level_summary(4, records, elapsed)
    assert level["steady_window"] and level["token_count_errors"] == 0 and level["failed_requests"] == 0
    assert level["ttft_ms"]["count"] == 8 and level["itl_ms"]["p99"] >= level["itl_ms"]["p50"] > 0


async def test_a_share_of_the_clients_runs_only_its_own(lmi_url):
    records, _ = await run_level(LmiDialect(url=lmi_url), 4, 6, requests_per_client=1, warmup=1, share=(1, 2))
    assert sorted({r.client for r in records}) == [1, 3] and len(records) == 4
    assert sorted(r.expected_tokens for r in records if r.warmup) == [stagger(1, 4, 6), stagger(3, 4, 6)]


def test_clients_split_over_processes_do_what_one_process_does(lmi_url):
    """Two spawned client processes: the level's clients, their staggered warm-ups and every token, merged."""
    run = run_clients(run_level, 2, LmiDialect(url=lmi_url), 4, 6, requests_per_client=2, warmup=1)
    assert [(r.client, r.index) for r in run.records] == [(c, i) for c in range(4) for i in range(3)]
    assert all(r.error is None and r.count_ok for r in run.records), [r.error for r in run.records]
    assert [r.expected_tokens for r in run.records if r.warmup] == [stagger(c, 4, 6) for c in range(4)]
    assert run.elapsed > 0 and run.cpu > 0 and run.busy > 0
    level = level_summary(4, run.records, run.elapsed)
    assert level["token_count_errors"] == 0 and level["failed_requests"] == 0 and level["ttft_ms"]["count"] == 8


def test_a_client_process_that_fails_fails_the_bench(lmi_url):
    with pytest.raises(BenchError, match=r"client process \d of 2 failed: TypeError"):
        run_clients(run_level, 2, LmiDialect(url=lmi_url), 2, 4, no_such_option=1)


async def test_lmi_soak_and_server_errors(lmi_url):
    dialect = LmiDialect(url=lmi_url)
    records, _ = await run_soak(dialect, 3, 10, 3)
    assert len(records) == 10 and all(r.count_ok for r in records)
    records, _ = await run_level(dialect, 1, 5000, requests_per_client=1, warmup=0)  # above max_new_tokens_limit
    assert records[0].error is not None and records[0].error.startswith("HTTP 4")


async def test_chat_scenario_against_lmiserve(lmi_url):
    dialect = ChatDialect(url=lmi_url, name="lmiserve")
    records, elapsed = await run_chat_level(dialect, 2, 3, turns=3, conversations_per_client=1, warmup=1)
    assert len(records) == 2 * (1 + 3)
    assert all(r.error is None and r.count_ok and r.usage_tokens == r.expected_tokens for r in records), [
        (r.error, r.tokens) for r in records
    ]
    for conv in (0, 1):
        mine = sorted((r for r in records if r.conversation == conv), key=lambda r: r.index)
        assert [r.turn for r in mine] == [1, 2, 3]
        assert all(b.prompt_tokens > a.prompt_tokens for a, b in itertools.pairwise(mine))  # the history grows
    level = chat_level_summary(2, records, elapsed)
    assert [t["turn"] for t in level["turns"]] == [1, 2, 3]
    assert level["failed_requests"] == 0 and level["token_count_errors"] == 0
    assert level["late_over_turn1"] is not None


def decode_steps(url: str) -> float:
    """The engine's decode steps so far (TGI's forward-duration histogram, `method="decode"`: absent before
    the first)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r'^tgi_batch_forward_duration_count\{method="decode"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found is not None else 0.0


def test_128_streams_reach_the_server_together(long_model_dir):
    """The bench's clients each keep their own connection (`stream_clients`): through one httpx pool of 128
    connections the requests reached the server one by one (httpcore scans its whole pool for each request
    and each response), so the engine ran ~5 rows a step and the level measured the client."""
    with run_server(["--model-id", str(long_model_dir), "-o", "max_rolling_batch_size=128"]) as url:
        dialect = LmiDialect(url=url)
        before = decode_steps(url)
        records, _ = asyncio.run(run_level(dialect, 128, 24, requests_per_client=2, warmup=1))
        steps = decode_steps(url) - before
    assert all(r.error is None and r.count_ok for r in records), [r.error for r in records if r.error]
    tokens = sum(len(r.token_times) for r in records)
    assert tokens / steps >= 32, f"{tokens} tokens in {steps:.0f} decode steps"


def run_bench(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`lmiserve bench ARGS` in a process of its own, without the caller's OPENAI_API_KEY (the bench's
    default key), with `env` added."""
    environ = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "lmiserve", "bench", *args],
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT,
        cwd=cwd,
        env={**environ, **(env or {})},
    )


def test_bench_url_mode_without_baselines(lmi_url, long_model_dir, tmp_path):
    out = tmp_path / "url"
    result = run_bench(
        "--url",
        lmi_url,
        "--concurrency",
        "2",
        "--max-new-tokens",
        "4",
        "--skip-baselines",
        "--client-processes",
        "2",
        "--output-dir",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["baselines"] is None and report["memory"] is None
    assert report["settings"]["client_processes"] == 2
    assert report["settings"]["url"] == lmi_url and report["files"]["server_log"] is None
    # no --model-id: the model is the one the server lists, not the bundled model's name
    assert report["model"] == {"id": None, "name": long_model_dir.name, "path": None}
    (level,) = report["servers"][0]["levels"]
    assert level["tokens_expected"] == level["tokens_received"] and level["token_count_errors"] == 0
    assert level["client_processes"] == 2 and level["requests"] == 2 * 3  # two clients, each its own process
    # the clients' CPU (both processes') and the busier process's share of a core: its CPU over the same
    # time (a level of 0.2 s once showed 1.04, the clients' set-up's CPU over the level's window alone)
    assert level["client_cpu_s"] > 0 and 0 < level["client_busy"] <= 1.0
    # the server's own steps over the level (its /metrics): each request's prompt joined one step or more
    # (in chunks while the other client's request decodes; two prompts may share one), each of its 3 later tokens took a decode step
    # (shared by the two clients' requests where they overlapped)
    steps = level["engine_steps"]
    assert steps["prefill_steps"] >= 3 and 3 <= steps["decode_steps"] <= 18  # a client's 3 in turn
    assert 0 < steps["prefill_share"] < 1 and steps["prefill_step_ms"] > 0 and steps["decode_step_ms"] > 0
    assert "steps with prompts" in result.stderr + result.stdout
    assert report["servers"][0]["ratios"][0]["server_over_forward"] is None
    assert (out / "bench.png").stat().st_size > 0


SECRET = "bench-secret-7f3a"


@pytest.fixture(scope="module")
def guarded_url(long_model_dir: Path) -> Iterator[str]:
    with run_server(["--model-id", str(long_model_dir), "--api-key", SECRET, "-o", "max_rolling_batch_size=4"]) as url:
        yield url


def test_bench_url_mode_against_a_server_with_an_api_key(guarded_url, long_model_dir, tmp_path):
    """Every request of every phase (probes, both scenarios, the soak, the model lookup) carries the key;
    the key is written nowhere; without it the bench stops at its probe with one line that says why."""
    args = ("--url", guarded_url, "--concurrency", "2", "--max-new-tokens", "3", "--skip-baselines")
    refused = run_bench(*args, "--output-dir", str(tmp_path / "no-key"), cwd=tmp_path)
    assert refused.returncode == 1 and not (tmp_path / "no-key" / "bench.json").exists()
    assert refused.stderr.splitlines()[-1] == (
        f"lmiserve bench: lmiserve at {guarded_url} failed a probe request: HTTP 401 (no body)"
        " (it wants an API key: --api-key KEY)"
    )
    wrong = run_bench(*args, "--api-key", "nope", "--output-dir", str(tmp_path / "wrong"), cwd=tmp_path)
    assert wrong.returncode == 1 and wrong.stderr.splitlines()[-1].endswith("(a wrong API key? --api-key KEY)")

    out = tmp_path / "key"
    scenarios = ("--scenario", "both", "--chat-turns", "2", "--chat-conversations", "1", "--soak-requests", "3")
    result = run_bench(*args, *scenarios, "--api-key", SECRET, "--output-dir", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (out / "bench.json").read_text()
    assert SECRET not in text and SECRET not in result.stdout + result.stderr
    report = json.loads(text)
    assert report["command"].startswith(f"lmiserve bench --url {guarded_url} --concurrency 2")
    assert "--api-key '<hidden>'" in report["command"] and report["settings"]["api_key"] == "<hidden>"
    assert report["model"]["name"] == long_model_dir.name  # /v1/models, asked with the key
    (server,) = report["servers"]
    (level,), (chat,) = server["levels"], server["chat_levels"]
    assert level["failed_requests"] == chat["failed_requests"] == 0
    assert level["engine_steps"]["decode_steps"] > 0  # /metrics read with the key too
    assert level["tokens_received"] == level["tokens_expected"] and chat["tokens_received"] == chat["tokens_expected"]
    assert report["memory"]["soak"]["requests"] == 3 and report["memory"]["soak"]["failed_requests"] == 0

    # OpenAI's environment variable, as vLLM's benchmark reads it
    from_env = run_bench(*args, "--output-dir", str(tmp_path / "env"), cwd=tmp_path, env={"OPENAI_API_KEY": SECRET})
    assert from_env.returncode == 0, from_env.stderr
    assert SECRET not in (tmp_path / "env" / "bench.json").read_text()


# --- the whole command -----------------------------------------------------------------------------


def test_bench_end_to_end(long_model_dir, openai_url, tmp_path):
    out = tmp_path / "run"
    result = run_bench(
        "--model-id",
        str(long_model_dir),
        "--concurrency",
        "1,2",
        "--max-new-tokens",
        "5",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "-o",
        "max_rolling_batch_size=4",
        "--soak-requests",
        "12",
        "--soak-max-new-tokens",
        "3",
        "--compare-url",
        openai_url + "/v1",
        "--compare-name",
        "fake-openai",
        "--output-dir",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["schema"] == "lmiserve-bench/1"
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["dtype_setting"] == "fp32"
    machine = report["machine"]
    assert machine["cpu"] and isinstance(machine["cpu_flags"], list) and len(machine["load_average_end"]) == 3
    assert report["model"]["name"] == long_model_dir.name and report["versions"]["torch"]
    assert report["command"].startswith("lmiserve bench --model-id")
    assert [s["name"] for s in report["servers"]] == ["lmiserve", "fake-openai"]
    assert report["servers"][1]["model"] == "fake-model"
    for server in report["servers"]:
        assert [lv["concurrency"] for lv in server["levels"]] == [1, 2]
        for lv in server["levels"]:
            assert lv["failed_requests"] == 0 and lv["token_count_errors"] == 0
            assert lv["tokens_received"] == lv["tokens_expected"]
            # warm-up 1 + 2 measured requests per client; warm-up lengths staggered over 1..5
            assert lv["requests"] == 3 * lv["concurrency"] and lv["measured_requests"] == 2 * lv["concurrency"]
            assert lv["tokens_expected"] == {1: 5 + 10, 2: 2 + 5 + 20}[lv["concurrency"]]
            assert lv["output_tokens_per_s"] > 0 and lv["ttft_ms"]["p50"] > 0
        for row in server["ratios"]:
            assert row["server_over_forward"] > 0 and row["server_over_generate"] > 0
    baselines = report["baselines"]
    assert [b["batch_size"] for b in baselines["forward"]] == [b["batch_size"] for b in baselines["generate"]] == [1, 2]
    assert [b["tokens"] for b in baselines["generate"]] == [5, 10]
    memory = report["memory"]
    assert memory["samples"] >= 2 and 0 < memory["rss_start_mib"] <= memory["rss_max_mib"]
    assert memory["timeline"][0] == [0.0, memory["rss_start_mib"]] and len(memory["timeline"]) >= 2
    soak = memory["soak"]
    assert soak["requests"] == 12 and soak["failed_requests"] == 0 and soak["token_count_errors"] == 0
    assert soak["drift_pct"] is not None
    targets = {t["id"]: t for t in report["targets"]}
    assert targets["c1_vs_forward"]["passed"] in (True, False) and targets["c32_vs_forward"]["passed"] is None
    assert targets["exact_tokens"]["passed"] is True and targets["rss_stable"]["value"] is not None
    png = out / "bench.png"
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000
    assert (out / "server.log").stat().st_size > 0
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [r[:2] for r in rows if len(r) > 2 and r[0] in ("lmiserve", "fake-openai") and r[1].isdigit()] == [
        ["lmiserve", "1"],
        ["lmiserve", "2"],
        ["fake-openai", "1"],
        ["fake-openai", "2"],
    ]
    assert "targets (issue #5):" in result.stdout and "wrote " in result.stdout
    assert any(line.startswith(f"CPU: {machine['cpu']}") for line in result.stdout.splitlines())


def test_bench_chat_scenario_with_a_peer(lmi_url, openai_url, tmp_path):
    out = tmp_path / "chat"
    result = run_bench(
        "--url",
        lmi_url,
        "--scenario",
        "chat",
        "--compare-url",
        openai_url,
        "--compare-name",
        "peer",
        "--concurrency",
        "2",
        "--chat-turns",
        "3",
        "--chat-conversations",
        "1",
        "--max-new-tokens",
        "3",
        "--skip-baselines",
        "--output-dir",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["scenario"] == "chat" and report["settings"]["chat_turns"] == 3
    assert report["machine"]["load_average_start"] is not None and "cpu_flags" in report["machine"]
    assert [s["name"] for s in report["servers"]] == ["lmiserve", "peer"]
    for server in report["servers"]:
        assert server["levels"] == []
        (level,) = server["chat_levels"]
        assert (
            level["failed_requests"] == 0 and level["tokens_received"] == level["tokens_expected"] == 2 + 3 + 2 * 3 * 3
        )
        assert [t["turn"] for t in level["turns"]] == [1, 2, 3]
    (peer,) = report["peers"]
    assert peer["peer"] == "peer" and peer["scenario"] == "chat" and peer["rows"][0]["lmiserve_over_peer"] > 0
    targets = {t["id"]: t for t in report["targets"]}
    assert targets["c1_vs_peer"]["passed"] is None and targets["high_vs_peer"]["passed"] is None
    assert targets["exact_tokens"]["passed"] is True
    assert "chat scenario (per turn" in result.stdout and "targets (issue #15):" in result.stdout


def test_bench_ab_runs_a_second_lmiserve(long_model_dir, tmp_path):
    """Both servers the bench starts, each with an API key (B its own, by --ab-option): the clients send each
    server its key, and no report or log shows either."""
    out = tmp_path / "ab"
    result = run_bench(
        "--model-id",
        str(long_model_dir),
        "-o",
        f"api_key={SECRET}",
        "--scenario",
        "chat",
        "--ab-option",
        "max_rolling_batch_size=2",
        "--ab-option",
        "api_key=b-secret-91c0",
        "--concurrency",
        "1",
        "--chat-turns",
        "3",
        "--chat-conversations",
        "1",
        "--max-new-tokens",
        "2",
        "--warmup",
        "0",
        "--skip-baselines",
        "--output-dir",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert [s["name"] for s in report["servers"]] == [
        "lmiserve",
        "lmiserve[max_rolling_batch_size=2,api_key=<hidden>]",
    ]
    assert report["servers"][1]["ab"] is True and report["peers"] == []
    ab = report["ab"]
    assert ab["b_options"] == {"max_rolling_batch_size": "2", "api_key": "<hidden>"}
    assert [(r["scenario"], r["concurrency"]) for r in ab["throughput"]] == [("chat", 1)]
    assert ab["late_turn_ttft"][0]["a_over_b"] > 0
    assert "prefix_cache_chat_ttft" not in {t["id"] for t in report["targets"]}  # B did not turn it off
    assert (out / "server-b.log").stat().st_size > 0 and report["files"]["server_b_log"] == "server-b.log"
    assert report["settings"]["server_options"] == {"api_key": "<hidden>"} and report["settings"]["api_key"] is None
    assert f"-o 'api_key={SECRET}'" not in report["command"] and "-o 'api_key=<hidden>'" in report["command"]
    logs = [result.stderr, (out / "server.log").read_text(), (out / "server-b.log").read_text()]
    assert sum("api_key=<hidden>" in line for line in result.stderr.splitlines() if "starting" in line) == 2
    texts = [*logs, (out / "bench.json").read_text(), result.stdout]
    assert all(SECRET not in text and "b-secret-91c0" not in text for text in texts)


# --- --json-schema: every level also constrained ---------------------------------------------------


def test_bench_json_schema_runs_both_phases(lmi_url, long_model_dir, tmp_path):
    out = tmp_path / "schema"
    result = run_bench(
        "--url",
        lmi_url,
        "--model-id",
        str(long_model_dir),  # the grammar figures are measured on this model's tokenizer
        "--concurrency",
        "1,2",
        "--max-new-tokens",
        "6",
        "--skip-baselines",
        "--json-schema",
        "builtin",
        "--output-dir",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["json_schema"] == "builtin"
    (server,) = report["servers"]
    assert [lv["concurrency"] for lv in server["constrained_levels"]] == [1, 2]
    for lv in server["levels"] + server["constrained_levels"]:
        # the builtin schema cannot complete within 6 tokens: constrained requests stream all 6 too
        assert lv["failed_requests"] == 0 and lv["tokens_received"] == lv["tokens_expected"] > 0
    structured = report["structured"]
    assert structured["source"] == "builtin" and structured["schema"]["properties"]["records"]["minItems"] == 2
    assert [row["concurrency"] for row in structured["comparison"]] == [1, 2]
    assert all(row["constrained_over_unconstrained"] > 0 for row in structured["comparison"])
    figures = structured["compile"]
    assert all(figures[key] > 0 for key in ("tokenizer_build_ms", "cold_compile_ms", "cached_compile_ms"))
    assert [m["batch_size"] for m in structured["mask"]] == [1, 2]
    assert all(m["step_mask_ms"] > 0 and m["fill_ms"] > 0 and m["steps"] == 64 for m in structured["mask"])
    targets = {t["id"]: t for t in report["targets"]}
    assert targets["c32_constrained"]["passed"] is None and targets["exact_tokens"]["passed"] is True
    assert "structured output (JSON schema: builtin):" in result.stdout
    assert [line.split()[:2] for line in result.stdout.splitlines() if line.startswith("lmiserve+schema")] == [
        ["lmiserve+schema", "1"],
        ["lmiserve+schema", "2"],
    ]


def test_bench_json_schema_from_a_file_may_end_early(lmi_url, long_model_dir, tmp_path):
    schema = tmp_path / "yes_no.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    out = tmp_path / "file"
    args = ["--url", lmi_url, "--model-id", str(long_model_dir), "--concurrency", "2", "--max-new-tokens", "40"]
    result = run_bench(*args, "--skip-baselines", "--json-schema", str(schema), "--output-dir", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    (level,) = report["servers"][0]["constrained_levels"]
    # a complete object ends the request: fewer tokens than forced, not an error
    assert level["failed_requests"] == 0 and level["token_count_errors"] == 0
    assert 0 < level["tokens_received"] < level["tokens_expected"]
    assert report["structured"]["source"] == str(schema)


def test_bench_json_schema_refused(lmi_url, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}))
    result = run_bench("--url", lmi_url, "--skip-baselines", "--json-schema", str(bad), cwd=tmp_path)
    assert result.returncode == 1 and "failed a probe request: HTTP 4" in result.stderr
    assert "uniqueItems" in result.stderr
    for content, message in (("[1, 2]", "must hold a JSON object"), ("{", "is not JSON")):
        bad.write_text(content)
        result = run_bench("--url", lmi_url, "--json-schema", str(bad), cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr
    result = run_bench("--url", lmi_url, "--json-schema", str(tmp_path / "missing.json"), cwd=tmp_path)
    assert result.returncode == 2 and "cannot read the JSON schema file" in result.stderr


def test_bench_vision_scenario_on_a_tiny_vlm(tiny_vlm_dir, openai_url, tmp_path):
    """One image a request at concurrency 1 and 8 (the default with --scenario vision) on a tiny Qwen2-VL,
    a peer beside it, and generate() with pixel inputs in the same run."""
    out = tmp_path / "vision"
    result = run_bench(
        "--model-id",
        str(tiny_vlm_dir("qwen2_vl")),
        "--scenario",
        "vision",
        "--max-new-tokens",
        "4",
        "--requests-per-client",
        "2",
        "--device",
        "cpu",
        "--compare-url",
        openai_url,
        "--compare-name",
        "peer",
        "--output-dir",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["scenario"] == "vision" and report["settings"]["concurrency"] == [1, 8]
    assert report["settings"]["vision_image_size"] == [640, 480] and report["baselines"] is None
    for server in report["servers"]:
        assert server["levels"] == [] and [lv["concurrency"] for lv in server["vision_levels"]] == [1, 8]
        for lv in server["vision_levels"]:
            assert lv["failed_requests"] == 0 and lv["token_count_errors"] == 0
            assert lv["tokens_received"] == lv["tokens_expected"] and lv["prompt_tokens_mean"] > 0
    lmiserve = report["servers"][0]
    ratios = lmiserve["vision_ratios"]
    assert all(r["server_over_generate"] is not None and r["server_over_generate"] > 0 for r in ratios), ratios
    generate = report["vision_baselines"]["generate"]
    assert [(g["batch_size"], g["tokens"], g["batched"]) for g in generate] == [(1, 4, True), (8, 32, True)]
    assert {t["id"]: t for t in report["targets"]}["exact_tokens"]["passed"] is True
    assert [(p["peer"], p["scenario"]) for p in report["peers"]] == [("peer", "vision")]
    assert "vision scenario (one 640x480 PNG a request" in result.stdout
    assert "generate() with pixel inputs" in result.stdout
