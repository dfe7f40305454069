"""`load_causal_lm(dtype="int4")` of a converted GGUF: built on the meta device from the file's codes
(`int4_load.load_int4_from_codes`), the fp32 weights read only for what the codes do not replace, and
the same model, tensor for tensor and logit for logit, as loading every fp32 weight and then swapping
the linears (the path of every other checkpoint, kept as the fallback). Such a model mixes int4 and q8
linears (a Q4_K_M file's attn_v is Q6_K) and runs on the fast path, with transformers' results."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from helpers.gguf_files import VOCAB, write_converted_dir, write_gguf
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.engine.model.quantize import Int4Linear, Q8Linear, int4_available
from lmiserve.engine.runner import fast_reason
from lmiserve.models import int4_load, load
from lmiserve.models.load import load_causal_lm

pytestmark = pytest.mark.skipif(not int4_available(), reason="torch's int4 kernel is not available")

# what the codes replace: Q4_K, Q4_1, Q4_0 as Int4Linear; Q5_0 (and Q6_K without a bias) as Q8Linear;
# Q5_K / Q5_1 (codes with a minimum) and qwen2's biased Q6_K attn_v are read in fp32 and quantized
FROM_CODES = {"q_proj", "k_proj", "o_proj", "gate_proj"}


def both_ways(tmp_path: Path, arch: str, output: str | None, monkeypatch: pytest.MonkeyPatch):
    converted = write_converted_dir(write_gguf(tmp_path / f"{arch}.gguf", arch, output=output), tmp_path / "conv")
    read: list[str] = []
    tensor = int4_load.SafetensorsFiles.tensor
    monkeypatch.setattr(
        int4_load.SafetensorsFiles, "tensor", lambda self, name: read.append(name) or tensor(self, name)
    )
    skeleton = load_causal_lm(converted, dtype="int4", device="cpu").model
    monkeypatch.setattr(load, "load_int4_from_codes", lambda *args: None)
    full = load_causal_lm(converted, dtype="int4", device="cpu").model
    return skeleton, full, read


@pytest.mark.parametrize(
    ("arch", "output"), [("llama", None), ("qwen2", "Q6_K"), ("llama", "Q4_K"), ("qwen3", None), ("gemma3", "Q4_K")]
)
def test_codes_without_fp32_linears_equal_the_full_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, output: str | None
) -> None:
    skeleton, full, read = both_ways(tmp_path, arch, output, monkeypatch)
    tensors = [*skeleton.named_parameters(), *skeleton.named_buffers()]
    assert tensors and not [name for name, t in tensors if t.is_meta or t.device.type != "cpu"]
    assert [type(m).__name__ for m in skeleton.modules()] == [type(m).__name__ for m in full.modules()]
    want = full.state_dict()
    got = skeleton.state_dict()
    assert list(got) == list(want)
    for name, value in got.items():
        assert value.dtype == want[name].dtype and torch.equal(value, want[name]), name
    for name, value in dict(full.named_buffers()).items():  # non-persistent ones too (RoPE's inv_freq)
        assert torch.equal(dict(skeleton.named_buffers())[name], value), name
    assert isinstance(skeleton.lm_head, Int4Linear if output == "Q4_K" else Q8Linear)
    assert skeleton.model.embed_tokens.weight.dtype == torch.float32
    assert skeleton.config.tie_word_embeddings is False  # untied for the file's output projection
    # the fp32 weights of the linears the codes replace were never read
    replaced = {n for n in read if n.rpartition(".")[0].rpartition(".")[2] in FROM_CODES and n.endswith(".weight")}
    assert not replaced and "lm_head.weight" not in read
    assert "model.embed_tokens.weight" in read and "model.layers.0.mlp.up_proj.weight" in read
    ids = torch.tensor([[1, 5, 9, 17, 33, VOCAB - 1]])
    with torch.inference_mode():
        assert torch.equal(skeleton(ids).logits, full(ids).logits)
        tokens = skeleton.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, full.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))


def test_without_every_tensor_it_loads_the_fp32_weights(tmp_path: Path) -> None:
    """A converted directory whose safetensors lack a tensor the model needs: the fallback, not an error."""
    from safetensors.torch import load_file, save_file

    converted = write_converted_dir(write_gguf(tmp_path / "m.gguf", "llama"), tmp_path / "conv")
    weights = load_file(converted / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, converted / "model.safetensors", metadata={"format": "pt"})
    assert int4_load.load_int4_from_codes(converted) is None
    assert int4_load.load_int4_from_codes(tmp_path) is None  # not a converted GGUF


def mixed_model(tmp_path: Path, q8_mlp: bool, arch: str = "llama"):
    """The `arch` file at int4: q/k int4 and v q8 (Q6_K, groups of 16), o q8 (Q5_0), the MLP int4; with
    `q8_mlp` up q8 (groups of 16) and down q8 (groups of 32) too, of the same weights."""
    loaded = load_causal_lm(write_converted_dir(write_gguf(tmp_path / "m.gguf", arch), tmp_path / "c"), dtype="int4")
    attn, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
    assert [type(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)] == [Int4Linear] * 2 + [Q8Linear] * 2
    if q8_mlp:
        mlp.up_proj = Q8Linear.from_linear(mlp.up_proj.dequantized(), 16)
        mlp.down_proj = Q8Linear.from_linear(mlp.down_proj.dequantized(), 32)
    return loaded


@pytest.mark.parametrize(
    ("arch", "q8_mlp"),
    [("llama", False), ("llama", True), ("qwen3", False), ("gemma3", False)],
    ids=["q4_k_m", "q8-mlp", "qwen3-q4_k_m", "gemma3-q4_k_m"],
)
@torch.inference_mode()
def test_a_model_mixing_int4_and_q8_linears_gives_transformers_logits_on_the_fast_path(
    tmp_path: Path, arch: str, q8_mlp: bool
) -> None:
    model = mixed_model(tmp_path, q8_mlp, arch).model
    assert fast_reason(model, fast_path=True) is None
    seq = [1, 5, 9, 17, 33, VOCAB - 1, 40, 7, 3]
    reference = model(torch.tensor([seq])).logits[0]  # transformers' forward (the generic path's)
    fast = FastLlama(model, paged_cache(model, 4, 4), 128)
    layer = fast.layers[0]
    assert fast.packed is None  # the fused 1-row int4 step is for models whose layers are all q4
    assert [p.weight.dtype for p in layer.qkv] == [torch.uint8, torch.int8]  # q/k fused, v apart
    assert len(layer.gate_up) == (2 if q8_mlp else 1) and (layer.down_w.dtype == torch.int8) == q8_mlp
    assert torch.equal(model(torch.tensor([seq])).logits[0], reference)  # the modules read the fused rows
    table = [2, 0, 3]
    out = fast.forward(StepInputs(chunks=[(table, 0, seq[:5])], keep=[*range(5)]))
    torch.testing.assert_close(out, reference[:5], rtol=1e-4, atol=1e-4)
    for position in range(5, len(seq)):  # decode steps of one row
        out = fast.forward(StepInputs([seq[position]], [position], [table], keep=[0]))
        torch.testing.assert_close(out[0], reference[position], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q8_mlp", [False, True], ids=["q4_k_m", "q8-mlp"])
def test_a_model_mixing_int4_and_q8_linears_serves_generates_greedy_tokens(tmp_path: Path, q8_mlp: bool) -> None:
    loaded = mixed_model(tmp_path, q8_mlp)
    loaded.model.generation_config.eos_token_id = None  # the engine ignores EOS: so does generate
    prompts = [[1, 5, 9, 17, 33], [4, 60, 2, 11], [8, 8, 30, 45, 12, 19, 50]]
    tokens = 12

    async def serve() -> tuple[str, list[list[int]]]:
        engine = create_engine(loaded, EngineConfig())
        engine.start()

        async def one(i: int, ids: list[int]) -> list[int]:
            await asyncio.sleep(0.01 * i)  # later requests join a running batch
            params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)
            request = GenerationRequest("", params, prompt_ids=ids)
            return [e.token.id async for e in engine.generate(request) if e.token]

        try:
            return engine.runner.path, await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.stop()

    path, results = asyncio.run(serve())
    assert path == "fast"
    for ids, got in zip(prompts, results, strict=True):
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        assert got == out[0, len(ids) :].tolist(), ids


def test_tensor_parallelism_refuses_a_quantized_model(tmp_path: Path) -> None:
    """int4/q8 weights are stored in blocks of rows with group scales: a shard does not cut them."""
    from lmiserve.engine.model.sharding import shard_model

    with pytest.raises(ValueError, match="shards float models"):
        shard_model(mixed_model(tmp_path, False).model, 0, 2, None)
