"""Request ids and access lines on a real server whose log (stderr) the tests read.

The server (`logged`) runs the 2**20-context tiny model (a stream may run until its client leaves)
with an API key, ``max_request_size=4096`` and ``--log-level debug`` (the engine's per-request lines);
`json_logged` runs the tiny model with ``--log-format json``. Every request goes out with its own
X-Request-Id (or none, where the server must make one), and the test waits for the access line
naming it: the line is written when the response is over, which may be just after the client has
read the last byte.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.server import read_log, run_server
from helpers.tiny_model import ENDLESS_CONTEXT
from helpers.waiting import wait_until

KEY = "log-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_REQUEST = 4096
TIMEOUT = 60.0
LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>\S+)(?: \[(?P<id>[^\]]+)\])?: (?P<message>.*)$")
PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
HEX_ID = re.compile(r"[0-9a-f]{32}")


@dataclass
class Logged:
    url: str
    name: str
    log: Path
    client: httpx.Client

    def lines(self) -> list[str]:
        return read_log(self.log)

    def about(self, request_id: str) -> list[re.Match[str]]:
        """The parsed text lines carrying `request_id`."""
        return [m for line in self.lines() if (m := LINE.match(line)) and m["id"] == request_id]

    def access(self, request_id: str) -> dict[str, str]:
        """The access line of `request_id` (waits for it), as its logfmt fields; exactly one."""
        wait_until(lambda: any(m["logger"] == "lmiserve.access" for m in self.about(request_id)), "the access line")
        lines = [m for m in self.about(request_id) if m["logger"] == "lmiserve.access"]
        assert len(lines) == 1, lines
        return {k: json.loads(v) if v.startswith('"') else v for k, v in PAIR.findall(lines[0]["message"])}


def new_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def logged(endless_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = ["--model-id", str(endless_model_dir), "--api-key", KEY, "--log-level", "debug"]
    for option in (f"max_request_size={MAX_REQUEST}", f"max_new_tokens_limit={ENDLESS_CONTEXT}"):
        args += ["-o", option]
    with (
        run_server(args, stderr_path=log) as url,
        httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False, headers=AUTH) as client,
    ):
        yield Logged(url, endless_model_dir.name, log, client)


def post(logged: Logged, path: str, payload: dict, request_id: str | None, **headers: str) -> httpx.Response:
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return logged.client.post(path, json=payload, headers=headers)


# ---- the id: accepted, made, echoed --------------------------------------------------------------------


def test_tgi_request_id_echoed_and_on_every_line_about_it(logged):
    rid = new_id()
    r = post(logged, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True}}, rid)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    assert r.headers["requestid"] == rid  # LMI's echo of a client's id
    fields = logged.access(rid)
    details = r.json()["details"]
    assert fields["method"] == "POST" and fields["path"] == "/generate" and fields["route"] == "/generate"
    assert (fields["protocol"], fields["model"], fields["status"]) == ("tgi", logged.name, "200")
    assert fields["prompt_tokens"] == r.headers["x-prompt-tokens"]
    assert int(fields["generated_tokens"]) == details["generated_tokens"] == 3
    assert fields["finish_reason"] == "length" == details["finish_reason"]
    assert 0 < float(fields["time_to_first_token"]) <= float(fields["total_time"])
    engine = [m["message"] for m in logged.about(rid) if m["logger"].startswith("lmiserve.engine.core.")]
    assert any(m.startswith("queued:") for m in engine) and any(m.startswith("finished: length") for m in engine)


def test_an_id_is_made_when_the_client_sends_none(logged):
    r = post(logged, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, None)
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert HEX_ID.fullmatch(rid)
    assert "requestid" not in r.headers  # LMI echoes only a client's id
    assert logged.access(rid)["status"] == "200"
    again = post(logged, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, None)
    assert again.headers["x-request-id"] != rid


@pytest.mark.parametrize("header", ["X-Amzn-RequestId", "X-Amzn-SageMaker-Inference-Id"])
def test_sagemaker_request_id_headers(logged, header):
    rid = new_id()
    r = post(logged, "/invocations", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, None, **{header: rid})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == r.headers[header] == r.headers["requestid"] == rid
    assert logged.access(rid)["protocol"] == "lmi"


@pytest.mark.parametrize("bad", ["two words", "x" * 201])
def test_an_unusable_client_id_is_replaced(logged, bad):
    r = post(logged, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}, bad)
    assert r.status_code == 200
    assert HEX_ID.fullmatch(r.headers["x-request-id"])


# ---- access lines per protocol ---------------------------------------------------------------------------


def test_openai_stream_access_line_and_one_id_per_stream(logged):
    rid = new_id()
    payload = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = post(logged, "/v1/chat/completions", payload, rid)
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", ids.pop())
    usage = chunks[-1]["usage"]
    fields = logged.access(rid)
    assert (fields["protocol"], fields["route"], fields["status"]) == ("openai", "/v1/chat/completions", "200")
    assert int(fields["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(fields["generated_tokens"]) == usage["completion_tokens"] == 4
    assert fields["finish_reason"] == "length"
    assert 0 < float(fields["time_to_first_token"]) <= float(fields["total_time"])


def test_the_access_line_names_the_prompt_tokens_the_prefix_cache_supplied(logged):
    messages = [{"role": "system", "content": f"{new_id()} Hello world! How are you today? I am fine."}]
    payload = {"messages": [*messages, {"role": "user", "content": "Hi"}], "max_tokens": 2}
    first, second = new_id(), new_id()
    assert post(logged, "/v1/chat/completions", payload, first).status_code == 200
    r = post(logged, "/v1/chat/completions", payload, second)
    assert r.status_code == 200, r.text
    assert logged.access(first)["cached_tokens"] == "0"
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and logged.access(second)["cached_tokens"] == str(cached)


def test_openai_ids_are_unique(logged):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    completion = {"prompt": "Hi", "max_tokens": 1}
    chat_ids = [post(logged, "/v1/chat/completions", chat, None).json()["id"] for _ in range(3)]
    completion_ids = [post(logged, "/v1/completions", completion, None).json()["id"] for _ in range(3)]
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in chat_ids)
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in completion_ids)
    assert len(set(chat_ids + completion_ids)) == 6


def test_lmi_access_line(logged):
    rid = new_id()
    payload = {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True}}
    r = post(logged, f"/predictions/{logged.name}", payload, rid)
    assert r.status_code == 200, r.text
    fields = logged.access(rid)
    assert (fields["protocol"], fields["route"], fields["model"]) == ("lmi", "/predictions/{model_name}", logged.name)
    assert fields["path"] == f"/predictions/{logged.name}"
    assert fields["generated_tokens"] == "3" and fields["finish_reason"] == "length"
    tokens = post(logged, "/tokenize", {"inputs": "Hello"}, None).json()
    assert int(fields["prompt_tokens"]) == len(tokens)


def test_invocations_answered_by_openai_is_logged_as_openai(logged):
    rid = new_id()
    r = post(logged, "/invocations", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, rid)
    assert r.status_code == 200, r.text
    fields = logged.access(rid)
    assert (fields["protocol"], fields["route"]) == ("openai", "/invocations")
    assert fields["generated_tokens"] == str(r.json()["usage"]["completion_tokens"])


def test_tensor_request_access_line(logged):
    rid = new_id()
    payload = {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hello"]}],
        "parameters": {"max_new_tokens": 2},
    }
    r = post(logged, f"/v2/models/{logged.name}/infer", payload, rid)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    fields = logged.access(rid)
    assert (fields["protocol"], fields["route"], fields["model"]) == ("kserve", "/v2/models/{model}/infer", logged.name)
    assert fields["status"] == "200" and float(fields["total_time"]) > 0
    engine = [m["message"] for m in logged.about(rid) if m["logger"].startswith("lmiserve.engine.core.")]
    assert any(m.startswith("queued:") for m in engine)


# ---- errors ----------------------------------------------------------------------------------------------


def test_422_is_echoed_and_logged(logged):
    rid = new_id()
    r = post(logged, "/generate", {"inputs": ""}, rid)
    assert r.status_code == 422 and r.headers["x-request-id"] == rid
    fields = logged.access(rid)
    assert (fields["status"], fields["protocol"], fields["finish_reason"]) == ("422", "tgi", "-")
    assert fields["prompt_tokens"] == fields["generated_tokens"] == fields["time_to_first_token"] == "-"


def test_413_is_echoed_and_logged(logged):
    rid = new_id()
    r = post(logged, "/v1/completions", {"prompt": "x" * MAX_REQUEST}, rid)
    assert r.status_code == 413 and r.headers["x-request-id"] == rid
    assert logged.access(rid)["status"] == "413"


def test_401_is_echoed_and_logged(logged):
    rid = new_id()
    r = httpx.post(f"{logged.url}/generate", json={"inputs": "x"}, headers={"X-Request-Id": rid}, trust_env=False)
    assert (r.status_code, r.content) == (401, b"") and r.headers["x-request-id"] == rid
    fields = logged.access(rid)
    assert (fields["status"], fields["protocol"], fields["route"]) == ("401", "tgi", "/generate")


def test_404_is_echoed_and_logged(logged):
    rid = new_id()
    r = logged.client.get("/no/such/route", headers={"X-Request-Id": rid})
    assert r.status_code == 404 and r.headers["x-request-id"] == rid
    fields = logged.access(rid)
    assert (fields["status"], fields["route"], fields["path"]) == ("404", "-", "/no/such/route")


# ---- clients that leave ----------------------------------------------------------------------------------


def test_stream_client_disconnect_is_logged_as_cancelled(logged):
    rid = new_id()
    # ignore_eos: sampled (temperature 1), the tiny model may pick its EOS before the server sees the client go
    payload = {"prompt": "Hello", "max_tokens": ENDLESS_CONTEXT - 64, "stream": True, "ignore_eos": True}
    headers = {**AUTH, "X-Request-Id": rid}
    with httpx.Client(base_url=logged.url, timeout=TIMEOUT, trust_env=False) as client:
        with client.stream("POST", "/v1/completions", json=payload, headers=headers) as stream:
            assert stream.status_code == 200
            chunks = stream.iter_bytes()
            received = b""
            while received.count(b"data: {") < 2:
                received += next(chunks)
    fields = logged.access(rid)  # written once the server saw the client go
    assert (fields["status"], fields["finish_reason"], fields["protocol"]) == ("200", "cancelled", "openai")
    assert fields["generated_tokens"] == "-" and float(fields["time_to_first_token"]) > 0
    wait_until(
        lambda: any(m["message"].startswith("aborted:") for m in logged.about(rid)), "the engine aborts the request"
    )


def test_whole_answer_client_timeout_is_logged_as_499_cancelled(logged):
    rid = new_id()
    payload = {"inputs": "Hello", "parameters": {"max_new_tokens": ENDLESS_CONTEXT - 64, "ignore_eos_token": True}}
    with httpx.Client(base_url=logged.url, trust_env=False) as client, pytest.raises(httpx.ReadTimeout):
        client.post(
            "/invocations", json=payload, headers={**AUTH, "X-Request-Id": rid}, timeout=httpx.Timeout(60, read=0.5)
        )
    fields = logged.access(rid)
    assert (fields["status"], fields["finish_reason"]) == ("499", "cancelled")


# ---- JSON lines ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_logged(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    log = tmp_path_factory.mktemp("json-logs") / "server.log"
    args = ["--model-id", str(tiny_model_dir), "--log-format", "json", "--log-level", "debug"]
    with run_server(args, stderr_path=log) as url, httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as c:
        yield Logged(url, tiny_model_dir.name, log, c)


def json_access(logged: Logged, request_id: str) -> dict:
    def found() -> list[dict]:
        docs = [json.loads(line) for line in logged.lines()]
        return [d for d in docs if d["logger"] == "lmiserve.access" and d.get("request_id") == request_id]

    wait_until(lambda: bool(found()), "the access line")
    (doc,) = found()
    return doc


def test_json_log_every_line_is_an_object(json_logged):
    rid = new_id()
    r = post(json_logged, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, rid)
    assert r.status_code == 200
    doc = json_access(json_logged, rid)
    lines = json_logged.lines()
    docs = [json.loads(line) for line in lines]  # every line, uvicorn's and the model load's included
    assert all(isinstance(d, dict) and {"time", "level", "logger", "message"} <= d.keys() for d in docs)
    assert any(d["logger"].startswith("uvicorn") for d in docs)
    assert doc["level"] == "INFO" and doc["message"] == "POST /generate 200"
    assert doc["method"] == "POST" and doc["route"] == "/generate" and doc["protocol"] == "tgi"
    assert doc["status"] == 200 and doc["model"] == json_logged.name
    assert doc["generated_tokens"] == 2 and doc["finish_reason"] == "length"
    assert isinstance(doc["prompt_tokens"], int) and isinstance(doc["total_time"], float)
    assert 0 < doc["time_to_first_token"] <= doc["total_time"]
    engine = [d for d in docs if d["logger"].startswith("lmiserve.engine.core.") and d.get("request_id") == rid]
    assert engine, "the engine's lines about the request carry its id"


def test_json_log_error_fields_are_null(json_logged):
    rid = new_id()
    r = post(json_logged, "/v1/completions", {"prompt": ""}, rid)
    assert r.status_code == 400 and r.headers["x-request-id"] == rid  # OpenAI's status for a bad request
    doc = json_access(json_logged, rid)
    assert doc["status"] == 400 and doc["protocol"] == "openai"
    assert doc["prompt_tokens"] is None and doc["finish_reason"] is None
