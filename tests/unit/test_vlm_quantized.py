"""Vision-language models' quantized checkpoints, loaded as the VLM each is (its processor, its vision tower) and
their image prompts served with the greedy tokens transformers' `generate()` gives over the same weights:
- block-wise fp8 (Qwen3-VL's and Qwen2.5-VL's ``-FP8`` releases: every projection fp8 with a scale a block of 128,
  as transformers publishes it), de-quantized at load by transformers;
- fp8 per channel (compressed-tensors' FP8-dynamic, as RedHatAI publishes Qwen2.5-VL and others: the language
  model's linears fp8, the vision tower float, the tensors under their published names, which transformers renames)
  and AWQ (every linear 4-bit codes), read by lmiserve's loader by the names transformers gives the tensors.
``quantize=fp8`` at load makes the decoder's linears fp8 and keeps the vision tower float, as those checkpoints do;
``load_format=dummy`` with ``quantize=awq`` makes the decoder's codes."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.float_weights import float_state
from helpers.tiny_vlm import build_tiny_vlm_dir
from helpers.vlm_checkpoints import LANGUAGE_LINEAR, fp8_channel_copy, processor_files
from helpers.vlm_serving import chat, config, image_of, prompt_of, reference, same, serve
from lmiserve.models.load import load_causal_lm
from lmiserve.models.quant_pack import write_quantized

BLOCK = 16


def _dequantized_copy(fp8: Path, out: Path) -> Path:
    """`fp8`'s checkpoint with every fp8 weight written as its values times its blocks' scales (fp32), and no
    quantization_config: the float model the checkpoint encodes, read independently of lmiserve and transformers."""
    shutil.copytree(fp8, out)
    state = load_file(out / "model.safetensors")
    for name in [n for n in state if n.endswith(".weight_scale_inv")]:
        scale, base = state.pop(name), name.removesuffix("_scale_inv")
        q = state[base].float()
        state[base] = (q.reshape(q.shape[0] // BLOCK, BLOCK, -1, BLOCK) * scale[:, None, :, None]).reshape(q.shape)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _loads_as_its_float_model(quantized: Path, dequantized: Path, **options: str) -> Any:
    """`quantized` loaded (with `options`) as the VLM it is, every tensor equal to the float model `dequantized`
    holds; the loaded."""
    loaded = load_causal_lm(quantized, dtype="fp32", device="cpu", **options)
    assert loaded.processor is not None
    expected = load_causal_lm(dequantized, dtype="fp32", device="cpu").model.state_dict()
    got = float_state(loaded.model)  # (a CPU keeps the decoder's fp8 weights fp8: `cpu_codes.fp8_layer`)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    return loaded


def _prompts(loaded: Any, count: int = 2) -> list[tuple[str, tuple[Any, ...]]]:
    """Image prompts in the model's chat template: one image each, of two sizes."""
    first = (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),))
    other = (prompt_of(loaded, chat("What colour is it?")), (image_of(2, (40, 56)),))
    return [first, other][:count]


@pytest.fixture(scope="module")
def fp8_vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("vlm-fp8")
    float_dir = build_tiny_vlm_dir("qwen3_vl", root / "float")
    model = AutoModelForImageTextToText.from_pretrained(float_dir, dtype=torch.float32)
    written = write_quantized(model, root / "fp8", "fp8-block", group=BLOCK)
    processor_files(float_dir, root / "fp8")
    return root / "fp8", _dequantized_copy(root / "fp8", root / "dequantized"), len(written)


def test_a_block_wise_fp8_vlm_loads_as_the_vlm_with_every_weight_dequantized(fp8_vlm):
    fp8, dequantized, written = fp8_vlm
    assert written > 0
    _loads_as_its_float_model(fp8, dequantized)


def test_a_block_wise_fp8_vlms_image_prompts_get_generates_tokens(fp8_vlm):
    fp8, dequantized, _ = fp8_vlm
    loaded = load_causal_lm(fp8, dtype="fp32", device="cpu")
    prompts = _prompts(loaded)
    results, _ = asyncio.run(serve(loaded, config(), prompts))
    assert same(results, [reference(dequantized, *r) for r in prompts])


