"""Speculative decoding on the real bundled model (SmolLM2-135M-Instruct) through real servers and
clients: a server started with ``speculative_config`` answers greedy requests with the very tokens of
`make serve`'s server without it, alone and eight at once, over the OpenAI completions and chat routes
(the `openai` client), TGI's ``/generate`` and LMI's jsonlines stream (one line per token, several of
them a step); ``/metrics`` carries vLLM's ``spec_decode`` counters and TGI's ``/info`` the state."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI

from lmiserve.bench.prompts import REPEAT_PROMPTS

pytestmark = pytest.mark.e2e

TOKENS = 48
SPECS = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    "self_draft": '{"method": "self_draft", "num_speculative_tokens": 4}',
}
QUESTIONS = [
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List the days of the week.",
]


@pytest.fixture(scope="module")
def plain(server_pool, smollm_dir) -> str:
    return server_pool.url([], timeout=300)  # `make serve`'s server


@pytest.fixture(scope="module", params=list(SPECS))
def speculative(request, server_pool, smollm_dir) -> tuple[str, str]:
    spec = SPECS[request.param]
    return request.param, server_pool.url(["-o", f"speculative_config={spec}"], timeout=300)


async def completions(url: str, prompts: list[str], together: bool) -> list[str]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def one(prompt: str) -> str:
        answer = await client.completions.create(
            model="SmolLM2", prompt=prompt, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        return answer.choices[0].text

    if together:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    return [await one(p) for p in prompts]


async def chats(url: str) -> list[str]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = []
    for question in QUESTIONS:
        answer = await client.chat.completions.create(
            model="SmolLM2", messages=[{"role": "user", "content": question}], max_tokens=TOKENS, temperature=0
        )
        out.append(answer.choices[0].message.content or "")
    return out


PROMPTS = [*REPEAT_PROMPTS[:3], *QUESTIONS]
EIGHT = (PROMPTS * 2)[:8]


async def answers(url: str) -> tuple[list[str], list[str], list[str]]:
    """The completions one at a time, the chats, and eight completions at once."""
    return (
        await completions(url, PROMPTS, together=False),
        await chats(url),
        await completions(url, EIGHT, together=True),
    )


@pytest.fixture(scope="module")
def expected(plain) -> tuple[list[str], list[str], list[str]]:
    """The server without speculation's answers, asked once for every speculative server."""
    return asyncio.run(answers(plain))


async def test_greedy_answers_equal_the_server_without_speculation(expected, speculative):
    name, url = speculative
    alone, chat, eight = await answers(url)
    assert alone == expected[0]
    assert chat == expected[1]
    assert eight == expected[2]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        info = (await client.get("/info")).json()["speculative_decoding"]
        metrics = (await client.get("/metrics")).text
    assert info["method"] == ("ngram" if name == "ngram" else "draft_model")
    assert info["num_drafts"] > 0 and info["num_accepted_tokens"] > 0
    for counter in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f"vllm:spec_decode_{counter}_total{{" in metrics
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="SmolLM2-135M-Instruct",position="0"}'
        in metrics
    )


async def test_tgi_and_lmi_streams_carry_every_token(plain, speculative):
    _, url = speculative
    body = {"inputs": REPEAT_PROMPTS[0], "parameters": {"max_new_tokens": TOKENS, "decoder_input_details": False}}
    async with httpx.AsyncClient(timeout=120) as client:
        expected = (await client.post(f"{plain}/generate", json=body)).json()["generated_text"]
        got = (await client.post(f"{url}/generate", json=body)).json()["generated_text"]
        lines = []
        async with client.stream(
            "POST",
            f"{url}/invocations",
            json={**body, "parameters": {"max_new_tokens": TOKENS, "ignore_eos_token": True}, "stream": True},
            headers={"Accept": "application/jsonlines"},
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.strip():
                    lines.append(json.loads(line))
    assert got == expected
    tokens = [line for line in lines if line.get("token")]
    assert len(tokens) == TOKENS, lines[-2:]  # one line a token, however many a step made
