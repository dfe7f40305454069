"""lmiserve.models.gguf_codes: a GGUF file's own codes and group parameters, never re-quantized.

Every form is checked against gguf's own `gguf.quants.dequantize` of the same blocks: `code * scale + min`
in fp32 equals it value for value, and bit for bit except where both are zero (Q4_0 and Q4_K can give
-0.0 where `code * scale + min` gives +0.0). Blocks come from gguf's numpy `quantize` where it has one
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and are random but valid (finite fp16 fields) for all eight types, the
K-quants included, which gguf 0.19 can only de-quantize.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from helpers.gguf_files import HIDDEN, LAYER_TYPES, random_blocks, transformers_weights, write_gguf
from lmiserve.models import bundled
from lmiserve.models.gguf_codes import Q4Form, Q8Form, decode_blocks, gguf_quant_forms, hf_name, read_quant_forms

Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q8_TYPES = ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K")
NUMPY_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
GROUP = {"Q6_K": 16}  # every other type: groups of 32


def quantized(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return gguf.quants.quantize(weights, GGMLQuantizationType[qtype])


def assert_same(got: torch.Tensor, want: np.ndarray | torch.Tensor) -> None:
    """Equal values, and equal bits wherever the value is not zero."""
    want = torch.as_tensor(want)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)
    differ = got.view(torch.int32) != want.view(torch.int32)
    assert bool((want[differ] == 0).all())


def check_form(form: Q4Form | Q8Form | None, qtype: str, rows: int, cols: int) -> None:
    group = GROUP.get(qtype, 32)
    assert form is not None and form.qtype == qtype
    assert form.codes.shape == (rows, cols) and form.scale.shape == (rows, cols // group)
    assert form.scale.dtype == torch.float32 and form.group_size == group
    if qtype in Q4_TYPES:
        assert isinstance(form, Q4Form) and form.codes.dtype == torch.uint8
        assert int(form.codes.max()) <= 15 and form.min.shape == form.scale.shape
    else:
        assert isinstance(form, Q8Form) and form.codes.dtype == torch.int8
        assert (form.min is not None) == (qtype in ("Q5_1", "Q5_K"))


@pytest.mark.parametrize("qtype", Q4_TYPES + Q8_TYPES)
def test_random_blocks_expand_to_ggufs_own_dequantization(qtype: str) -> None:
    data = random_blocks(qtype, 6, 512)
    form = decode_blocks(data, qtype)
    check_form(form, qtype, 6, 512)
    assert form is not None
    assert_same(form.dequantize(), gguf.quants.dequantize(data, GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype", NUMPY_QUANTIZABLE)
def test_ggufs_own_quantization_expands_to_its_dequantization(qtype: str) -> None:
    data = quantized(qtype, 8, 96)
    form = decode_blocks(data, qtype)
    check_form(form, qtype, 8, 96)
    assert form is not None
    assert_same(form.dequantize(), gguf.quants.dequantize(data, GGMLQuantizationType[qtype]))


def test_codes_are_the_files_integers() -> None:
    """Q4_1: each nibble is the code of its value (low nibbles values 0..15, high ones 16..31); Q8_0: the int8s."""
    data = quantized("Q4_1", 1, 32)
    form = decode_blocks(data, "Q4_1")
    assert form is not None
    qs = data[0, 4:]
    assert form.codes[0].tolist() == [int(b) & 15 for b in qs] + [int(b) >> 4 for b in qs]
    assert float(form.scale[0, 0]) == float(data[0, :2].view(np.float16)[0])
    assert float(form.min[0, 0]) == float(data[0, 2:4].view(np.float16)[0])
    data = quantized("Q8_0", 1, 32)
    q8 = decode_blocks(data, "Q8_0")
    assert q8 is not None and q8.codes[0].tolist() == data[0, 2:].view(np.int8).tolist()


def test_float_and_other_types_have_no_form() -> None:
    assert decode_blocks(np.zeros((2, 32), np.float32), "F32") is None
    assert decode_blocks(random_blocks("Q4_0", 2, 32), "Q3_K") is None
    assert decode_blocks(random_blocks("Q4_0", 2, 32).reshape(1, 2, -1), "Q4_0") is None  # 3-D (experts)


def test_names() -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    others = ("blk.0.attn_norm.weight", "blk.0.attn_q.bias", "output_norm.weight", "rope_freqs.weight")
    qwen3_gemma3_norms = ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "blk.0.post_ffw_norm.weight")
    for other in others + qwen3_gemma3_norms:
        assert hf_name(other) is None


# ---- whole files, against what transformers' GGUF loader makes of them ---------------------------------


@pytest.mark.parametrize(("arch", "output"), [("llama", None), ("qwen2", "Q6_K"), ("qwen3", None), ("gemma3", None)])
def test_file_forms_equal_what_transformers_loads(tmp_path: Path, arch: str, output: str | None) -> None:
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, output=output)
    forms = read_quant_forms(path)
    want = transformers_weights(path)
    assert forms is not None
    expected = {hf_name(f"blk.0.{n}.weight") for n in LAYER_TYPES} | {"model.embed_tokens.weight", "lm_head.weight"}
    assert set(forms) == expected
    for name, form in forms.items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" and output is None else name
        assert_same(form.dequantize(), want[source])
    if output is None:
        assert forms.gguf_name("lm_head.weight") == "token_embd.weight"
    else:
        assert forms["lm_head.weight"].qtype == output
    q_rows = forms["model.layers.0.self_attn.q_proj.weight"].codes
    raw = decode_blocks(random_blocks("Q4_K", HIDDEN, HIDDEN, seed=2), "Q4_K")
    assert raw is not None and torch.equal(q_rows, raw.codes) == (arch != "llama")  # only llama's are un-permuted


def test_other_architectures_are_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_gguf(tmp_path / "phi3.gguf", "phi3")
    with caplog.at_level(logging.INFO, logger="lmiserve.models.gguf_codes"):
        assert read_quant_forms(path) is None
    assert "architecture 'phi3' is not one of" in caplog.text


# ---- the conversion records its source; gguf_quant_forms finds it ----------------------------------------


def fake_convert(gguf_path: Path, out_dir: Path) -> None:  # replaces bundled._convert_into
    (out_dir / "config.json").write_text("{}")
    (out_dir / "model.safetensors").write_bytes(b"weights")


def test_conversion_records_its_source_and_forms_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled, "_convert_into", fake_convert)
    path = write_gguf(tmp_path / "m.gguf", "llama")
    converted = bundled.convert_gguf(path, tmp_path / "cache")
    record = json.loads((converted / bundled.GGUF_SOURCE_FILE).read_text())
    assert record == {"gguf_path": str(path), "gguf_cache_key": converted.name}
    forms = gguf_quant_forms(converted)
    assert forms is not None and set(forms) == set(read_quant_forms(path) or {})
    # the same file moved elsewhere: no forms until a conversion call names the new path
    other = tmp_path / "moved" / "m.gguf"
    other.parent.mkdir()
    path.rename(other)
    assert gguf_quant_forms(converted) is None
    assert bundled.convert_gguf(other, tmp_path / "cache") == converted
    assert json.loads((converted / bundled.GGUF_SOURCE_FILE).read_text())["gguf_path"] == str(other)
    assert gguf_quant_forms(converted) is not None


def test_no_forms_for_other_directories_or_changed_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert gguf_quant_forms(tmp_path) is None  # not a conversion: silently None
    path = write_gguf(tmp_path / "m.gguf", "llama")
    record = {"gguf_path": str(path), "gguf_cache_key": "m-1-000000000000"}  # another version's key
    (tmp_path / bundled.GGUF_SOURCE_FILE).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="lmiserve.models.gguf_codes"):
        assert gguf_quant_forms(tmp_path) is None
    assert "changed since its conversion" in caplog.text
    (tmp_path / bundled.GGUF_SOURCE_FILE).write_text("{not json")
    assert gguf_quant_forms(tmp_path) is None


# ---- the bundled SmolLM2 (Q4_1, token_embd Q8_0) ---------------------------------------------------------


@pytest.mark.e2e  # the real bundled GGUF and its conversion (~20 s the first time on a machine)
def test_bundled_codes_equal_the_converted_weights(smollm_dir: Path) -> None:
    from safetensors.torch import load_file

    start = time.monotonic()
    forms = gguf_quant_forms(smollm_dir)  # smollm_dir's conversion recorded the bundled GGUF
    took = time.monotonic() - start
    assert forms is not None
    converted = load_file(next(smollm_dir.glob("*.safetensors")))
    linears = [n for n in converted if n.endswith("_proj.weight")]
    assert len(linears) == 30 * 7 and set(linears) <= set(forms)
    assert {forms[n].qtype for n in linears} == {"Q4_1"} and isinstance(forms[linears[0]], Q4Form)
    assert forms["model.embed_tokens.weight"].qtype == "Q8_0"
    assert forms.gguf_name("lm_head.weight") == "token_embd.weight"  # tied
    for name in [*linears, "model.embed_tokens.weight"]:
        assert_same(forms[name].dequantize(), converted[name])
    assert took < 60, took