# --- fp8 per channel under the published names, and AWQ ---------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2_vl", "llava", "qwen3_vl", "gemma3"])
def channel_vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"vlm-fp8-channel-{request.param}")
    float_dir = build_tiny_vlm_dir(request.param, root / "float")
    assert fp8_channel_copy(float_dir, root / "fp8", dequantize=False) == 14  # 7 linears of 2 layers
    fp8_channel_copy(float_dir, root / "dequantized", dequantize=True)
    return root / "fp8", root / "dequantized"


def test_an_fp8_vlm_under_its_published_names_loads_with_every_weight_its_values_times_their_scales(channel_vlm):
    fp8, dequantized = channel_vlm
    stored = load_file(fp8 / "model.safetensors")
    renamed = any(n.startswith("model.language_model.") for n in stored) == ("qwen3_vl" in str(fp8))
    assert renamed  # (Qwen3-VL publishes the model's own names; the others names transformers renames at load)
    _loads_as_its_float_model(fp8, dequantized)


def test_an_fp8_vlms_image_prompts_get_generates_tokens(channel_vlm):
    fp8, dequantized = channel_vlm
    loaded = load_causal_lm(fp8, dtype="fp32", device="cpu")
    prompts = _prompts(loaded)
    results, engine = asyncio.run(serve(loaded, config(), prompts))
    assert engine.runner.path == "fast"
    assert same(results, [reference(dequantized, *r) for r in prompts])


def _greedy_gaps(loaded: Any, prompt: str, images: tuple[Any, ...], got: list[int]) -> list[float]:
    """For each token the engine chose, how far below the best logit transformers' forward over `loaded`'s own
    layers puts it (teacher-forced on the engine's tokens, as a share of the step's logit range): 0 where the engine
    took transformers' greedy token, a rounding's worth where bf16 and fp8 activations break a near tie otherwise."""
    inputs = loaded.processor(text=[prompt], images=[[im.pixels for im in images]], return_tensors="pt")
    length, tail = inputs["input_ids"].shape[1], torch.tensor([got])
    for key, value in list(inputs.items()):  # the prompt's per-token tensors run on over the tokens got
        if torch.is_tensor(value) and tuple(value.shape) == (1, length):
            more = tail if key == "input_ids" else torch.full_like(tail, int(key == "attention_mask"))
            inputs[key] = torch.cat([value, more.to(value.dtype)], 1)
    with torch.inference_mode():
        logits = loaded.model(**inputs).logits[0, length - 1 : -1].float()
    chosen = logits.gather(1, tail.t())[:, 0]
    best = logits.max(-1).values
    return ((best - chosen) / (best - logits.min(-1).values)).tolist()


def test_quantize_fp8_at_load_makes_a_vlms_decoder_fp8_and_keeps_its_vision_tower(channel_vlm):
    """``quantize=fp8`` on the float VLM (vLLM's online fp8): the decoder's linears quantized per output channel (a
    CPU: kept fp8 on the q8 kernel), the vision tower and projector as loaded, so the model is the one the published
    FP8-dynamic checkpoint encodes; its image prompts get `generate()`'s tokens over that model."""
    fp8, dequantized = channel_vlm
    loaded = _loads_as_its_float_model(fp8.parent / "float", dequantized, quantize="fp8")
    prompts = _prompts(loaded)
    results, engine = asyncio.run(serve(loaded, config(), prompts))
    assert engine.runner.path == "fast"
    assert same(results, [reference(dequantized, *r) for r in prompts])


