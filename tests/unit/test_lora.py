"""LoRA adapters in the engine (engine/lora/adapters.py, engine/lora/registry.py): greedy output through the engine
equals `generate()` of the base model with the adapter merged by PEFT, token for token, for adapters
of different ranks and target modules, each alone and with rows of three adapters and of the base model
in one batch, on both paged runners (lmiserve's fast forward and transformers' forward); at most
`max_loras` adapters run in a step; at most `max_cpu_loras` stay loaded (least recently used dropped,
loaded again on use); two adapters never share KV blocks; an adapter unregistered or updated while a
request uses it serves that request to its end; adapters that do not fit are refused, naming why."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.lora_adapters import SPECS, AdapterSpec, make_adapter, merged_generate
from lmiserve.core.errors import AdapterNotFound
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.lora import kernels as lora_kernels
from lmiserve.engine.lora.adapters import FAST_PATH_MODULES, AdapterError, read_adapter
from lmiserve.engine.lora.batch import LoraBatch
from lmiserve.engine.lora.registry import LoraLimits

PROMPTS = ["Hello there, how are", "def add(a, b):", "The quick brown fox jumps", "one two three four"]
TOKENS = 12
NAMES = [None, *(spec.name for spec in SPECS)]


@pytest.fixture(scope="module")
def prompt_ids(tiny_model) -> list[list[int]]:
    return [tiny_model.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(tiny_model_dir, lora_adapter_dirs, prompt_ids) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of `generate()` with each adapter merged by PEFT (None: the base model)."""
    return {
        name: merged_generate(tiny_model_dir, lora_adapter_dirs[name] if name else None, prompt_ids, TOKENS)
        for name in NAMES
    }


@contextlib.asynccontextmanager
async def lora_engine(loaded, adapters: dict[str, Path], limits: LoraLimits | None = None, **config):
    engine = create_engine(loaded, EngineConfig(lora=limits or LoraLimits(), cpu_autotune=False, **config))
    assert engine.adapters is not None
    for name, path in adapters.items():
        await asyncio.to_thread(engine.adapters.register, name, path)
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def generate(engine, ids: list[int], adapter: str | None, tokens: int = TOKENS, **params) -> list[int]:
    request = GenerationRequest(
        prompt="",
        prompt_ids=ids,
        params=SamplingParams(max_new_tokens=tokens, ignore_eos_token=True, **params),
        adapter=adapter,
    )
    return [event.token.id async for event in engine.generate(request) if event.token is not None]


def test_the_adapters_differ_from_the_base_model(expected):
    """The test adapters change the output (B is not zero), each in its own way."""
    outputs = [tuple(map(tuple, expected[name])) for name in NAMES]
    assert len(set(outputs)) == len(NAMES)


@pytest.fixture(params=["kernels", "gathered", "stacked"])
def products(request, monkeypatch) -> str:
    """The three ways `LoraBatch` computes a step's products (CPU fp32 takes the compiled kernels up to
    `lora_kernels.MAX_ROWS` rows, then gathers each adapter's rows; a GPU stacks them, masked)."""
    if request.param != "kernels":
        monkeypatch.setattr(lora_kernels, "MAX_ROWS", 0)
    if request.param == "stacked":
        monkeypatch.setattr(LoraBatch, "_apply_gathered", LoraBatch._apply_stacked)
    return request.param


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "generic"])
def test_greedy_output_equals_generate_with_the_adapter_merged(
    tiny_model, lora_adapter_dirs, prompt_ids, expected, fast_path, products
):
    async def run():
        async with lora_engine(tiny_model, lora_adapter_dirs, fast_path=fast_path, max_running=32) as engine:
            assert engine.runner.path == ("fast" if fast_path else "generic")
            alone = {(name, i): await generate(engine, ids, name) for name in NAMES for i, ids in enumerate(prompt_ids)}
            jobs = [(name, i) for i in range(len(prompt_ids)) for name in NAMES]  # interleaved
            mixed = await asyncio.gather(*(generate(engine, prompt_ids[i], name) for name, i in jobs))
            return alone, dict(zip(jobs, mixed))

    alone, mixed = asyncio.run(run())
    for (name, i), tokens in alone.items():
        assert tokens == expected[name][i], (name, i, "alone")
    for (name, i), tokens in mixed.items():
        assert tokens == expected[name][i], (name, i, "mixed")


