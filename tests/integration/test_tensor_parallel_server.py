"""`lmiserve serve --tensor-parallel-size 2 --device cpu` (issue #25) on the tiny model, as real processes:

- every protocol (LMI, TGI, OpenAI through the `openai` client, KServe V2 generate and infer) answers what a
  one-process server with the same options answers (the session's `server`: ``max_input_len=64``);
- /metrics counts each request once (the workers compute, the leader counts);
- SIGTERM drains the open stream, exits 0 and leaves no process (workers, resource tracker) behind;
- a worker killed (SIGKILL) mid-stream: the stream ends with TGI's in-band error, /ping and the V2 ready
  probe answer 503, the server exits 4 (ENGINE_FAILED), nothing is left;
- a hung worker (SIGSTOP, ``--step-timeout 3``): the request ends with an error, /ping 503, exit 4;
- two nodes on one machine (``--nnodes 2``, node 1 without HTTP): the same greedy text; the leader's SIGTERM
  ends node 1 too;
- with ``--async-scheduling`` (steps sent to the ranks ahead of their answers) the killed worker and the two nodes
  as above.

The shared TP=2 server is this module's (its last user stops it with SIGTERM); the fault tests start their
own."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.serve_process import ServeProcess
from helpers.server import free_port
from helpers.tiny_model import ENDLESS_CONTEXT, with_context
from helpers.waiting import wait_until
from lmiserve.engine.executors.tensor_parallel import HEARTBEAT_S

pytestmark = pytest.mark.integration

TP2 = ["--tensor-parallel-size", "2", "--device", "cpu"]
TIMEOUT = 60.0
GONE_TIMEOUT = 20.0  # a worker notices its parent is gone within PARENT_POLL_S (1 s)


# ---- processes ---------------------------------------------------------------------------------------------


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def workers(pid: int) -> list[psutil.Process]:
    """The server's tensor-parallel workers (spawned processes; not multiprocessing's resource tracker), in
    the order they started (rank order)."""
    found = [p for p in descendants(pid) if "spawn_main" in " ".join(p.cmdline())]
    return sorted(found, key=lambda p: (p.create_time(), p.pid))


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(processes: list[psutil.Process], server: ServeProcess | None = None) -> None:
    wait_until(
        lambda: not any(alive(p) for p in processes),
        f"the processes {[p.pid for p in processes]} are gone"
        + (f"\n{server.describe()[-3000:]}" if server is not None else ""),
        timeout=GONE_TIMEOUT,
        interval=0.1,
    )


def kill_leftovers(processes: list[psutil.Process]) -> None:
    for process in processes:
        if alive(process):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.kill()


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir: Path) -> Iterator[ServeProcess]:
    """TP=2 on the options of the session's `server` (``max_input_len=64``)."""
    with ServeProcess(["--model-id", str(tiny_model_dir), "-o", "max_input_len=64", *TP2]) as server:
        server.wait_healthy()
        started = descendants(server.proc.pid)
        try:
            yield server
        finally:
            kill_leftovers(started)


@pytest.fixture(scope="module")
def tp(tp_server: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tp_server.url, timeout=TIMEOUT, trust_env=False) as client:
        yield client


def test_the_workers_are_two_spawned_processes_and_the_log_says_so(tp_server):
    assert len(workers(tp_server.proc.pid)) == 2
    log = tp_server.stderr()
    assert "tensor parallelism: 2 ranks (2 on this node)" in log
    assert "[rank 0]" in log and "[rank 1]" in log


# ---- every protocol answers the one-process server's text ----------------------------------------------------


LOGPROB_TOL = 1e-4  # the ranks' partial sums add in another order than the whole model's products


