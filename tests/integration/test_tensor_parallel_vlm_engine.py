"""Vision-language models over tensor parallelism: each family's decoder split over two CPU worker processes (gloo),
its vision tower whole on both, read from its checkpoint as published (LLaVA's and Gemma 3's
``language_model.model.layers.``, the Qwen VLs' ``model.layers.``); the greedy tokens of image prompts, beside a text
prompt, in chunks of 8 (a chunk boundary inside an image), are transformers' `generate()`'s. A preempted M-RoPE
request recomputes on lmiserve's forward, its chunk running past its prompt; an adapter of the decoder gives the
tokens of the model it merges into; `load_format=dummy`, ``quantize=fp8`` at load and the quantized checkpoints
(fp8 by blocks and by channel, AWQ, GPTQ, compressed-tensors' integers) give one process's tokens; a real `lmiserve
serve` of two ranks (with and without `engine_process`) answers the OpenAI client's image chat as `generate()` does.
Speculative decoding with a draft model and a VLM over tensor parallelism is refused before any worker starts, in one
line."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers.tiny_vlm import FAMILIES, MOE_FAMILIES, reference_generate, tiny_image
from helpers.vlm_serving import chat, image_of, processed, prompt_of, reference, same, serve
from lmiserve.config import Settings
from lmiserve.engine.attention.paged import kv_bytes_per_block

pytestmark = pytest.mark.integration

DEGREE = 2


def _engine(path: Path, **options: str) -> Any:
    """The engine of the tiny VLM in `path` over two ranks (not started), loaded as the server loads it."""
    from lmiserve.models.compose import build_tensor_parallel_engine
    from lmiserve.models.load import load_model_shell

    settings = Settings.from_options(
        {"model_id": str(path), "device": "cpu", "dtype": "fp32", "tensor_parallel_degree": str(DEGREE), **options}
    )
    return build_tensor_parallel_engine(load_model_shell(path, dtype="fp32", device="cpu"), settings, DEGREE)


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_FAMILIES])
def test_a_vlm_over_two_ranks_gives_generates_tokens(tiny_vlm_dir, family):
    from lmiserve.models.load import load_model_shell

    path = tiny_vlm_dir(family)
    shell = load_model_shell(path, dtype="fp32", device="cpu")
    requests = [
        (prompt_of(shell, chat("Describe the picture.")), (image_of(1),)),
        (prompt_of(shell, [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]), ()),
        (prompt_of(shell, chat("What colour is it?")), (image_of(2, (40, 56)),)),
    ]
    engine = _engine(path, max_rolling_batch_prefill_tokens="8")
    results, _ = asyncio.run(serve(shell, None, requests, engine=engine))  # type: ignore[arg-type]
    assert same(results, [reference(path, *r) for r in requests]), (family, results)


def test_a_preempted_mrope_request_recomputes_over_two_ranks(tiny_vlm_dir):
    """A pool too small for three Qwen3-VL image prompts decoding 24 tokens: one is preempted and recomputed, its
    chunk running past its prompt (the prompt's 3-D positions, then the generated tokens' shifted by the rope
    delta: transformers' forward, which the ranks do not split, is never asked for)."""
    from lmiserve.models.load import load_model_shell

    path = tiny_vlm_dir("qwen3_vl")
    shell = load_model_shell(path, dtype="fp32", device="cpu")
    requests = [(prompt_of(shell, chat(f"Picture {i}: what is in it?")), (image_of(10 + i),)) for i in range(3)]
    block = 4
    blocks = sum(-(-len(processed(shell, *r)) // block) for r in requests) + 1
    rank_bytes = blocks * kv_bytes_per_block(shell.model, block) // DEGREE
    engine = _engine(
        path,
        block_size=str(block),
        max_rolling_batch_prefill_tokens="512",
        kv_cache_memory_bytes=str(rank_bytes),
    )
    results, engine = asyncio.run(serve(shell, None, requests, at_once=True, tokens=24, engine=engine))
    assert engine.scheduler.num_preemptions > 0
    assert same(results, [reference(path, *r, tokens=24) for r in requests])


def test_a_draft_model_with_a_vlm_over_tensor_parallelism_is_refused_in_one_line(tiny_vlm_dir):
    spec = '{"method": "draft_model", "num_speculative_tokens": 3, "dtype": "int8"}'
    message = "speculative decoding with a draft model is not served with a vision-language model"
    with pytest.raises(ValueError, match=message) as refused:
        _engine(tiny_vlm_dir("qwen2_5_vl"), speculative_config=spec)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("flags", [[], ["--engine-process"]], ids=["in-process", "engine-process"])
def test_a_served_vlm_over_two_ranks_answers_the_openai_clients_image_chat(server_pool, tiny_vlm_dir, flags):
    """`lmiserve serve` of a tiny Qwen2.5-VL with ``tensor_parallel_degree=2`` (its engine in the serving process, or
    in a process of its own whose children are the ranks): a greedy chat with an image data URL through the `openai`
    client is `generate()`'s text for the same chat and image."""
    path = tiny_vlm_dir("qwen2_5_vl")
    args = ["--model-id", str(path), "--dtype", "fp32", "-o", f"tensor_parallel_degree={DEGREE}", *flags]
    url = server_pool.url(args)
    image = tiny_image(5)
    out = io.BytesIO()
    image.save(out, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    text = "Describe the image."
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(
            model=path.name,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data}}, {"type": "text", "text": text}],
                }
            ],
            max_tokens=8,
            temperature=0,
        )
    from lmiserve.models.load import load_model_shell

    tokenizer = load_model_shell(path, device="cpu").tokenizer
    expected = reference_generate(path, chat(text), [image], 8)
    assert answer.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.usage is not None and answer.usage.completion_tokens == len(expected)


