"""The real `anthropic` Python client, unmodified, against `lmiserve serve` on the tiny random model (with
a 4096-token context: the tools' prompt alone is ~300 tokens; served as "tiny") with the API key on:
messages.create (system, multi-turn, stop sequences, max_tokens), messages.stream (the events in order,
the final message equal to the non-streamed greedy one), forced tool use whose input validates against
the tool's schema and a tool_result round trip, count_tokens, the SDK's own exception classes, the key
as `x-api-key`, the requests in the metrics, and the Python examples of docs/protocols/anthropic.md run
as pasted (their address, model and key rewritten to this server's). The wire details on the scripted
engine: tests/unit/test_anthropic_http.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from helpers.server import REPO_ROOT

KEY = "anthropic-test-key"
MESSAGES = [{"role": "user", "content": "What is deep learning?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
DOC = REPO_ROOT / "docs" / "protocols" / "anthropic.md"


@pytest.fixture(scope="module")
def url(server_pool, long_model_dir: Path) -> str:
    args = ["--model-id", str(long_model_dir), "-o", "served_model_name=tiny", "--api-key", KEY]
    return server_pool.url(args)


@pytest.fixture
def client(url) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_with_system_and_turns(client):
    message = client.messages.create(
        model="tiny",
        system="Be brief.",
        messages=[*MESSAGES, {"role": "assistant", "content": "A kind of"}, {"role": "user", "content": "More?"}],
        max_tokens=6,
        extra_body={"temperature": 0},
    )
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == "tiny"
    assert message.stop_reason in ("max_tokens", "end_turn") and message.stop_sequence is None
    assert message.usage.output_tokens <= 6 and message.usage.input_tokens > 0
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 6


def test_max_tokens_and_stop_sequences(client):
    whole = client.messages.create(model="tiny", messages=MESSAGES, max_tokens=24, extra_body={"temperature": 0})
    assert whole.stop_reason in ("max_tokens", "end_turn")
    generated = text(whole)
    cut = client.messages.create(model="tiny", messages=MESSAGES, max_tokens=3, extra_body={"temperature": 0})
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    # a stop sequence taken from the greedy answer ends the same answer there, and is left out
    stops = [generated[i : i + 2] for i in range(2, len(generated) - 2) if generated[i : i + 2].strip()]
    assert stops, generated
    stop = stops[0]
    stopped = client.messages.create(
        model="tiny", messages=MESSAGES, max_tokens=24, extra_body={"temperature": 0}, stop_sequences=[stop]
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert text(stopped) == generated[: generated.index(stop)]


def test_stream_events_and_final_message(client, url):
    whole = client.messages.create(
        model="tiny", system="Be brief.", messages=MESSAGES, max_tokens=8, extra_body={"temperature": 0}
    )
    kinds = []
    with client.messages.stream(
        model="tiny", system="Be brief.", messages=MESSAGES, max_tokens=8, extra_body={"temperature": 0}
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert text(final) == text(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # on the wire: Anthropic's order, `event:` lines, one ping after the first block starts
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    names = re.findall(r"^event: (\w+)$", r.text, re.MULTILINE)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_forced_tool_use_and_a_tool_result_round_trip(client):
    message = client.messages.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=120,
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "tool_use"
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with client.messages.stream(
        model="tiny",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=120,
        extra_body={"temperature": 0},
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    follow = client.messages.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            message.to_param(),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"}]},
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        max_tokens=8,
        extra_body={"temperature": 0},
    )
    assert follow.stop_reason in ("max_tokens", "end_turn") and all(b.type == "text" for b in follow.content)


def test_count_tokens(client):
    message = client.messages.create(
        model="tiny", system="Count me.", messages=MESSAGES, max_tokens=2, extra_body={"temperature": 0}
    )
    counted = client.messages.count_tokens(model="tiny", system="Count me.", messages=MESSAGES)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    with_tools = client.messages.count_tokens(model="tiny", messages=MESSAGES, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_errors_are_the_sdks_exception_classes(client, url):
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", messages=[{"role": "user", "content": [image]}], max_tokens=4)
    assert info.value.status_code == 400 and info.value.body["error"]["type"] == "invalid_request_error"
    assert "text only" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", messages=MESSAGES, max_tokens=4)
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: claude-nope"},
    }
    with (
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError) as denied,
    ):
        wrong.messages.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert denied.value.body["error"]["type"] == "authentication_error"


def test_the_key_as_x_api_key(url):
    with anthropic.Anthropic(base_url=url, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0) as c:
        assert c.messages.create(model="tiny", messages=MESSAGES, max_tokens=2).type == "message"


def test_requests_are_counted_in_the_metrics(client, url):
    client.messages.count_tokens(model="tiny", messages=MESSAGES)
    scrape = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    counted = re.findall(r"^lmiserve_requests_total\{([^}]*)\} (\S+)$", scrape, re.MULTILINE)
    anthropic_ok = [float(v) for labels, v in counted if 'protocol="anthropic"' in labels and 'status="200"' in labels]
    assert anthropic_ok and sum(anthropic_ok) >= 1


def python_examples() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)


def test_the_pages_python_examples_run_as_pasted(url):
    examples = python_examples()
    assert examples, f"no Python example in {DOC}"
    for code in examples:
        code = code.replace("http://localhost:8080", url).replace('"SmolLM2"', '"tiny"')
        code = code.replace('api_key="unused"', f'api_key="{KEY}"')
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"{code}\n{done.stderr[-3000:]}"


def test_the_pages_curl_bodies_are_valid_requests(url):
    """The bodies of the page's curl examples, sent to this server (their answers are the bundled model's:
    tests/e2e/test_doc_examples.py runs them as pasted)."""
    page = DOC.read_text(encoding="utf-8")
    bodies = re.findall(r"-d '(\{.*?\})'", page, re.DOTALL)
    assert bodies
    for raw in bodies:
        body = json.loads(raw)
        if "model" in body:
            body["model"] = "tiny"
        path = "/v1/messages/count_tokens" if "max_tokens" not in body else "/v1/messages"
        r = httpx.post(f"{url}{path}", json=body, headers={"x-api-key": KEY}, timeout=120)
        expected = 400 if '"image"' in raw else 200  # the page's one refusal: an image block
        assert r.status_code == expected, (raw, r.text)
