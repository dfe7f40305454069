"""The three real clients, unmodified, against `lmiserve serve` with the bundled SmolLM2-135M-Instruct
(started with no model configured, as `make serve` does): text-generation, huggingface_hub's
InferenceClient and openai. Short generations; greedy where the text is compared."""

from __future__ import annotations

import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.errors import ValidationError
from text_generation.types import FinishReason

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url(server_pool, smollm_dir):  # converts the bundled GGUF into the user cache once
    return server_pool.url([], timeout=300)  # `make serve`'s server, shared with the other e2e modules


def test_text_generation_client(url):
    client = Client(url, timeout=120)
    response = client.generate("The capital of France is", max_new_tokens=8, decoder_input_details=True, top_n_tokens=2)
    assert response.details.generated_tokens == len(response.details.tokens) <= 8
    assert "paris" in response.generated_text.lower()
    assert response.details.prefill[0].logprob is None and len(response.details.top_tokens[0]) == 2
    events = list(client.generate_stream("The capital of France is", max_new_tokens=8))
    assert events[-1].generated_text == response.generated_text
    best = client.generate("The capital of France is", max_new_tokens=4, best_of=2, do_sample=True)
    assert len(best.details.best_of_sequences) == 1
    stopped = client.generate("The capital of France is", max_new_tokens=8, stop_sequences=["Paris"])
    assert stopped.details.finish_reason == FinishReason.StopSequence and stopped.generated_text.endswith("Paris")
    with pytest.raises(ValidationError):
        client.generate("Hello", max_new_tokens=10**6)


def test_huggingface_hub_client(url):
    client = InferenceClient(base_url=url)
    text = client.text_generation("The capital of France is", max_new_tokens=8)
    assert "paris" in text.lower()
    detailed = client.text_generation("The capital of France is", max_new_tokens=8, details=True)
    assert detailed.generated_text == text and detailed.details.generated_tokens <= 8
    assert "".join(client.text_generation("The capital of France is", max_new_tokens=8, stream=True)) == text
    chat = client.chat_completion(QUESTION, max_tokens=12, temperature=0)
    answer = chat.choices[0].message.content
    assert "paris" in answer.lower()
    chunks = list(client.chat_completion(QUESTION, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content for c in chunks) == answer
    health = InferenceClient(model=url, provider="hf-inference")
    assert health.health_check() is True
    assert health.get_endpoint_info()["model_id"] == "SmolLM2-135M-Instruct"


def test_openai_client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        chat = client.chat.completions.create(model="SmolLM2", messages=QUESTION, max_tokens=12, temperature=0)
        assert "paris" in chat.choices[0].message.content.lower()
        stream = client.chat.completions.create(
            model="SmolLM2",
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == chat.choices[0].message.content
        assert chunks[-1].usage.total_tokens == chat.usage.total_tokens
        completion = client.completions.create(
            model="SmolLM2", prompt="The capital of France is", max_tokens=6, temperature=0
        )
        assert "paris" in completion.choices[0].text.lower()
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="SmolLM2", messages=QUESTION, max_tokens=10**6)
        with pytest.raises(openai.NotFoundError):  # SmolLM2 is one of the bundled model's names; this is none
            client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