def test_a_dummy_vlm_over_two_ranks_gives_one_processs_tokens(tiny_vlm_dir):
    """``load_format=dummy`` (the GPU check's models): every rank makes the whole random VLM from the same seed and
    keeps its cut, so two ranks answer an image prompt as one process does."""
    from helpers.vlm_serving import config
    from lmiserve.models.load import load_causal_lm

    path = tiny_vlm_dir("qwen2_5_vl")
    loaded = load_causal_lm(path, dtype="fp32", device="cpu", load_format="dummy")
    requests = [(prompt_of(loaded, chat("Describe the picture.")), (image_of(3),))]
    alone, _ = asyncio.run(serve(loaded, config(), requests))
    split, _ = asyncio.run(serve(loaded, None, requests, engine=_engine(path, load_format="dummy")))  # type: ignore[arg-type]
    assert [tokens for tokens, _ in split] == [tokens for tokens, _ in alone]


@pytest.mark.parametrize(
    ("family", "fmt"),
    [
        ("qwen3_vl", "fp8-block"),
        ("qwen2_5_vl", "quantize=fp8"),
        ("llava", "fp8-channel"),
        ("qwen2_5_vl", "awq"),
        ("gemma3", "gptq"),
        ("qwen2_vl", "w4a16-asym"),
        ("qwen2_5_vl", "w8a8"),
    ],
)
def test_a_quantized_vlm_over_two_ranks_gives_one_processs_tokens(tmp_path, family, fmt):
    """A VLM quantized as its published checkpoints are: Qwen3-VL's ``-FP8`` releases (the decoder's projections fp8, a
    scale a block; the vision tower float), ``quantize=fp8`` at load (the decoder's linears), compressed-tensors'
    FP8-dynamic under the published names (the decoder fp8 per channel, the vision tower float), AWQ, GPTQ and
    compressed-tensors' integers (every linear but the head, the vision tower's too: Qwen2.5-VL's has MLPs named as the
    decoder's). Each rank reads its slices of the decoder's quantized linears and the vision tower's whole, as one
    process makes them; the tokens of an image prompt are one process's from the same checkpoint."""
    from helpers.tiny_vlm import build_tiny_vlm_dir
    from helpers.vlm_checkpoints import quantized_vlm
    from helpers.vlm_serving import config
    from lmiserve.models.load import load_causal_lm

    float_dir = build_tiny_vlm_dir(family, tmp_path / "float")
    options = {"quantize": "fp8"} if fmt == "quantize=fp8" else {}
    path = float_dir if options else quantized_vlm(float_dir, tmp_path / fmt, fmt)
    loaded = load_causal_lm(path, dtype="fp32", device="cpu", **options)
    requests = [(prompt_of(loaded, chat("Describe the picture.")), (image_of(4),))]
    alone, _ = asyncio.run(serve(loaded, config(), requests))
    split, _ = asyncio.run(serve(loaded, None, requests, engine=_engine(path, **options)))  # type: ignore[arg-type]
    assert [tokens for tokens, _ in split] == [tokens for tokens, _ in alone]


