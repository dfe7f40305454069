"""The real TGI clients, unmodified, against `lmiserve serve` on the tiny model: `text-generation` 0.7.0
and `huggingface_hub.InferenceClient`."""

from __future__ import annotations

import pytest
from huggingface_hub import InferenceClient
from text_generation import AsyncClient, Client
from text_generation.errors import ValidationError
from text_generation.types import FinishReason

PROMPT = "Deep learning is"


@pytest.fixture(scope="module")
def url(server_pool, tiny_model_dir) -> str:
    return server_pool.url(["--model-id", str(tiny_model_dir)])  # shared: the tiny model's defaults


# --- text-generation -----------------------------------------------------------------------------------


def test_text_generation_generate_details(url):
    response = Client(url, timeout=30).generate(PROMPT, max_new_tokens=5)
    assert response.details.finish_reason == FinishReason.Length
    assert response.details.generated_tokens == 5 and len(response.details.tokens) == 5
    assert response.details.seed is None  # greedy
    assert response.generated_text == "".join(t.text for t in response.details.tokens)


def test_text_generation_stream_matches_generate(url):
    client = Client(url, timeout=30)
    whole = client.generate(PROMPT, max_new_tokens=6)
    events = list(client.generate_stream(PROMPT, max_new_tokens=6))
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert events[-1].generated_text == whole.generated_text
    assert events[-1].details.finish_reason == FinishReason.Length and events[-1].details.generated_tokens == 6
    assert all(e.details is None for e in events[:-1])


def test_text_generation_best_of_top_n_tokens_decoder_input_details(no_eos_server):
    # unseeded sampling (TGI forbids a seed with best_of > 1) on a model that cannot generate EOS:
    # exactly max_new_tokens tokens every time
    response = Client(no_eos_server.url, timeout=30).generate(
        PROMPT, max_new_tokens=3, best_of=2, do_sample=True, top_n_tokens=2, decoder_input_details=True
    )
    details = response.details
    assert len(details.best_of_sequences) == 1 and details.best_of_sequences[0].generated_tokens == 3
    assert len(details.top_tokens) == 3 and all(len(step) == 2 for step in details.top_tokens)
    assert details.prefill[0].logprob is None and len(details.prefill) >= 2
    assert isinstance(details.seed, int)


def test_text_generation_stop_sequences(url):
    client = Client(url, timeout=30)
    full = client.generate(PROMPT, max_new_tokens=12).generated_text
    stop = full[len(full) // 2 :][:2]
    response = client.generate(PROMPT, max_new_tokens=12, stop_sequences=[stop])
    assert response.details.finish_reason == FinishReason.StopSequence
    assert response.generated_text.endswith(stop)


def test_text_generation_validation_error(url):
    with pytest.raises(ValidationError, match=r"`inputs` tokens \+ `max_new_tokens` must be <= 256"):
        Client(url, timeout=30).generate(PROMPT, max_new_tokens=1000)
    with pytest.raises(ValidationError, match="`top_n_tokens` must be >= 0 and <= 5. Given: 9"):
        list(Client(url, timeout=30).generate_stream(PROMPT, max_new_tokens=2, top_n_tokens=9))


async def test_text_generation_async_client(url):
    client = AsyncClient(url, timeout=30)
    response = await client.generate(PROMPT, max_new_tokens=3)
    events = [e async for e in client.generate_stream(PROMPT, max_new_tokens=3)]
    assert events[-1].generated_text == response.generated_text


# --- huggingface_hub ------------------------------------------------------------------------------------


def test_hub_text_generation(url):
    client = InferenceClient(base_url=url)
    text = client.text_generation(PROMPT, max_new_tokens=5)
    detailed = client.text_generation(PROMPT, max_new_tokens=5, details=True)
    assert detailed.generated_text == text
    assert detailed.details.finish_reason == "length" and detailed.details.generated_tokens == 5
    streamed = list(client.text_generation(PROMPT, max_new_tokens=5, stream=True))
    assert "".join(streamed) == text
    streamed_details = list(client.text_generation(PROMPT, max_new_tokens=5, stream=True, details=True))
    assert streamed_details[-1].details.finish_reason == "length"
    assert streamed_details[-1].generated_text == text


def test_hub_chat_completion(url):
    client = InferenceClient(base_url=url)
    messages = [{"role": "user", "content": "What is deep learning?"}]
    whole = client.chat_completion(messages, max_tokens=5, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 5
    assert whole.model == "dummy"  # the hub client's placeholder is echoed
    chunks = list(client.chat_completion(messages, max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_hub_health_and_info(url):
    client = InferenceClient(model=url, provider="hf-inference")
    assert client.health_check() is True
    info = client.get_endpoint_info()
    assert info["max_total_tokens"] == 256 and info["model_pipeline_tag"] == "text-generation"