@pytest.mark.parametrize("source", ["checkpoint", "quantize=fp8"])
def test_an_fp8_vlm_on_fp8_products_gives_transformers_tokens_over_the_same_layers(channel_vlm, monkeypatch, source):
    """Where the GPU multiplies fp8 (Hopper: here torch's CPU `_scaled_mm`, the activations in fp8 per row), the
    language model's linears, from the checkpoint or quantized at load, are `Fp8Linear`s, fused by the fast forward,
    and each token the engine chooses is transformers' greedy one over the same layers, or within a rounding's worth
    of it (`_greedy_gaps`, at most 4 % of the step's range: bf16 and fp8 activations rounded apart break near ties
    the other way. Qwen3-VL's fifth token from the checkpoint is 0.14 below the best of a 9.0 range; Qwen2-VL's
    sixth quantized at load, from bf16 weights, is the third of three logits within 0.25, 8 bf16 steps, of a 9.8
    range: 2.6 % on an AMD EPYC with AVX-512, 3.5 % on one without, whose torch CPU kernels round apart). The attention runs torch's bf16 ops, which round as transformers' do: the compiled CPU kernel's fp32
    sums over the bf16 cache move these random models' logits further, and the tokens would not show the products
    alone (as in test_quantized_checkpoints.py's fp8-linears test)."""
    from lmiserve.engine.attention import cpu_kernel
    from lmiserve.engine.model import quant_formats

    fp8, _ = channel_vlm
    monkeypatch.setattr(quant_formats, "fp8_scaled_mm_supported", lambda device: True)
    monkeypatch.setattr(cpu_kernel, "CACHE_DTYPES", (torch.float32,))
    if source == "checkpoint":
        loaded = load_causal_lm(fp8, dtype="bf16", device="cpu")
    else:
        loaded = load_causal_lm(fp8.parent / "float", dtype="bf16", device="cpu", quantize="fp8")
    kinds: dict[bool, set[str]] = {True: set(), False: set()}  # vision tower's?: the layers' classes
    for name, module in loaded.model.named_modules():
        if LANGUAGE_LINEAR.search(f"{name}.weight"):
            kinds["vision" in name or "visual" in name].add(type(module).__name__)
    assert kinds[False] == {"Fp8Linear"} and kinds[True] <= {"Linear"}
    prompts = _prompts(loaded)
    results, engine = asyncio.run(serve(loaded, config(), prompts))
    assert engine.runner.path == "fast"
    for (prompt, images), (got, _) in zip(prompts, results, strict=True):
        gaps = _greedy_gaps(loaded, prompt, images, got)
        assert max(gaps) <= 0.04, gaps


def test_an_awq_vlm_gives_generates_tokens_over_its_de_quantized_weights(tmp_path):
    """Every linear of a VLM (its vision tower's too) in AWQ's 4-bit codes by groups of 32: on the CPU's int4
    kernel, through the fast forward and transformers' vision tower, the tokens of the float model of those weights."""
    from transformers import AutoModelForImageTextToText

    from lmiserve.engine.model.quantize import Int4Linear, int4_available

    float_dir = build_tiny_vlm_dir("qwen2_vl", tmp_path / "float")
    model = AutoModelForImageTextToText.from_pretrained(float_dir, dtype=torch.float32)
    written = write_quantized(model, tmp_path / "awq", "awq", group=32)
    processor_files(float_dir, tmp_path / "awq")
    loaded = load_causal_lm(tmp_path / "awq", dtype="fp32", device="cpu")
    layers = {n: m for n, m in loaded.model.named_modules() if n in written}
    assert len(layers) == len(written) > 14  # (the vision tower's linears too)
    if int4_available():
        assert all(isinstance(m, Int4Linear) for m in layers.values())
    with torch.no_grad():  # the reference: the float model of the codes' weights
        for name, module in layers.items():
            weight = module.dequantized() if isinstance(module, Int4Linear) else module.weight
            model.get_submodule(name).weight.copy_(weight)
    model.save_pretrained(tmp_path / "dequantized")
    processor_files(float_dir, tmp_path / "dequantized")
    first = _prompts(loaded, 1)[0]
    results, engine = asyncio.run(serve(loaded, config(), [first]))
    assert engine.runner.path == "fast"
    assert same(results, [reference(tmp_path / "dequantized", *first)])