def same(a: object, b: object) -> bool:
    """Equal, floats (logprobs) within LOGPROB_TOL."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LOGPROB_TOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _each_protocol(client: httpx.Client, name: str) -> dict[str, object]:
    """What each protocol answers to greedy (and one seeded) requests, as comparable data."""
    out: dict[str, object] = {}
    r = client.post("/invocations", json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12}})
    assert r.status_code == 200, r.text
    out["lmi"] = r.json()
    lmi_stream = client.post(
        "/invocations", json={"inputs": "Hello world", "parameters": {"max_new_tokens": 8}, "stream": True}
    )
    assert lmi_stream.status_code == 200
    out["lmi-stream"] = [json.loads(line) for line in lmi_stream.text.splitlines()]
    params = {"max_new_tokens": 10, "details": True, "decoder_input_details": True, "top_n_tokens": 2}
    r = client.post("/generate", json={"inputs": "The quick brown fox", "parameters": params})
    assert r.status_code == 200, r.text
    out["tgi"] = r.json()
    r = client.post("/generate_stream", json={"inputs": "Numbers like 1, 2, 3", "parameters": {"max_new_tokens": 8}})
    out["tgi-stream"] = [json.loads(e.removeprefix("data:")) for e in r.text.split("\n\n") if e.strip()]
    seeded = {"max_new_tokens": 10, "do_sample": True, "seed": 42, "temperature": 0.8}
    out["tgi-seeded"] = client.post("/generate", json={"inputs": "Seeded", "parameters": seeded}).json()
    with openai.OpenAI(
        base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
    ) as oa:
        completion = oa.completions.create(model=name, prompt="Once upon a time", max_tokens=9, temperature=0)
        out["openai-completion"] = (completion.choices[0].text, completion.usage.completion_tokens)
        chat = oa.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi there"}], max_tokens=9, temperature=0
        )
        out["openai-chat"] = (chat.choices[0].message.content, chat.choices[0].finish_reason)
        seeded_chat = oa.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Tell me"}], max_tokens=9, seed=7, temperature=1.0
        )
        out["openai-chat-seeded"] = seeded_chat.choices[0].message.content
        pieces = oa.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Stream"}], max_tokens=6, temperature=0, stream=True
        )
        out["openai-chat-stream"] = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    r = client.post(f"/v2/models/{name}/generate", json={"text_input": "Once upon a time", "max_tokens": 7})
    assert r.status_code == 200, r.text
    out["v2-generate"] = r.json()
    infer = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["Hello", "Goodbye"]}],
        "parameters": {"max_new_tokens": 5},
    }
    r = client.post(f"/v2/models/{name}/infer", json=infer)
    assert r.status_code == 200, r.text
    out["v2-infer"] = r.json()["outputs"]
    return out


def test_every_protocol_answers_what_one_process_answers(tp, server):
    whole = _each_protocol(server.client, server.name)
    split = _each_protocol(tp, server.name)
    assert split.keys() == whole.keys()
    for protocol in whole:
        assert same(split[protocol], whole[protocol]), (protocol, split[protocol], whole[protocol])
    assert len(split["tgi"]["details"]["tokens"]) == 10  # type: ignore[index]


# ---- /metrics ----------------------------------------------------------------------------------------------


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    def total(samples: dict) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())

    return total(after) - total(before)


def test_metrics_count_each_request_once(tp):
    before = scrape(tp)
    generated = prompt = 0
    for text, tokens in (("Hello world", 4), ("The quick brown fox", 7)):
        parameters = {"max_new_tokens": tokens, "details": True, "decoder_input_details": True}
        details = tp.post("/generate", json={"inputs": text, "parameters": parameters}).json()["details"]
        generated += details["generated_tokens"]
        prompt += len(details["prefill"])
    r = tp.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 5, "temperature": 0})
    usage = r.json()["usage"]
    generated += usage["completion_tokens"]
    prompt += usage["prompt_tokens"]
    after = scrape(tp)
    assert moved(before, after, "tgi_request_count_total") == 3  # TGI's counters count every protocol's
    assert moved(before, after, "tgi_request_success_total") == 3
    assert moved(before, after, "vllm:generation_tokens_total") == generated
    assert moved(before, after, "vllm:prompt_tokens_total") == prompt
    assert moved(before, after, "lmiserve_requests_total", protocol="tgi", model="tiny", status="200") == 2
    assert moved(before, after, "lmiserve_requests_total", protocol="openai", model="tiny", status="200") == 1
    assert moved(before, after, "vllm:request_success_total") == 3


# ---- SIGTERM (the module's last use of `tp_server`) ------------------------------------------------------------


def test_sigterm_drains_the_open_stream_exits_0_and_leaves_no_process(tp_server):
    pid = tp_server.proc.pid
    children = descendants(pid)
    assert len(workers(pid)) == 2
    lines: list[str] = []
    with httpx.Client(base_url=tp_server.url, timeout=TIMEOUT, trust_env=False) as client:
        body = {"inputs": "Deep learning is", "stream": True, "parameters": {"max_new_tokens": 150}}
        with client.stream("POST", "/invocations", json=body) as response:
            stream = response.iter_lines()
            lines.append(next(stream))
            tp_server.send(signal.SIGTERM)
            lines.extend(line for line in stream if line)
    assert tp_server.wait_exit() == 0, tp_server.describe()
    last = json.loads(lines[-1])
    assert "error" not in last and "generated_text" in last, lines[-2:]  # the whole answer, not an error
    assert "Traceback" not in tp_server.stderr()
    assert_all_gone(children, tp_server)


# ---- a worker that dies or hangs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def endless_no_eos_dir(unreachable_eos_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model that never ends a generation early, with a 2**20-token context: a stream runs as long
    as a test needs it."""
    return with_context(unreachable_eos_model_dir, tmp_path_factory.mktemp("endless-no-eos") / "tiny", ENDLESS_CONTEXT)