def test_a_step_runs_at_most_max_loras_adapters(tiny_model, lora_adapter_dirs, prompt_ids, expected):
    """With max_loras=1 requests of two adapters never share a step, and the base model's rows run
    beside either; every output is still the reference."""
    seen: list[set[tuple[int, str]]] = []  # each step's adapters: (load id, name)

    async def run():
        async with lora_engine(tiny_model, lora_adapter_dirs, LoraLimits(max_loras=1), max_running=16) as engine:
            runner = engine.runner
            execute = runner.launch_batch

            def spy(batch):
                out = execute(batch)
                adapters = (runner._requests[r.seq_id].adapter for r in batch.rows)
                seen.append({(a.id, a.name) for a in adapters if a is not None})
                return out

            runner.launch_batch = spy
            jobs = [(name, i) for i in range(2) for name in (None, "alpha", "beta")]
            results = await asyncio.gather(*(generate(engine, prompt_ids[i], name) for name, i in jobs))
            return dict(zip(jobs, results))

    results = asyncio.run(run())
    for (name, i), tokens in results.items():
        assert tokens == expected[name][i]
    assert seen and all(len(ids) <= 1 for ids in seen)
    # both adapters ran, one after the other (by name: with one adapter kept in memory, one read again after the
    # other is a new load, with a new id)
    assert {name for ids in seen for _, name in ids} == {"alpha", "beta"}


def test_max_cpu_loras_drops_the_least_recently_used_and_loads_it_again(
    tiny_model, lora_adapter_dirs, prompt_ids, expected
):
    async def run():
        limits = LoraLimits(max_loras=1, max_cpu_loras=1)
        async with lora_engine(tiny_model, {"alpha": lora_adapter_dirs["alpha"]}, limits) as engine:
            registry = engine.adapters
            await asyncio.to_thread(registry.register, "beta", lora_adapter_dirs["beta"])
            assert registry.get("beta").is_loaded and not registry.get("alpha").is_loaded  # alpha dropped
            first = await generate(engine, prompt_ids[0], "alpha")  # loads alpha again, drops beta
            assert registry.get("alpha").is_loaded and not registry.get("beta").is_loaded
            assert registry.loaded_count() == 1
            await asyncio.to_thread(registry.update, "beta", pin=True, src=lora_adapter_dirs["beta"])
            second = await generate(engine, prompt_ids[1], "alpha")
            assert registry.get("beta").is_loaded  # pinned: never dropped
            return first, second

    first, second = asyncio.run(run())
    assert first == expected["alpha"][0] and second == expected["alpha"][1]


def test_adapters_never_share_kv_blocks(tiny_model, lora_adapter_dirs):
    """The prefix cache keys blocks by adapter: the same prompt reuses blocks of its own adapter only."""
    ids = list(range(10, 90))  # five full blocks of 16

    async def cached(engine, adapter):
        request = GenerationRequest(
            prompt="", prompt_ids=ids, params=SamplingParams(max_new_tokens=2, ignore_eos_token=True), adapter=adapter
        )
        events = [e async for e in engine.generate(request)]
        return events[-1].finish.cached_tokens

    async def run():
        async with lora_engine(tiny_model, lora_adapter_dirs) as engine:
            return [await cached(engine, a) for a in ("alpha", "beta", None, "alpha", None, "beta")]

    alpha, beta, base, alpha_again, base_again, beta_again = asyncio.run(run())
    assert alpha == beta == base == 0
    assert alpha_again > 0 and base_again > 0 and beta_again > 0