def test_a_dummy_vlm_with_awq_codes_serves_its_decoder_on_the_int4_kernel(tmp_path):
    """``load_format=dummy`` with ``quantize=awq`` (a benchmark's 4-bit VLM of a shape): the decoder's linears are 4-bit
    codes of the random weights (on the CPU's int4 kernel), the vision tower float; an image prompt's greedy tokens
    are transformers' over the same layers."""
    from lmiserve.engine.model.quantize import Int4Linear, int4_available

    float_dir = build_tiny_vlm_dir("qwen2_vl", tmp_path / "float")
    loaded = load_causal_lm(float_dir, dtype="fp32", device="cpu", load_format="dummy", quantize="awq")
    kinds: dict[bool, set[str]] = {True: set(), False: set()}  # vision tower's?: the linears' classes
    for name, module in loaded.model.named_modules():
        if isinstance(module, (torch.nn.Linear, Int4Linear)) and name != "lm_head":
            kinds["visual" in name].add(type(module).__name__)
    assert kinds[False] == {"Int4Linear" if int4_available() else "Linear"} and kinds[True] == {"Linear"}
    prompt, images = _prompts(loaded, 1)[0]
    results, engine = asyncio.run(serve(loaded, config(), [(prompt, images)]))
    assert engine.runner.path == "fast"
    gaps = _greedy_gaps(loaded, prompt, images, results[0][0])
    assert max(gaps) <= 1e-4, gaps


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_block_wise_fp8_vlm_kept_fp8_runs_its_decoder_on_the_triton_kernel(fp8_vlm, monkeypatch, graphs):
    """Where the VLM in bf16 would not fit (Qwen3-VL-32B-FP8 on a 48 GB L40S: `fp8_gemv.weights_kept_for`), its
    block-wise fp8 weights stay fp8, read by lmiserve's loader as a causal LM's are: every product of the decoder runs
    `fp8_gemv`'s weight-only kernel with each block's scale (here under Triton's interpreter on CPU tensors, fp32
    activations, eager and in the decode graphs), and the image prompts get `generate()`'s tokens over the float model
    the checkpoint encodes."""
    import os

    from helpers.decode_graphs import graphs_on_the_test_device
    from lmiserve.engine.model import fp8_gemv
    from lmiserve.engine.model.quant_formats import Fp8Linear

    if not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)")
    record = graphs_on_the_test_device(monkeypatch) if graphs else None
    fp8, dequantized, _ = fp8_vlm
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_chosen", {})
    one, more = fp8_gemv.Config(False, 1, 256, 128), fp8_gemv.Config(True, 16, 256, 128)  # few programs
    monkeypatch.setattr(fp8_gemv, "weights_kept_for", lambda model, device, name, blocks=False: True)
    monkeypatch.setattr(fp8_gemv, "choose", lambda x, *_: one if x.shape[0] == 1 else more)
    loaded = load_causal_lm(fp8, dtype="fp32", device="cpu")
    kinds: dict[bool, set[str]] = {True: set(), False: set()}  # vision tower's?: the linears' classes
    for name, module in loaded.model.named_modules():
        if LANGUAGE_LINEAR.search(f"{name}.weight"):
            kinds["visual" in name].add(type(module).__name__)
    assert kinds[False] == {"Fp8Linear"}, kinds
    ran: list[int] = []
    kernel = fp8_gemv.fp8_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", lambda x, *rest: ran.append(x.shape[0]) or kernel(x, *rest))
    prompts = _prompts(loaded)
    results, engine = asyncio.run(serve(loaded, config(), prompts))
    # decode rows (one a request: both requests' at once, or one's alone, as the steps fell) and prompts' rows
    assert engine.runner.path == "fast" and min(ran) <= len(prompts) < max(ran), ran
    if record is not None:
        assert record.steps  # decode steps replayed the graphs
    assert same(results, [reference(dequantized, *r) for r in prompts])
    assert isinstance(loaded.model.model.language_model.layers[0].mlp.down_proj, Fp8Linear)


def test_a_block_wise_fp8_vlm_with_float_experts_is_what_transformers_dequantizes(tmp_path):
    """A Qwen3-VL mixture of experts, its attention's projections fp8 by blocks and its experts as transformers saves
    them (fused, float), read by lmiserve's loader: every tensor equals transformers' own de-quantization of the
    checkpoint (``FineGrainedFP8Config(dequantize=True)``), the experts' too."""
    from transformers import AutoModelForImageTextToText, FineGrainedFP8Config  # type: ignore[attr-defined]

    from helpers.vlm_checkpoints import quantized_vlm

    fp8 = quantized_vlm(build_tiny_vlm_dir("qwen3_vl_moe", tmp_path / "float"), tmp_path / "fp8", "fp8-block")
    got = float_state(load_causal_lm(fp8, dtype="fp32", device="cpu").model)
    expected = AutoModelForImageTextToText.from_pretrained(
        fp8, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
    ).state_dict()
    assert got.keys() == expected.keys()
    assert any(".experts." in name for name in got)
    for name, value in expected.items():
        assert torch.equal(got[name], value.float()), name
