"""SageMaker /invocations content types with plain `requests` against real servers: the LLM keeps LMI's
JSON semantics, takes JSON Lines (one LMI request per line) and CSV prompts; the affine and MiniLM models
take JSON, JSON Lines and CSV; Accept negotiation, 406, 415 and custom attributes."""

from __future__ import annotations

import json

import numpy as np
import requests

from helpers.tensor_models import affine_reference

TIMEOUT = 60
ATTR = "X-Amzn-SageMaker-Custom-Attributes"


def test_llm_json_body_keeps_lmi_semantics(server):
    r = requests.post(
        f"{server.url}/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, timeout=TIMEOUT
    )
    assert r.status_code == 200 and set(r.json()) == {"generated_text"}


def test_llm_json_lines_batch(server):
    lines = [
        {"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
        {"inputs": "The sky is", "parameters": {"max_new_tokens": 3}},
    ]
    body = "\n".join(json.dumps(line) for line in lines) + "\n"
    r = requests.post(
        f"{server.url}/invocations",
        data=body.encode(),
        timeout=TIMEOUT,
        headers={"content-type": "application/jsonlines", ATTR: "trace=abc"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/jsonlines" and r.headers[ATTR] == "trace=abc"
    out = [json.loads(line) for line in r.text.splitlines()]
    assert out == [server.generate(line["inputs"], **line["parameters"]) for line in lines]
    r = requests.post(
        f"{server.url}/invocations",
        data=body.encode(),
        timeout=TIMEOUT,
        headers={"content-type": "application/jsonlines", "accept": "application/json"},
    )
    assert r.json() == {"predictions": [o["generated_text"] for o in out]}


def test_llm_json_lines_bad_line_is_400(server):
    body = b'{"inputs": "Hello"}\n{"nope": 1}\n'
    r = requests.post(
        f"{server.url}/invocations", data=body, headers={"content-type": "application/jsonlines"}, timeout=TIMEOUT
    )
    assert r.status_code == 400 and r.json()["error"].startswith("line 2: ")


def test_llm_csv_prompts(server):
    r = requests.post(
        f"{server.url}/invocations",
        data=b'Hello\n"Hi, there"\n',
        timeout=TIMEOUT,
        headers={"content-type": "text/csv", "accept": "application/jsonlines"},
    )
    assert r.status_code == 200, r.text
    texts = [json.loads(line)["generated_text"] for line in r.text.splitlines()]
    assert texts == [server.generate(p)["generated_text"] for p in ("Hello", "Hi, there")]


def test_affine_csv_json_and_jsonlines(affine_server):
    url = f"{affine_server.url}/invocations"
    x = np.array([[1, 2, 3, 4], [0.5, 0, -1, 2]], dtype=np.float32)
    y, best = affine_reference(x)
    r = requests.post(url, data=b"1,2,3,4\n0.5,0,-1,2\n", headers={"content-type": "text/csv"}, timeout=TIMEOUT)
    assert r.headers["content-type"] == "text/csv"
    rows = [list(map(float, line.split(","))) for line in r.text.splitlines()]
    np.testing.assert_allclose([row[:2] for row in rows], y, rtol=1e-6)
    assert [row[2] for row in rows] == best.tolist()
    r = requests.post(
        url, data=b"[1,2,3,4]\n[0.5,0,-1,2]\n", headers={"content-type": "application/jsonlines"}, timeout=TIMEOUT
    )
    assert [json.loads(line)["best"] for line in r.text.splitlines()] == best.tolist()
    r = requests.post(
        url, json={"instances": x.tolist()}, headers={"accept": "text/csv, application/json"}, timeout=TIMEOUT
    )
    assert r.headers["content-type"] == "text/csv" and len(r.text.splitlines()) == 2


def test_negotiation_errors(affine_server):
    url = f"{affine_server.url}/invocations"
    r = requests.post(
        url, data=b"1,2,3,4", headers={"content-type": "text/csv", "accept": "application/x-npy"}, timeout=TIMEOUT
    )
    assert r.status_code == 406 and "Accept type application/x-npy is not supported" in r.json()["error"]
    r = requests.post(url, data=b"\x93NUMPY", headers={"content-type": "application/x-npy"}, timeout=TIMEOUT)
    assert r.status_code == 415 and r.json()["error"].startswith("Unsupported Media Type: application/x-npy")


def test_embeddings_jsonlines(minilm_server):
    r = requests.post(
        f"{minilm_server.url}/invocations",
        data=b'"a cat"\n{"text": "a dog"}\n',
        timeout=TIMEOUT,
        headers={"content-type": "application/jsonlines"},
    )
    assert r.status_code == 200, r.text
    rows = [json.loads(line)["embedding"] for line in r.text.splitlines()]
    assert len(rows) == 2 and len(rows[0]) == 384


def test_one_line_jsonlines_stream_request_stays_lmi_streaming(server):
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 3}, "stream": True}).encode()
    r = requests.post(
        f"{server.url}/invocations", data=body, headers={"content-type": "application/jsonlines"}, timeout=TIMEOUT
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/jsonlines"
    tokens = [json.loads(line) for line in r.text.splitlines()]
    assert len(tokens) == 3 and all("token" in t for t in tokens)
