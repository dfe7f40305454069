"""LoRA adapters on the real bundled model (SmolLM2-135M-Instruct): three adapters made with PEFT
(different ranks and target modules, random non-zero B) each give, through lmiserve's engine, the very
greedy tokens of `generate()` with that adapter merged into the model by PEFT, alone and with rows of
all three adapters and of the base model in one batch; and through a real server started with
`lora_modules`, the `openai` client naming an adapter as its `model` gets that adapter's tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from helpers.lora_adapters import AdapterSpec, make_adapter, merged_generate
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.lora.registry import LoraLimits

pytestmark = pytest.mark.e2e

TOKENS = 24
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.", "List three colours:"]
SMOL_SPECS = (
    AdapterSpec("qv8", 8, ("q_proj", "v_proj"), seed=11, b_std=0.02),
    AdapterSpec(
        "all4", 4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=12, b_std=0.01
    ),
    AdapterSpec("mlp16", 16, ("gate_proj", "up_proj", "down_proj"), seed=13, alpha=32.0, b_std=0.005, rslora=True),
)
NAMES = [None, *(spec.name for spec in SMOL_SPECS)]


@pytest.fixture(scope="module")
def smol_adapters(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-lora")
    return {spec.name: make_adapter(smollm_dir, root / spec.name, spec) for spec in SMOL_SPECS}


@pytest.fixture(scope="module")
def prompt_ids(smollm_model) -> list[list[int]]:
    return [smollm_model.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(smollm_dir, smol_adapters, prompt_ids) -> dict[str | None, list[list[int]]]:
    return {
        name: merged_generate(smollm_dir, smol_adapters[name] if name else None, prompt_ids, TOKENS) for name in NAMES
    }


def test_each_adapter_changes_the_output(expected):
    assert len({tuple(map(tuple, expected[name])) for name in NAMES}) == len(NAMES)


def test_engine_output_equals_generate_with_the_adapter_merged(smollm_model, smol_adapters, prompt_ids, expected):
    async def run():
        engine = create_engine(smollm_model, EngineConfig(lora=LoraLimits(max_loras=4), max_running=16))
        for name, path in smol_adapters.items():
            engine.adapters.register(name, path)
        engine.start()

        async def one(ids, adapter):
            request = GenerationRequest(
                prompt="",
                prompt_ids=ids,
                params=SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True),
                adapter=adapter,
            )
            return [e.token.id async for e in engine.generate(request) if e.token is not None]

        try:
            alone = {(n, i): await one(ids, n) for n in NAMES for i, ids in enumerate(prompt_ids[:1])}
            jobs = [(n, i) for i in range(len(prompt_ids)) for n in NAMES]
            mixed = await asyncio.gather(*(one(prompt_ids[i], n) for n, i in jobs))
            return alone, dict(zip(jobs, mixed))
        finally:
            await engine.stop()

    alone, mixed = asyncio.run(run())
    for (name, i), tokens in [*alone.items(), *mixed.items()]:
        assert tokens == expected[name][i], (name, i)


def test_a_server_answers_openai_requests_with_the_named_adapter(
    server_pool, smollm_dir, smollm_model, smol_adapters, prompt_ids, expected
):
    modules = " ".join(f"{name}={path}" for name, path in smol_adapters.items())
    url = server_pool.url(["-o", f"lora_modules={modules}"], timeout=300)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def one(model: str, ids: list[int]) -> str:
        answer = await client.completions.create(
            model=model, prompt=ids, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert answer.model == model
        return answer.choices[0].text

    async def run():
        jobs = [(n, i) for i in range(len(prompt_ids)) for n in NAMES]
        got = await asyncio.gather(*(one(n or "SmolLM2-135M-Instruct", prompt_ids[i]) for n, i in jobs))
        return dict(zip(jobs, got))

    decode = smollm_model.tokenizer.decode
    for (name, i), text in asyncio.run(run()).items():
        assert text == decode(expected[name][i], skip_special_tokens=True), (name, i)