def fault_server(model_dir: Path, *options: str) -> ServeProcess:
    return ServeProcess(["--model-id", str(model_dir), "-o", f"max_new_tokens_limit={ENDLESS_CONTEXT}", *TP2, *options])


def ping_statuses_until_exit(server: ServeProcess, name: str) -> list[tuple[int | None, int | None]]:
    """(/ping, /v2/models/{name}/ready) statuses, polled until the process exits (None: no answer)."""
    seen = []
    with httpx.Client(base_url=server.url, timeout=5, trust_env=False) as client:
        while server.proc.poll() is None:
            answers: list[int | None] = []
            for path in ("/ping", f"/v2/models/{name}/ready"):
                try:
                    answers.append(client.get(path).status_code)
                except httpx.HTTPError:
                    answers.append(None)
            seen.append((answers[0], answers[1]))
            time.sleep(0.01)
    return seen


def assert_unhealthy_from_the_failure(seen: list[tuple[int | None, int | None]]) -> None:
    """Healthy (200) until the engine noticed the failure, then only 503 or no answer (the server gone):
    never healthy again. The server exits as soon as its open requests ended, so a poll may see no 503
    at all (the failed model's 503 itself is tested on the service, tests/unit/test_async_engine.py)."""
    answers = [status for statuses in seen for status in statuses]  # in the order they were asked
    first = next((i for i, status in enumerate(answers) if status != 200), len(answers))
    assert all(status in (503, None) for status in answers[first:]), seen


OVERLAP = pytest.mark.parametrize("overlap", [[], ["--async-scheduling"]], ids=["serial", "overlapped"])


@OVERLAP
def test_a_killed_worker_ends_the_stream_in_band_turns_unhealthy_and_exits_4(endless_no_eos_dir, overlap):
    """With overlap scheduling too: the leader has a step sent ahead of the one it awaits when the worker dies."""
    with fault_server(endless_no_eos_dir, *overlap) as server:
        server.wait_healthy()
        children = descendants(server.proc.pid)
        try:
            ranks = workers(server.proc.pid)
            assert len(ranks) == 2
            events: list[str] = []
            seen: list = []
            with httpx.Client(base_url=server.url, timeout=TIMEOUT, trust_env=False) as client:
                body = {"inputs": "Deep learning is", "parameters": {"max_new_tokens": ENDLESS_CONTEXT - 64}}
                with client.stream("POST", "/generate_stream", json=body) as response:
                    assert response.status_code == 200
                    stream = response.iter_lines()
                    events.extend(line for line in (next(stream), next(stream), next(stream)) if line)
                    ranks[1].kill()
                    watcher = threading.Thread(target=lambda: seen.extend(ping_statuses_until_exit(server, "tiny")))
                    watcher.start()
                    events.extend(line for line in stream if line)
            assert server.wait_exit() == 4, server.describe()
            watcher.join(TIMEOUT)
            last = json.loads(events[-1].removeprefix("data:"))
            assert set(last) == {"error", "error_type"} and last["error_type"] == "generation", events[-3:]
            assert "ExecutorFailed: tensor-parallel worker rank 1" in last["error"], last
            assert all(json.loads(e.removeprefix("data:")).get("token") for e in events[:-1])
            assert_unhealthy_from_the_failure(seen)
            err = server.stderr()
            assert "lmiserve: engine failed: tiny:" in err and "tensor-parallel worker rank 1" in err, err[-3000:]
            assert_all_gone(children, server)
            # the message says how the worker ended, and says once that the request failed
            assert "was killed by signal 9" in last["error"], last
            assert last["error"].count("Request failed during generation") == 1, last
        finally:
            kill_leftovers(children)


