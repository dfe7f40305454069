"""`engine_process=true`: the engine core in a process of its own (engine/process/, models/engine_process.py).

Against the shared in-process `server` (the same options): the same greedy, seeded and constrained output on
every protocol, the same 4xx for a bad request; the metrics see the engine process's tokens; a client that
leaves aborts its request there; SIGTERM stops both processes; the engine process dying fails the server
(503, exit 4, nothing left); with tensor parallelism its ranks are the engine process's children (the same
answers, SIGTERM and a dead rank end them all); with LoRA adapters the registry is the engine process's and
the adapter routes answer from its mirror (the same answers, listing, run-time changes and start errors)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.serve_process import ServeProcess
from helpers.server import run_server
from helpers.waiting import wait_until


@pytest.fixture(scope="module")
def process_server(server_pool, tiny_model_dir: Path) -> Iterator[str]:
    """The `server` fixture's options, with the engine in its own process."""
    yield server_pool.url(["--model-id", str(tiny_model_dir), "-o", "max_input_len=64", "-o", "engine_process=true"])


def children(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (not its resource tracker)."""
    found = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in found if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


REQUESTS = [
    ("/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 12, "temperature": 0}),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 1, "n": 2, "best_of": 3, "seed": 5},
    ),
    (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "Hi",
            "max_tokens": 10,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    ("/generate", {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 9, "details": True}}),
    ("/invocations", {"inputs": "Once upon", "parameters": {"max_new_tokens": 7, "do_sample": True, "seed": 3}}),
]


def answer(url: str, path: str, body: dict) -> object:
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    for key in ("id", "created"):  # per response
        if isinstance(data, dict):
            data.pop(key, None)
    if isinstance(data, dict) and isinstance(data.get("details"), dict):
        data["details"].pop("prefill", None)
    return data


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REQUESTS)])
def test_answers_equal_the_in_process_engines(server, process_server, path, body):
    assert answer(process_server, path, body) == answer(server.url, path, body)


def test_a_stream_equals_the_in_process_engines(server, process_server):
    body = {"model": "tiny", "prompt": "Streams", "max_tokens": 10, "temperature": 0, "stream": True}

    def texts(url: str) -> list[str]:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        return [json.loads(line[6:])["choices"][0]["text"] for line in lines]

    streamed = texts(process_server)
    assert len(streamed) >= 10
    assert streamed == texts(server.url)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 2000}),  # ContextLengthExceeded
        (
            "/generate",
            {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "grammar": {"type": "regex", "value": "("}}},
        ),
        ("/invocations", {"inputs": "word " * 100, "parameters": {"max_new_tokens": 5}}),  # over max_input_len
    ],
)
def test_a_bad_request_gets_the_same_4xx(server, process_server, path, body):
    ours = httpx.post(f"{process_server}{path}", json=body, timeout=60)
    theirs = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert 400 <= ours.status_code < 500, ours.text
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_metrics_count_the_engine_processs_work(process_server):
    before = metric(process_server, "vllm:generation_tokens_total")
    gaps = metric(process_server, "vllm:inter_token_latency_seconds_count")
    answer(process_server, "/v1/completions", {"model": "tiny", "prompt": "Count", "max_tokens": 5, "temperature": 0})
    assert metric(process_server, "vllm:generation_tokens_total") == before + 5
    assert metric(process_server, "vllm:inter_token_latency_seconds_count") == gaps + 4  # each step's statistics
    assert metric(process_server, "vllm:num_requests_running") == 0  # the engine's snapshot


@pytest.fixture(scope="module")
def endless(endless_model_dir: Path) -> Iterator[ServeProcess]:
    """The tiny model with a 2**20-token context in an engine process: a request runs until its client leaves."""
    options = ["engine_process=true", "grpc_port=0", "log_level=debug", "log_format=json"]
    with ServeProcess(["--model-id", str(endless_model_dir), *[a for o in options for a in ("-o", o)]]) as served:
        served.wait_healthy()
        yield served


def test_a_client_that_leaves_aborts_its_request_in_the_engine_process(endless):
    aborted = metric(endless.url, "vllm:request_success_total", 'finished_reason="abort"')
    body = {"inputs": "Go on", "parameters": {"max_new_tokens": 4000, "ignore_eos_token": True}, "stream": True}
    with httpx.stream("POST", f"{endless.url}/invocations", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert metric(endless.url, "vllm:num_requests_running") == 1
    wait_until(lambda: metric(endless.url, "vllm:num_requests_running") == 0, "the request left the batch", timeout=30)
    wait_until(
        lambda: metric(endless.url, "vllm:request_success_total", 'finished_reason="abort"') == aborted + 1,
        "the abort is counted",
        timeout=30,
    )


def test_the_engine_processs_log_lines_are_written_by_the_server(endless):
    """One stream, one format: the engine process's records come out of the server in its JSON lines, with
    the request's id on the engine's lines about it."""
    body = {"inputs": "Log me", "parameters": {"max_new_tokens": 3}}
    response = httpx.post(f"{endless.url}/invocations", json=body, headers={"x-request-id": "ep-log-1"}, timeout=60)
    assert response.status_code == 200

    def lines() -> list[dict]:
        return [json.loads(line) for line in endless.stderr_lines() if line.startswith("{")]

    def engine_line() -> bool:
        return any(
            d["logger"] == "lmiserve.engine.core.async_engine"
            and d["message"].startswith("queued:")
            and d.get("request_id") == "ep-log-1"
            for d in lines()
        )

    wait_until(engine_line, "the engine's line about the request", timeout=30)
    assert any(d["logger"] == "lmiserve.engine.factory" and d["message"].startswith("KV cache:") for d in lines())
    assert not [line for line in endless.stderr_lines() if "INFO:lmiserve" in line]  # no second format inside


def test_sigterm_stops_the_server_and_its_engine_process(endless):
    engine = children(endless.proc.pid)
    assert len(engine) == 1, engine
    endless.send(signal.SIGTERM)
    assert endless.wait_exit() == 0, endless.describe()
    wait_until(lambda: not alive(engine[0]), "the engine process exited", timeout=30)


def test_the_engine_process_dying_fails_the_server(tiny_model_dir):
    with ServeProcess(["--model-id", str(tiny_model_dir), "-o", "engine_process=true", "-o", "grpc_port=0"]) as served:
        served.wait_healthy()
        (engine,) = children(served.proc.pid)
        os.kill(engine, signal.SIGKILL)
        assert served.wait_exit() == 4, served.describe()  # ENGINE_FAILED
        assert f"the engine process (pid {engine}) was killed by signal 9" in served.stderr()


# ---- with LoRA adapters: the registry is the engine process's, the routes the server's ------------------------


@pytest.fixture(scope="module")
def lora_process(tiny_model_dir: Path, lora_modules_option: str, lora_adapter_dirs: dict[str, Path]) -> Iterator[str]:
    """`lora_server`'s adapters (named at start) with the engine in its own process; adapters under
    `allowed_model_paths` may be registered at run time (this module's own server)."""
    allowed = lora_adapter_dirs["alpha"].parent
    options = [f"lora_modules={lora_modules_option}", "engine_process=true", f"allowed_model_paths={allowed}"]
    with run_server(["--model-id", str(tiny_model_dir), *[a for o in options for a in ("-o", o)]]) as url:
        yield url


ADAPTED = [
    ("/v1/completions", {"model": "alpha", "prompt": "Hello there", "max_tokens": 10, "temperature": 0}),
    ("/generate", {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 9, "adapter_id": "beta"}}),
    ("/invocations", {"inputs": "Once upon", "adapters": "gamma", "parameters": {"max_new_tokens": 8}}),
]


@pytest.mark.parametrize(("path", "body"), ADAPTED, ids=[p for p, _ in ADAPTED])
def test_an_adapters_answers_equal_the_in_process_engines(lora_server, lora_process, path, body):
    assert answer(lora_process, path, body) == answer(lora_server.url, path, body)


def test_the_adapters_named_at_start_are_listed_as_in_one_process(lora_server, lora_process):
    def cards(url: str) -> list[tuple[str, str]]:
        data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        return sorted((c["id"], c.get("parent", "")) for c in data)

    assert cards(lora_process) == cards(lora_server.url)
    assert {"alpha", "beta", "gamma"} <= {name for name, _ in cards(lora_process)}


def test_adapters_registered_used_described_and_unregistered_at_run_time(lora_process, lora_adapter_dirs):
    """LMI's adapters API against the engine process's registry: the mirror follows each change and the
    requests an adapter served; an unknown one is the protocol's 404."""
    base = "/models/tiny/adapters"
    with httpx.Client(base_url=lora_process, timeout=60, trust_env=False) as c:
        src = str(lora_adapter_dirs["alpha"])
        registered = c.post(base, params={"name": "late", "src": src})
        assert registered.status_code == 200, registered.text
        assert {"name": "late", "src": src, "pin": False, "loaded": True} in c.get(base).json()["adapters"]
        again = c.post(base, params={"name": "late", "src": src})
        assert again.status_code == 409, again.text  # the engine's FileExistsError, LMI's Conflict
        for _ in range(2):
            done = c.post(
                "/invocations", json={"inputs": "Hi", "adapters": "late", "parameters": {"max_new_tokens": 3}}
            )
            assert done.status_code == 200, done.text
        wait_until(lambda: c.get(f"{base}/late").json()["requests"] == 2, "the mirror counts the requests", timeout=30)
        described = c.get(f"{base}/late").json()
        assert (described["rank"], described["targetModules"], described["running"]) == (8, ["q_proj", "v_proj"], 0)
        assert c.delete(f"{base}/late").status_code == 200
        assert c.get(f"{base}/late").status_code == 404
        gone = c.post("/invocations", json={"inputs": "Hi", "adapters": "late", "parameters": {"max_new_tokens": 3}})
        assert gone.status_code == 404, gone.text
        bad = c.post(base, params={"name": "tiny", "src": src})  # the model's own name
        assert bad.status_code == 400, bad.text


def test_an_adapter_that_does_not_load_at_start_fails_as_in_one_process(tiny_model_dir, tmp_path):
    missing = tmp_path / "nowhere"
    with ServeProcess(
        [
            "--model-id",
            str(tiny_model_dir),
            "-o",
            f"lora_modules=x={missing}",
            "-o",
            "engine_process=true",
            "-o",
            "grpc_port=0",
        ]
    ) as served:
        assert served.wait_exit() == 1, served.describe()
        assert f"adapter x ({missing}) cannot be served: adapter folder {missing} does not exist" in served.stderr()


# ---- with tensor parallelism: the ranks are the engine process's children ------------------------------------

TP2 = ["--tensor-parallel-size", "2", "--device", "cpu"]
GREEDY = [REQUESTS[0], ("/generate", {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 9}})]


