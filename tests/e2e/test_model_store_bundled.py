"""End to end: the bundled SmolLM2 and all-MiniLM-L6-v2 served by one process from a model store."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from helpers.server import run_server
from helpers.tensor_models import BUNDLED_LLM_NAME, MINILM_NAME

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(bundled_store):
    with run_server(["--model-store", str(bundled_store)], timeout=300) as url:
        yield url


def post(url, payload, timeout=120):
    return httpx.post(url, content=json.dumps(payload), headers={"content-type": "application/json"}, timeout=timeout)


def test_both_models_are_listed_and_healthy(server):
    assert httpx.get(f"{server}/ping").json() == {
        MINILM_NAME: {"status": "Healthy"},
        BUNDLED_LLM_NAME: {"status": "Healthy"},
    }
    models = httpx.get(f"{server}/models").json()["models"]
    assert [m["modelName"] for m in models] == [MINILM_NAME, BUNDLED_LLM_NAME]
    assert models[1]["modelUrl"].startswith("file:")


def test_the_llm_answers_name_less_and_by_name(server):
    r = post(f"{server}/invocations", {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}})
    assert r.status_code == 200, r.text
    assert "paris" in r.json()["generated_text"].lower()
    named = post(
        f"{server}/predictions/{BUNDLED_LLM_NAME}",
        {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}},
    )
    assert named.json() == r.json()


def test_embeddings_rank_meaning(server):
    sentences = ["How do I bake bread?", "A recipe for baking a loaf of bread.", "The election results were announced."]
    r = post(f"{server}/predictions/{MINILM_NAME}", {"inputs": sentences})
    assert r.status_code == 200, r.text
    emb = np.array(r.json())
    assert emb.shape == (3, 384)
    assert emb[0] @ emb[1] > 0.5 > emb[0] @ emb[2]


def test_concurrent_embeddings_and_generation(server):
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            gen = [
                client.post(
                    f"{server}/invocations", json={"inputs": f"Count to {i}:", "parameters": {"max_new_tokens": 12}}
                )
                for i in range(3)
            ]
            emb = [
                client.post(f"{server}/predictions/{MINILM_NAME}", json={"inputs": f"sentence number {i}"})
                for i in range(8)
            ]
            return await asyncio.gather(*gen, *emb)

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    vectors = [r.json()[0] for r in responses[3:]]
    assert all(len(v) == 384 for v in vectors)