def test_a_hung_worker_fails_the_request_after_step_timeout_and_exits_4(endless_no_eos_dir):
    """Rank 1 stopped: rank 0 waits in the collective (gloo's timeout is step_timeout too) and the leader
    waits for rank 0 (step_timeout): either way the request fails after ~3 s. The leader's close kills the
    stopped worker at once (a failed executor's workers get no grace)."""
    with fault_server(endless_no_eos_dir, "--step-timeout", "3") as server:
        server.wait_healthy()
        children = descendants(server.proc.pid)
        try:
            hung = workers(server.proc.pid)[1]
            hung.suspend()
            seen: list = []
            watcher = threading.Thread(target=lambda: seen.extend(ping_statuses_until_exit(server, "tiny")))
            started = time.monotonic()
            with httpx.Client(base_url=server.url, timeout=TIMEOUT, trust_env=False) as client:
                watcher.start()
                r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
            waited = time.monotonic() - started
            assert (r.status_code, r.json()["error_type"]) == (424, "generation"), r.text  # TGI's generation error
            assert 2.5 < waited < 30, waited
            assert server.wait_exit() == 4, server.describe()
            watcher.join(TIMEOUT)
            assert_unhealthy_from_the_failure(seen)
            assert "lmiserve: engine failed: tiny:" in server.stderr()
            assert "step_timeout=3 s" in r.json()["error"] or "rank" in r.json()["error"], r.text
            assert_all_gone(children, server)  # the stopped one included
        finally:
            kill_leftovers(children)


# ---- two nodes on one machine ---------------------------------------------------------------------------------


@contextlib.contextmanager
def two_nodes(model_dir: Path, *options: str) -> Iterator[tuple[ServeProcess, ServeProcess, list[psutil.Process]]]:
    """Node 1 (workers only) and the leader (node 0, HTTP) of a TP=2 group over loopback, the leader
    healthy; and every process of both (left ones killed at the end)."""
    common = ["--model-id", str(model_dir), *options, *TP2]
    common += ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    with (
        ServeProcess([*common, "--node-rank", "1"], address=False) as node1,
        ServeProcess([*common, "--node-rank", "0"]) as leader,
    ):
        leader.wait_healthy()
        processes = [*descendants(leader.proc.pid), *descendants(node1.proc.pid)]
        try:
            yield leader, node1, processes
        finally:
            kill_leftovers(processes)


@OVERLAP
def test_two_nodes_answer_the_whole_models_text_and_stop_with_the_leader(tiny_model_dir, server, overlap):
    with two_nodes(tiny_model_dir, "-o", "max_input_len=64", *overlap) as (leader, node1, processes):
        assert len(workers(leader.proc.pid)) == len(workers(node1.proc.pid)) == 1
        assert "node 1 of 2: tensor-parallel workers only" in node1.stderr()
        with httpx.Client(base_url=leader.url, timeout=TIMEOUT, trust_env=False) as client:
            for prompt in ("Once upon a time", "The quick brown fox"):
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 16}}
                assert client.post("/invocations", json=body).json() == server.generate(prompt, max_new_tokens=16)
        leader.send(signal.SIGTERM)
        assert leader.wait_exit() == 0, leader.describe()
        assert node1.wait_exit() == 0, node1.describe()
        assert_all_gone(processes)


def test_a_worker_of_another_node_that_dies_while_idle_fails_the_leader(tiny_model_dir):
    """The leader watches its own node's workers by their processes and the other nodes' by a heartbeat
    (an empty batch every HEARTBEAT_S seconds without a step): node 1's worker killed while no request
    runs takes node 1 down (exit 4) and the leader too (exit 4, the gloo error named), nothing left."""
    with two_nodes(tiny_model_dir) as (leader, node1, processes):
        killed = time.monotonic()
        workers(node1.proc.pid)[0].kill()
        assert node1.wait_exit() == 4, node1.describe()
        assert leader.wait_exit() == 4, leader.describe()
        assert time.monotonic() - killed < 3 * HEARTBEAT_S, "the heartbeat found the dead rank late"
        assert "lmiserve: engine failed: tiny:" in leader.stderr()
        assert "Connection closed by peer" in leader.stderr()
        assert_all_gone(processes)
