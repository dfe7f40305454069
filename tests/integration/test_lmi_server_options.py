"""Server-level options over real HTTP: ``tgi_compat=true`` and
``output_formatter=jsonlines`` (every request streams, a request may override; that server also
prefills in chunks of 4 tokens, which must change nothing a client sees)."""

from __future__ import annotations

import json

import pytest

PROMPT = "What is Deep Learning?"


def is_lmi_json(raw: str) -> bool:
    return raw == json.dumps(json.loads(raw), ensure_ascii=False)


# --- tgi_compat=true -------------------------------------------------------------------------------------
# LMI's TGI-flavoured formatters answer on /predictions/{model}; plain /invocations with an `inputs` body
# answers exactly like TGI's POST / (tests/unit/test_tgi_text_http.py, in process).


def lmi_tgi(server) -> str:
    return f"/predictions/{server.name}"


def test_tgi_non_stream_is_a_one_element_array_with_details(tgi_server):
    response = tgi_server.post(
        path=lmi_tgi(tgi_server), payload={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    raw = response.text
    assert raw.startswith('[{"generated_text": ') and raw.endswith("]")
    assert is_lmi_json(raw)
    body = json.loads(raw)
    assert isinstance(body, list) and len(body) == 1
    item = body[0]
    assert list(item) == ["generated_text", "details"]
    details = item["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "inputs", "tokens"]
    assert details["inputs"] == PROMPT
    assert details["generated_tokens"] == len(details["tokens"]) <= 5
    for token in details["tokens"]:
        assert list(token)[:3] == ["id", "text", "logprob"]
        assert set(token) <= {"id", "text", "logprob", "special"}
        assert "log_prob" not in token and "special_token" not in token
    assert '"log_prob"' not in raw
    assert "".join(t["text"] for t in details["tokens"]) == item["generated_text"]


def test_tgi_details_false(tgi_server):
    response = tgi_server.post(
        path=lmi_tgi(tgi_server), payload={"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": False}}
    )
    assert response.status_code == 200, response.text
    body = json.loads(response.text)
    assert isinstance(body, list) and len(body) == 1
    assert list(body[0]) == ["generated_text"]
    assert response.text == '[{"generated_text": ' + json.dumps(body[0]["generated_text"], ensure_ascii=False) + "}]"


def test_tgi_stream_is_sse(tgi_server):
    response = tgi_server.post(
        {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 6, "ignore_eos_token": True}},
        path=lmi_tgi(tgi_server),
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream"
    events = tgi_server.sse(response.text)
    assert len(events) == 6
    for event in events:
        assert list(event["token"])[:3] == ["id", "text", "logprob"]
        assert isinstance(event["token"]["id"], int) and isinstance(event["token"]["logprob"], float)
    assert all(list(e) == ["token"] for e in events[:-1])
    last = events[-1]
    assert list(last) == ["token", "generated_text", "details"]  # details on by default
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 6, "inputs": PROMPT}
    assert "".join(e["token"]["text"] for e in events) == last["generated_text"]


def test_tgi_stream_details_false(tgi_server):
    response = tgi_server.post(
        path=lmi_tgi(tgi_server),
        payload={"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3, "details": False}},
    )
    assert response.status_code == 200, response.text
    last = tgi_server.sse(response.text)[-1]
    assert list(last) == ["token", "generated_text"]


def test_tgi_same_tokens_as_lmi(tgi_server, server):
    tgi = tgi_server.post(
        path=lmi_tgi(tgi_server), payload={"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
    ).json()[0]
    lmi = server.generate(PROMPT, max_new_tokens=8, details=True)
    assert tgi["generated_text"] == lmi["generated_text"]
    assert [t["id"] for t in tgi["details"]["tokens"]] == [t["id"] for t in lmi["details"]["tokens"]]


def test_huggingface_hub_payload(tgi_server):
    """What InferenceClient.text_generation(prompt, details=True) sends."""
    payload = {
        "inputs": PROMPT,
        "parameters": {
            "details": True,
            "decoder_input_details": False,
            "do_sample": False,
            "max_new_tokens": 4,
            "return_full_text": False,
            "stop": [],
            "watermark": False,
        },
        "stream": False,
    }
    response = tgi_server.post(payload)
    assert response.status_code == 200, response.text
    details = response.json()[0]["details"]
    assert details["finish_reason"] in ("length", "eos_token")
    assert isinstance(details["generated_tokens"], int)


def test_tgi_errors_keep_the_lmi_shape(tgi_server):
    response = tgi_server.post({"inputs": ""}, path=lmi_tgi(tgi_server))
    assert response.status_code == 424
    assert response.headers["content-type"] == "application/json"
    assert list(response.json()) == ["error", "code"]


def test_tgi_request_can_still_ask_for_jsonlines(tgi_server):
    """tgi_compat with jsonlines -> TGI token keys and details by default, no data: prefix."""
    response = tgi_server.post(
        {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3, "output_formatter": "jsonlines"}}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/jsonlines"
    lines = tgi_server.jsonlines(response.text)
    assert all("logprob" in line["token"] for line in lines)
    assert "details" in lines[-1]


# --- output_formatter=jsonlines ---------------------------------------------------------------------------


def test_jsonlines_option_streams_without_stream_flag(jsonlines_server):
    response = jsonlines_server.post(
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "ignore_eos_token": True, "details": True}}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/jsonlines"
    lines = jsonlines_server.jsonlines(response.text)
    assert len(lines) == 5
    assert all(list(line["token"])[:3] == ["id", "text", "log_prob"] for line in lines)
    assert lines[-1]["details"] == {"finish_reason": "length", "generated_tokens": 5, "inputs": PROMPT}
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]


def test_jsonlines_option_request_override_to_json(jsonlines_server):
    response = jsonlines_server.post(
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "output_formatter": "json"}}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert list(response.json()) == ["generated_text"]


def test_jsonlines_option_request_override_to_sse(jsonlines_server):
    response = jsonlines_server.post(
        {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3, "output_formatter": "sse"}}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream"
    assert 1 <= len(jsonlines_server.sse(response.text)) <= 3


def test_chunked_prefill_changes_nothing(jsonlines_server, server):
    prompt = "The quick brown fox jumps over the lazy dog. Deep learning is"  # 15 tokens, 4 chunks
    parameters = {"max_new_tokens": 10, "details": True, "decoder_input_details": True, "top_n_tokens": 2}
    chunked = jsonlines_server.post({"inputs": prompt, "parameters": {**parameters, "output_formatter": "json"}}).json()
    whole = server.generate(prompt, **parameters)
    assert chunked["generated_text"] == whole["generated_text"]
    a, b = chunked["details"], whole["details"]
    assert [t["id"] for t in a["tokens"]] == [t["id"] for t in b["tokens"]]
    assert [t["id"] for t in a["prefill"]] == [t["id"] for t in b["prefill"]]
    assert len(a["prefill"]) > 8
    assert a["prefill"][0]["log_prob"] is None
    assert [t["log_prob"] for t in a["prefill"][1:]] == pytest.approx(
        [t["log_prob"] for t in b["prefill"][1:]], abs=1e-4
    )