def test_an_adapter_of_a_vlms_decoder_over_two_ranks_gives_the_merged_models_tokens(tiny_vlm_dir, tmp_path):
    """Each rank reads its cut of a Qwen2.5-VL adapter (its q/k/v/o and MLP linears, cut as the decoder's): an image
    prompt with the adapter, beside it without, answers as `generate()` of the model with the adapter merged."""
    from helpers.vlm_adapters import make_vlm_adapter, merged_vlm_generate
    from lmiserve.core.request import GenerationRequest, SamplingParams
    from lmiserve.models.load import load_model_shell

    path = tiny_vlm_dir("qwen2_5_vl")
    adapter = make_vlm_adapter(path, tmp_path / "tuned")
    shell = load_model_shell(path, dtype="fp32", device="cpu")
    engine = _engine(path, enable_lora="true")
    assert engine.adapters is not None
    engine.adapters.register("tuned", str(adapter))
    prompt = prompt_of(shell, chat("Describe the picture."))

    async def run() -> list[list[int]]:
        engine.start()
        try:

            async def one(name: str | None) -> list[int]:
                params = SamplingParams(max_new_tokens=6, ignore_eos_token=True)
                request = GenerationRequest(prompt, params, images=(image_of(1),), adapter=name)
                return [e.token.id async for e in engine.generate(request) if e.token is not None]

            return list(await asyncio.gather(one("tuned"), one(None)))
        finally:
            await engine.stop()

    tuned, base = asyncio.run(run())
    image = image_of(1).pixels
    merged = merged_vlm_generate(path, adapter, chat("Describe the picture."), [image], 6)
    assert tuned[: len(merged)] == merged  # (generate() stops at EOS, the engine here ignores it)
    expected = reference(path, prompt, (image_of(1),))
    assert base[: len(expected)] == expected
    assert tuned != base


def test_prompt_lookup_over_two_ranks_gives_a_vlms_greedy_tokens(tiny_vlm_dir):
    """Prompt lookup drafts for a Qwen2.5-VL image prompt, verified over two ranks (chunks past the prompt, shifted
    by the rope delta): `generate()`'s greedy tokens."""
    from lmiserve.models.load import load_model_shell

    path = tiny_vlm_dir("qwen2_5_vl")
    shell = load_model_shell(path, dtype="fp32", device="cpu")
    text = "Say it again and again: a red fox, a red fox, a red fox, a red fox."
    requests = [(prompt_of(shell, chat(text)), (image_of(8),))]
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    engine = _engine(path, speculative_config=config)
    results, engine = asyncio.run(serve(shell, None, requests, tokens=16, engine=engine))  # type: ignore[arg-type]
    assert same(results, [reference(path, *r, tokens=16) for r in requests])
    assert engine.speculation is not None and engine.speculation.describe()["num_drafts"] > 0


def test_the_prefix_cache_and_an_fp8_kv_cache_over_two_ranks(tiny_vlm_dir):
    """The same image prompt twice over two ranks: the second reuses the first's blocks (the image's digest in their
    keys) and answers the same; with ``kv_cache_dtype=fp8`` (each rank its KV heads' share of every block in fp8) the
    tokens are one process's with the same fp8 cache."""
    from helpers.vlm_serving import config
    from lmiserve.models.load import load_causal_lm

    path = tiny_vlm_dir("gemma3")
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    request = (prompt_of(loaded, chat("Describe the picture.")), (image_of(6),))
    (first, again), _ = asyncio.run(serve(loaded, None, [request, request], one_by_one=True, engine=_engine(path)))  # type: ignore[arg-type]
    assert first[0] == again[0] and first[1] == 0 and again[1] > 0, (first, again)
    assert same([first], [reference(path, *request)])
    alone, _ = asyncio.run(serve(loaded, config(kv_cache_dtype="fp8"), [request]))
    split, _ = asyncio.run(serve(loaded, None, [request], engine=_engine(path, kv_cache_dtype="fp8")))  # type: ignore[arg-type]
    assert [tokens for tokens, _ in split] == [tokens for tokens, _ in alone]