def test_an_adapter_unregistered_while_in_use_serves_its_requests_to_the_end(
    tiny_model, lora_adapter_dirs, prompt_ids, expected
):
    async def run():
        async with lora_engine(tiny_model, lora_adapter_dirs) as engine:
            request = GenerationRequest(
                prompt="",
                prompt_ids=prompt_ids[2],
                params=SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True),
                adapter="gamma",
            )
            tokens = []
            async for event in engine.generate(request):
                if event.token is not None:
                    tokens.append(event.token.id)
                if len(tokens) == 2 and "gamma" in engine.adapters:
                    engine.adapters.unregister("gamma")
            with pytest.raises(AdapterNotFound, match="gamma"):
                await generate(engine, prompt_ids[0], "gamma")
            # its weights were released: no request holds any adapter
            assert engine.adapters.running() == {}
            return tokens

    assert asyncio.run(run()) == expected["gamma"][2]


def test_an_adapter_updated_from_other_files_serves_new_requests_with_them(
    tiny_model, lora_adapter_dirs, prompt_ids, expected
):
    async def run():
        async with lora_engine(tiny_model, {"x": lora_adapter_dirs["alpha"]}) as engine:
            before = await generate(engine, prompt_ids[0], "x")
            await asyncio.to_thread(engine.adapters.update, "x", src=lora_adapter_dirs["beta"])
            after = await generate(engine, prompt_ids[0], "x")
            return before, after

    before, after = asyncio.run(run())
    assert before == expected["alpha"][0] and after == expected["beta"][0]


def test_unknown_adapters_are_refused_by_name(tiny_model, lora_adapter_dirs, prompt_ids):
    async def run():
        async with lora_engine(tiny_model, {}) as engine:
            with pytest.raises(AdapterNotFound, match="nope"):
                await generate(engine, prompt_ids[0], "nope")
        plain = create_engine(tiny_model, EngineConfig(cpu_autotune=False))
        plain.start()
        try:
            with pytest.raises(AdapterNotFound, match="enable_lora"):
                await generate(plain, prompt_ids[0], "alpha")
        finally:
            await plain.stop()

    asyncio.run(run())


# ---- adapters that do not fit ------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_read_adapter_reads_rank_alpha_and_targets(tiny_model, lora_adapter_dirs):
    adapter = read_adapter(lora_adapter_dirs["gamma"], tiny_model.model, name="gamma", max_rank=16)
    assert adapter.rank == 16
    assert adapter.target_modules == ["down_proj", "gate_proj", "k_proj", "o_proj"]
    a, b = adapter.modules["model.layers.0.self_attn.k_proj"]
    assert a.shape == (16, 64) and b.shape[1] == 16
    raw = load_file(str(lora_adapter_dirs["gamma"] / "adapter_model.safetensors"))
    b_raw = raw["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert torch.allclose(b, b_raw * (16.0 / 16**0.5))  # rsLoRA: alpha / sqrt(r)


def test_a_rank_above_max_lora_rank_is_refused(tiny_model, lora_adapter_dirs):
    with pytest.raises(AdapterError, match=r"rank 16 .*above max_lora_rank 8"):
        read_adapter(lora_adapter_dirs["gamma"], tiny_model.model, name="gamma", max_rank=8)


def test_an_adapter_of_another_model_shape_is_refused(tiny_model, lora_adapter_dirs, tmp_path):
    folder = _copy(lora_adapter_dirs["alpha"], tmp_path / "wide")
    file = folder / "adapter_model.safetensors"
    tensors = {k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in load_file(str(file)).items()}
    save_file(tensors, str(file))
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.2-1B"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"does not fit this model \(it was made for meta-llama/Llama-3.2-1B\)"):
        read_adapter(folder, tiny_model.model, name="wide", max_rank=16)


def test_modules_outside_the_serving_path_are_refused(tiny_model_dir, tiny_model, tmp_path):
    folder = make_adapter(tiny_model_dir, tmp_path / "head", AdapterSpec("head", 4, ("lm_head", "q_proj"), seed=5))
    file = folder / "adapter_model.safetensors"
    tensors = load_file(str(file))
    with pytest.raises(AdapterError, match="holds base weights of lm_head"):  # PEFT saved the tied head
        read_adapter(folder, tiny_model.model, name="head", max_rank=16)
    save_file({k: v for k, v in tensors.items() if "base_layer" not in k}, str(file))
    with pytest.raises(AdapterError, match="targets lm_head; adapters on this model may target q_proj"):
        read_adapter(folder, tiny_model.model, name="head", max_rank=16, modules=FAST_PATH_MODULES)
    # transformers' forward applies it to any linear
    assert read_adapter(folder, tiny_model.model, name="head", max_rank=16).target_modules == ["lm_head", "q_proj"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "uses DoRA"),
        ({"bias": "all"}, "trains biases"),
        ({"modules_to_save": ["lm_head"]}, "saves whole modules"),
        ({"peft_type": "IA3"}, "IA3 adapter; only LoRA"),
    ],
)
def test_what_lmiserve_would_ignore_is_refused(tiny_model, lora_adapter_dirs, tmp_path, change, message):
    folder = _copy(lora_adapter_dirs["alpha"], tmp_path / "x")
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(change)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=message):
        read_adapter(folder, tiny_model.model, name="x", max_rank=16)


