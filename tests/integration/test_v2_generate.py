"""Triton's generate extension on the LLM with plain HTTP: /generate (one JSON object) and
/generate_stream (SSE), parameters, id echo, errors; and the V2 health routes of an LLM server."""

from __future__ import annotations

import json

import requests

TIMEOUT = 60


def test_generate_matches_lmi(server):
    expected = server.generate("Once upon a time", max_new_tokens=8)["generated_text"]
    r = requests.post(
        f"{server.url}/v2/models/{server.name}/generate",
        timeout=TIMEOUT,
        json={"id": "42", "text_input": "Once upon a time", "parameters": {"max_new_tokens": 8, "stream": False}},
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"id": "42", "model_name": server.name, "model_version": "1", "text_output": expected}
    # extra top-level keys are parameters too
    r = requests.post(
        f"{server.url}/v2/models/{server.name}/versions/1/generate",
        json={"text_input": "Once upon a time", "max_new_tokens": 8},
        timeout=TIMEOUT,
    )
    assert r.json()["text_output"] == expected and "id" not in r.json()


def test_generate_stream_is_sse_whose_pieces_make_the_text(server):
    expected = server.generate("Once upon a time", max_new_tokens=8)["generated_text"]
    with requests.post(
        f"{server.url}/v2/models/{server.name}/generate_stream",
        stream=True,
        timeout=TIMEOUT,
        json={"id": "s1", "text_input": "Once upon a time", "parameters": {"max_new_tokens": 8}},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        body = r.content.decode()
    events = [json.loads(chunk[len("data: ") :]) for chunk in body.split("\n\n") if chunk]
    assert events and all(e["id"] == "s1" and e["model_name"] == server.name for e in events)
    assert "".join(e["text_output"] for e in events) == expected


def test_generate_takes_triton_spellings(server):
    """TensorRT-LLM's and vLLM's parameter names on a real server: max_tokens is max_new_tokens; a
    parameter /generate cannot honour is a 400, never ignored."""
    expected = server.generate("Once upon a time", max_new_tokens=5)["generated_text"]
    url = f"{server.url}/v2/models/{server.name}/generate"
    body = {"text_input": "Once upon a time", "max_tokens": 5, "exclude_input_in_output": True, "beam_width": 1}
    r = requests.post(url, json=body, timeout=TIMEOUT)
    assert (r.status_code, r.json()["text_output"]) == (200, expected)
    r = requests.post(url, json={"text_input": "x", "parameters": {"return_log_probs": True}}, timeout=TIMEOUT)
    assert (r.status_code, r.json()) == (
        400,
        {"error": "'return_log_probs' is not supported: /generate answers text_output only"},
    )


def test_generate_errors(server):
    r = requests.post(f"{server.url}/v2/models/{server.name}/generate", json={"text_input": ""}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json() == {"error": "'text_input' must be a non-empty string"}
    r = requests.post(
        f"{server.url}/v2/models/{server.name}/generate_stream",
        json={"text_input": "x", "parameters": {"temperature": -1}},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and "error" in r.json()
    r = requests.post(f"{server.url}/v2/models/nope/generate", json={"text_input": "x"}, timeout=TIMEOUT)
    assert r.status_code == 404 and "error" in r.json()


def test_v2_health_and_infer_on_the_llm(server):
    live = requests.get(f"{server.url}/v2/health/live", timeout=TIMEOUT)
    assert (live.status_code, live.json()) == (200, {"live": True})
    ready = requests.get(f"{server.url}/v2/health/ready", timeout=TIMEOUT)
    assert (ready.status_code, ready.json()) == (200, {"ready": True})
    ready = requests.get(f"{server.url}/v2/models/{server.name}/ready", timeout=TIMEOUT)
    assert (ready.status_code, ready.json()) == (200, {"name": server.name, "ready": True})
    meta = requests.get(f"{server.url}/v2/models/{server.name}", timeout=TIMEOUT).json()
    assert meta["platform"] == "lmiserve_llm" and meta["inputs"] == [
        {"name": "text_input", "datatype": "BYTES", "shape": [-1]}
    ]
    r = requests.post(
        f"{server.url}/v2/models/{server.name}/infer",
        timeout=TIMEOUT,
        json={
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]}],
            "parameters": {"max_new_tokens": 3},
        },
    )
    assert r.json()["outputs"][0]["data"] == [server.generate("Hello", max_new_tokens=3)["generated_text"]]