@pytest.fixture(scope="module")
def tp_process(tiny_model_dir: Path) -> Iterator[ServeProcess]:
    """The `server` fixture's options over two tensor-parallel ranks, under an engine process."""
    options = ["max_input_len=64", "engine_process=true", "grpc_port=0"]
    with ServeProcess(["--model-id", str(tiny_model_dir), *[a for o in options for a in ("-o", o)], *TP2]) as served:
        served.wait_healthy()
        yield served


def test_tensor_parallel_ranks_are_the_engine_processs_children_and_answer_the_same(server, tp_process):
    (engine,) = children(tp_process.proc.pid)
    assert len(children(engine)) == 2, "the two ranks, spawned by the engine process"
    assert "tensor parallelism: 2 ranks (2 on this node)" in tp_process.stderr()
    for path, body in GREEDY:  # greedy: the ranks' partial sums round otherwise, the tokens do not change
        assert answer(tp_process.url, path, body) == answer(server.url, path, body)


def test_sigterm_stops_the_engine_process_and_its_ranks(tp_process):
    (engine,) = children(tp_process.proc.pid)
    ranks = children(engine)
    tp_process.send(signal.SIGTERM)
    assert tp_process.wait_exit() == 0, tp_process.describe()
    wait_until(
        lambda: not any(alive(p) for p in [engine, *ranks]), "the engine process and its ranks exited", timeout=30
    )


def test_a_rank_that_dies_fails_the_server_through_the_engine_process(tiny_model_dir):
    with ServeProcess(
        ["--model-id", str(tiny_model_dir), "-o", "engine_process=true", "-o", "grpc_port=0", *TP2]
    ) as served:
        served.wait_healthy()
        (engine,) = children(served.proc.pid)
        rank = children(engine)[-1]
        os.kill(rank, signal.SIGKILL)
        assert served.wait_exit() == 4, served.describe()  # ENGINE_FAILED
        wait_until(lambda: not alive(engine), "the engine process exited", timeout=30)
