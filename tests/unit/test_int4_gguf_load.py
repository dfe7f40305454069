"""`load_causal_lm(dtype="int4")` of a converted GGUF: built on the meta device from the file's codes
(`int4_load.load_int4_from_codes`), the fp32 weights read only for what the codes do not replace, and
the same model, tensor for tensor and logit for logit, as loading every fp32 weight and then swapping
the linears (the path of every other checkpoint, kept as the fallback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.gguf_files import VOCAB, write_converted_dir, write_gguf
from lmiserve.engine.model.quantize import Int4Linear, Q8Linear, int4_available
from lmiserve.models import int4_load, load
from lmiserve.models.load import load_causal_lm

pytestmark = pytest.mark.skipif(not int4_available(), reason="torch's int4 kernel is not available")

# what the codes replace: Q4_K, Q4_1, Q4_0 as Int4Linear; Q5_0 (and Q6_K without a bias) as Q8Linear;
# Q5_K / Q5_1 (codes with a minimum) and qwen2's biased Q6_K attn_v are read in fp32 and quantized
FROM_CODES = {"q_proj", "k_proj", "o_proj", "gate_proj"}


def both_ways(tmp_path: Path, arch: str, output: str | None, monkeypatch: pytest.MonkeyPatch):
    converted = write_converted_dir(write_gguf(tmp_path / f"{arch}.gguf", arch, output=output), tmp_path / "conv")
    read: list[str] = []
    tensor = int4_load._Safetensors.tensor
    monkeypatch.setattr(int4_load._Safetensors, "tensor", lambda self, name: read.append(name) or tensor(self, name))
    skeleton = load_causal_lm(converted, dtype="int4", device="cpu").model
    monkeypatch.setattr(load, "load_int4_from_codes", lambda *args: None)
    full = load_causal_lm(converted, dtype="int4", device="cpu").model
    return skeleton, full, read


@pytest.mark.parametrize(("arch", "output"), [("llama", None), ("qwen2", "Q6_K"), ("llama", "Q4_K")])
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
