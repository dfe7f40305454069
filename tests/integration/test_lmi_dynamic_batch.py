"""Dynamic batching (``rolling_batch=disable batch_size=4 max_batch_delay=50``) over real HTTP
(decisions in lmiserve/protocols/lmi/formatters/dynamic_batch.py: the body is always a list of
``{"generated_text": ...}`` in input order, also for a single string input)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

PROMPTS = ["Hello world", "The quick brown fox", "Deep learning is"]
PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "


def post(server, inputs, **parameters):
    return server.post({"inputs": inputs, "parameters": parameters})


def texts(response) -> list[str]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    raw = response.text
    assert raw == json.dumps(json.loads(raw), ensure_ascii=False)
    assert not raw.endswith("\n")
    body = json.loads(raw)
    assert isinstance(body, list)
    assert all(isinstance(item, dict) and list(item) == ["generated_text"] for item in body)
    return [item["generated_text"] for item in body]


@pytest.fixture(scope="module")
def rolling_completions(server):
    """The completions the continuous-batching server gives (greedy: they must be the same)."""
    return [server.generate(p, max_new_tokens=6)["generated_text"] for p in PROMPTS]


def test_list_of_inputs(dynamic_server, rolling_completions):
    out = texts(post(dynamic_server, PROMPTS, max_new_tokens=6, return_full_text=False))
    assert out == rolling_completions


def test_list_of_inputs_with_full_text(dynamic_server, rolling_completions):
    out = texts(post(dynamic_server, PROMPTS, max_new_tokens=6, return_full_text=True))
    assert out == [p + c for p, c in zip(PROMPTS, rolling_completions)]


def test_string_input_gives_a_one_element_list(dynamic_server, rolling_completions):
    out = texts(post(dynamic_server, PROMPTS[0], max_new_tokens=6, return_full_text=False))
    assert out == rolling_completions[:1]


def test_more_inputs_than_batch_size(dynamic_server, rolling_completions):
    inputs = PROMPTS * 2  # 6 > batch_size=4
    out = texts(post(dynamic_server, inputs, max_new_tokens=6, return_full_text=False))
    assert out == rolling_completions * 2


def test_concurrent_requests_are_batched_independently(dynamic_server, rolling_completions):
    with ThreadPoolExecutor(max_workers=3) as pool:
        responses = list(pool.map(lambda p: post(dynamic_server, p, max_new_tokens=6, return_full_text=False), PROMPTS))
    assert [texts(r) for r in responses] == [[c] for c in rolling_completions]


def test_stream_without_enable_streaming_is_one_body(dynamic_server, rolling_completions):
    response = dynamic_server.post(
        {"inputs": PROMPTS, "stream": True, "parameters": {"max_new_tokens": 6, "return_full_text": False}}
    )
    assert texts(response) == rolling_completions


def test_max_new_tokens_per_input(dynamic_server):
    out = texts(post(dynamic_server, PROMPTS, max_new_tokens=1, return_full_text=False, ignore_eos_token=True))
    assert len(out) == 3


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "Invalid request payload. The 'inputs' field must be a string. Received type <class 'list'>"),
        (["a", 1], "Invalid request payload. The 'inputs' field must be a string. Received type <class 'list'>"),
        (
            ["a", ""],
            "Invalid request payload. The 'inputs' field does not contain any content. "
            "Received payload {'inputs': ['a', ''], 'parameters': {}}",
        ),
    ],
)
def test_bad_inputs(dynamic_server, inputs, message):
    response = dynamic_server.post({"inputs": inputs, "parameters": {}})
    assert response.status_code == 424, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": PREFIX + message, "code": 424}


def test_describe_model_reports_the_dynamic_batch(dynamic_server):
    model = dynamic_server.get(f"/models/{dynamic_server.name}").json()[0]["models"][0]
    assert model["batchSize"] == 4
    assert model["maxBatchDelayMillis"] == 50
    assert dynamic_server.get("/ping").status_code == 200