def test_a_folder_that_is_not_an_adapter_is_refused(tiny_model, tiny_model_dir, tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter(tmp_path / "missing", tiny_model.model, name="m", max_rank=16)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tiny_model_dir, tiny_model.model, name="m", max_rank=16)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        read_adapter(tmp_path / "empty", tiny_model.model, name="m", max_rank=16)


def test_registry_names(tiny_model, lora_adapter_dirs):
    engine = create_engine(tiny_model, EngineConfig(lora=LoraLimits(), cpu_autotune=False))
    registry = engine.adapters
    registry.reserved.add("tiny")
    with pytest.raises(ValueError, match="served model's own name"):
        registry.register("tiny", lora_adapter_dirs["alpha"])
    with pytest.raises(ValueError, match="invalid adapter name"):
        registry.register("a/b", lora_adapter_dirs["alpha"])
    registry.register("a", lora_adapter_dirs["alpha"], preload=False)
    assert not registry.get("a").is_loaded
    with pytest.raises(FileExistsError):
        registry.register("a", lora_adapter_dirs["beta"])
    with pytest.raises(AdapterError):  # a lazy registration still checks that it is an adapter
        registry.register("b", lora_adapter_dirs["alpha"].parent)


def test_speculative_decoding_verifies_with_the_adapter(tiny_model, lora_adapter_dirs, prompt_ids, expected):
    """Drafts (prompt lookup) are verified by the model with the row's adapter: the output is unchanged."""
    from lmiserve.engine.speculative.proposers import SpeculationSettings

    spec = SpeculationSettings("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=64)

    async def run():
        async with lora_engine(tiny_model, lora_adapter_dirs, speculation=spec) as engine:
            jobs = [(name, i) for i in range(2) for name in NAMES]
            results = await asyncio.gather(*(generate(engine, prompt_ids[i], name) for name, i in jobs))
            return dict(zip(jobs, results)), engine.speculation.describe()

    results, described = asyncio.run(run())
    for (name, i), tokens in results.items():
        assert tokens == expected[name][i], (name, i)
    assert described["num_draft_tokens"] > 0


def test_demo_adapters_load_and_change_the_output(tiny_model_dir, tiny_model, prompt_ids, expected, tmp_path):
    """`lmiserve.models.lora_demo` (docs/lora.md, `lmiserve bench --lora`) writes adapters the engine
    serves; `lmiserve.bench.lora` reads their load times from the server's log."""
    from lmiserve.bench.lora import adapter_load_times
    from lmiserve.models.lora_demo import LORA_TARGETS, make_adapters

    made = make_adapters(tiny_model_dir, tmp_path, 2, 4, LORA_TARGETS["all"], ["x", "y"], scale=0.2)
    assert sorted(made) == ["x", "y"]
    adapter = read_adapter(made["x"], tiny_model.model, name="x", max_rank=16)
    assert adapter.rank == 4 and adapter.target_modules == sorted(LORA_TARGETS["all"])

    async def run():
        async with lora_engine(tiny_model, made) as engine:
            return [await generate(engine, prompt_ids[0], name) for name in ("x", "y")]

    x, y = asyncio.run(run())
    assert x != expected[None][0] and y != expected[None][0] and x != y
    log = tmp_path / "server.log"
    log.write_text("... adapter x loaded: rank 4, down_proj, gate_proj, 0.1 MiB in 3 ms\n", encoding="utf-8")
    assert adapter_load_times(log) == {"x": {"load_ms": 3.0, "mib": 0.1}}


def test_transformers_forward_applies_adapters_to_gpt2s_conv1d_layers(tiny_model, tmp_path):
    """On the generic path any linear takes an adapter, GPT-2's Conv1D (`c_attn`, `c_fc`, `fan_in_fan_out`)
    included: the output equals `generate()` with the adapter merged by PEFT."""
    import dataclasses

    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    def base():
        torch.manual_seed(7)
        config = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=2)
        return GPT2LMHeadModel(config).eval()

    peft_model = get_peft_model(
        base(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    )
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(tmp_path / "gpt2-lora")
    merged = peft_model.merge_and_unload()
    merged.generation_config.eos_token_id = None
    ids = [5, 17, 42, 99, 7]
    with torch.no_grad():
        reference = merged.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    loaded = dataclasses.replace(tiny_model, model=base(), max_context=256)

    async def run():
        async with lora_engine(loaded, {"g": tmp_path / "gpt2-lora"}) as engine:
            assert engine.runner.path == "generic"
            return await generate(engine, ids, "g"), await generate(engine, ids, None)

    adapted, plain = asyncio.run(run())
    assert adapted == reference[0, len(ids) :].tolist()
    assert adapted != plain


def test_lora_options_parse_vllm_and_tgi_forms():
    from lmiserve.config import Settings
    from lmiserve.config.errors import ConfigError
    from lmiserve.config.lora import parse_lora_adapters, parse_lora_modules
    from lmiserve.config.sources import load_settings

    assert parse_lora_modules('a=/x,b=/y {"name": "c", "path": "/z"}') == [("c", "/z"), ("a", "/x"), ("b", "/y")]
    assert parse_lora_modules('[{"name": "a", "path": "/x", "base_model_name": "m"}]') == [("a", "/x")]
    assert parse_lora_adapters("/models/sql/, chat=/models/c") == [("sql", "/models/sql/"), ("chat", "/models/c")]
    for bad, message in [
        ("a", "'a' is not name=path"),
        ("a=/x a=/y", "adapter 'a' is named twice"),
        ('[{"name": "a"}]', "needs a name and a path"),
        ('[{"name": "a", "path": "/x", "rank": 8}]', "unknown key"),
        ("[1,", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
    settings = load_settings(environ={"LORA_ADAPTERS": "sql=/adapters/sql"})
    assert settings.enable_lora and settings.start_adapters() == [("sql", "/adapters/sql")]
    assert not Settings().enable_lora
    with pytest.raises(ConfigError, match="named by both lora_modules and lora_adapters"):
        Settings.from_options({"lora_modules": "a=/x", "lora_adapters": "a=/y"})
    with pytest.raises(ConfigError, match="batch_invariant"):
        Settings.from_options({"enable_lora": "true", "batch_invariant": "true"})
