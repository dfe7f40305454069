"""The real `openai` Python client, unmodified, against `lmiserve serve` on the tiny model, with the
optional API key on."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from helpers.server import run_server

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "What is deep learning?"}]


@pytest.fixture(scope="module")
def url(tiny_model_dir) -> Iterator[str]:
    with run_server(["--model-id", str(tiny_model_dir)], env={"API_KEY": KEY}) as base:
        yield base


@pytest.fixture
def client(url) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


def test_chat_completion(client):
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5 and completion.model == "tiny"


def test_chat_stream_with_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=5, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.total_tokens == whole.usage.total_tokens
    text = "".join(c.choices[0].delta.content for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_logprobs(client):
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_completions(client):
    completion = client.completions.create(model="tiny", prompt="Deep learning is", max_tokens=4, temperature=0)
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 4
    streamed = client.completions.create(
        model="tiny", prompt="Deep learning is", max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


def test_models_list(client):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].object == "model"


def test_error_types(client, url):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5000)
    assert info.value.status_code == 422
    assert info.value.response.json()["error_type"] == "validation"
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=30) as anonymous:
        with pytest.raises(openai.AuthenticationError):
            anonymous.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
