"""fp8 weights kept fp8 on a CPU (`cpu_codes.fp8_layer`): an fp8 checkpoint's linears (per tensor, per channel,
block-wise) and ``quantize=fp8``'s are `Q8Linear` with fp8 e4m3fn values for codes, the q8 kernel widening each byte
exactly (`group_tiles._e4m3_as_f32`), where they were de-quantized to fp32 (4 times their bytes). Each weight is the
checkpoint's exactly; the engine's greedy tokens over such checkpoints equal transformers' over the de-quantized weights
(test_quantized_checkpoints.py's fp8 cases); here, the packed decode kernels (`q4_decode`) give transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.packed_steps import packed_and_op_by_op_give_transformers_logits
from helpers.quantizable import quantizable_llama, write_checkpoint
from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.model import cpu_codes
from lmiserve.engine.model.cpu_gemm import CpuGemm
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.engine.model.group_kernels import pack_q8, q8_linear, unpack_q8
from lmiserve.engine.model.llama_layout import fused_layers
from lmiserve.engine.model.quant_formats import Fp8Linear, fp8_module, quantize_fp8
from lmiserve.engine.model.quantize import Q8Linear, int4_available, quantized_linear
from lmiserve.models.load import load_causal_lm

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.skipif(not int4_available(), reason="the CPU kernels (numba) are not available")


def every_finite_byte() -> torch.Tensor:
    """The 254 finite e4m3fn values (both zeros, the subnormals, +-448), as fp8."""
    raw = torch.arange(256, dtype=torch.int32)
    return raw[(raw & 0x7F) != 0x7F].to(torch.uint8).view(FP8)


@pytest.mark.parametrize("group", [32, 16])
def test_the_kernel_reads_every_fp8_value_exactly(group: int) -> None:
    """One-hot rows read each stored value back: every finite byte widened to its exact value times its group's scale
    (powers of two: the products are exact), for every row count of a tile."""
    values = every_finite_byte()
    codes = values[torch.arange(32 * 256) % values.numel()].view(32, 256)  # each value in many places
    scale = 2.0 ** torch.randint(-12, 4, (32, 256 // group)).float()
    packed, scales = pack_q8(codes, scale)
    assert packed.dtype == FP8 and packed.shape == (2, 256 * 16)
    back, back_scale = unpack_q8(packed, scales, 32)
    assert torch.equal(back.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(back_scale, scale)
    want = codes.float() * scale.repeat_interleave(group, dim=1)
    for rows in (1, 2, 3, 4, 5, 9):
        picked = torch.randperm(256)[:rows]
        got = q8_linear(torch.eye(256)[picked], packed, scales, 32)
        assert torch.equal(got, want[:, picked].t()), rows


@pytest.mark.parametrize("rows", [1, 4, 7, 33])
def test_the_product_is_the_dequantized_weights(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 512, generator=generator) * 0.05
    q, scale = quantize_fp8(weight)
    layer = cpu_codes.fp8_layer(q, scale, None)
    assert isinstance(layer, Q8Linear) and layer.weight.dtype == FP8
    x = torch.randn(rows, 512, generator=generator)
    want = x.double() @ (q.double() * scale.double()[:, None]).t()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.dequantized(), q.float() * scale[:, None])


def test_each_scale_layout_is_kept_exactly_and_others_refused() -> None:
    """A tensor's scale, a channel's (``[out]``, ``[out, 1]``) and each row's blocks' are repeated over the groups of
    32 (16 where 32 does not divide); inputs that are not whole groups of 16, and outputs that are not whole blocks of
    16 rows, are left to the caller (de-quantized)."""
    q = torch.randn(32, 96).mul(100).clamp(-448, 448).to(FP8)
    for scale, want in [
        (torch.tensor(0.02), q.float() * 0.02),
        (torch.full((32, 1), 0.5), q.float() * 0.5),
        (torch.arange(1, 33).float(), q.float() * torch.arange(1, 33).float()[:, None]),
        (
            torch.tensor([[1.0, 2.0, 4.0]]).expand(32, 3),
            q.float() * torch.tensor([1.0, 2.0, 4.0]).repeat_interleave(32),
        ),
        (torch.tensor([[1.0, 2.0]]).expand(32, 2), q.float() * torch.tensor([1.0, 2.0]).repeat_interleave(48)),
    ]:
        layer = cpu_codes.fp8_layer(q, scale, None)
        assert layer is not None and torch.equal(layer.dequantized(), want), scale.shape
    assert "fp8 weights (groups of 16)" in cpu_codes.fp8_layer(q, torch.ones(32, 2), None).extra_repr()
    assert cpu_codes.fp8_layer(q[:24], torch.ones(24), None) is None  # 24 outputs
    assert cpu_codes.fp8_layer(q[:, :40], torch.ones(32), None) is None  # 40 inputs
    assert cpu_codes.fp8_layer(q, torch.ones(32, 12), None) is None  # blocks of 8 inputs


def test_fp8_module_keeps_fp8_on_a_cpu_in_fp32_and_bf16() -> None:
    """fp32: the product and bias in fp32; bf16 (since 2026-12-07, de-quantized before): the same codes, the product
    and bias in fp32 rounded to the rows' bf16 once, in the module and in the fast forward's product."""
    q, scale = quantize_fp8(torch.randn(64, 128))
    bias = torch.randn(64)
    kept = fp8_module(q, scale, bias, torch.float32, CPU)
    assert isinstance(kept, Q8Linear) and kept.weight.dtype == FP8
    x = torch.randn(3, 128)
    torch.testing.assert_close(kept(x), x @ (q.float() * scale[:, None]).t() + bias, rtol=1e-5, atol=1e-4)
    in_bf16 = fp8_module(q, scale, bias, torch.bfloat16, CPU)
    assert isinstance(in_bf16, Q8Linear) and torch.equal(in_bf16.weight, kept.weight)
    rows = x.bfloat16()
    want = (rows.float() @ (q.float() * scale[:, None]).t() + bias).bfloat16()
    close = {"rtol": 2**-7, "atol": 1e-6 * want.abs().max().item()}
    torch.testing.assert_close(in_bf16(rows), want, **close)
    torch.testing.assert_close(CpuGemm().linear(rows, in_bf16.weight, in_bf16.bias, in_bf16.scales), want, **close)
    asked = fp8_module(q, scale, bias, torch.float32, CPU, keep_fp8=True)  # (the GPU's layer, as tests build it)
    assert isinstance(asked, Fp8Linear)
    # the fused products tell the two fp8 layouts apart by shape: the blocked layout's rows are 16 times as wide
    torch.testing.assert_close(quantized_linear(x, kept.weight, kept.scales), kept(x) - bias)
    torch.testing.assert_close(quantized_linear(x, asked.weight, asked.scales), asked(x) - bias)  # (its rows in fp8)


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = quantizable_llama(7)
    with torch.no_grad():  # norms' weights other than ones (the packed kernels form the norms)
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)
    root = tmp_path_factory.mktemp("fp8-cpu")
    folders = {fmt: write_checkpoint(model, root / fmt, fmt, 32) for fmt in ("fp8-channel", "fp8-tensor", "fp8-block")}
    folders["float"] = write_checkpoint(model, root / "float", "float")
    return folders


@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-tensor", "fp8-block", "quantize=fp8"])
@torch.inference_mode()
def test_the_packed_decode_kernels_give_transformers_logits(
    fp8_folders: dict[str, Path], fmt: str, caplog: pytest.LogCaptureFixture
) -> None:
    """q/k/v and gate/up fused (fp8 with fp8), the layers through the packed kernels (`q4_decode`) and op by op: a
    prompt chunk, then decode rows, give the logits of transformers' forward over the same modules. The start's log
    says where the weights run."""
    with caplog.at_level("INFO"):
        if fmt == "quantize=fp8":
            model = load_causal_lm(fp8_folders["float"], device="cpu", quantize="fp8").model
        else:
            model = load_causal_lm(fp8_folders[fmt], device="cpu").model
    assert any("14 fp8 codes on the q8 kernel" in r.getMessage() for r in caplog.records)
    linears = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert len(linears) == 14 and all(isinstance(m, Q8Linear) and m.weight.dtype == FP8 for m in linears)
    layer = fused_layers(model)[0]
    assert layer.fused and layer.qkv_w.dtype == FP8 and layer.gate_up_w.dtype == FP8
    packed_and_op_by_op_give_transformers_logits(model)


@torch.inference_mode()
def test_int8_and_fp8_codes_are_not_fused(fp8_folders: dict[str, Path]) -> None:
    """A layer whose v_proj holds int8 codes (q8) beside fp8 q and k: two products, each its own codes."""
    model = load_causal_lm(fp8_folders["fp8-channel"], device="cpu").model
    attn = model.model.layers[0].self_attn
    v = attn.v_proj.dequantized()
    attn.v_proj = Q8Linear.from_linear(v)
    seq = [4, 60, 2, 11, 8, 30]
    reference = model(torch.tensor([seq])).logits[0]
    fast = FastLlama(model, paged_cache(model, 4, 4), 128)
    parts = fused_layers(model)[0].qkv
    assert [p.weight.dtype for p in parts] == [FP8, torch.int8]
    out = fast.forward(StepInputs(chunks=[([1, 0], 0, seq)], keep=[*range(len(seq))]))
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-block"])
def test_the_benchmark_reports_the_kept_weights_against_the_de_quantized_ones(tmp_path: Path, fmt: str) -> None:
    """benchmarks/fp8_cpu.py on a small shape: the linears kept fp8 (a fourth of the fp32 bytes, and a little for the
    scales) where before they were fp32, with the de-quantized weights' greedy tokens."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "fp8.json"
    command = [sys.executable, str(root / "benchmarks/fp8_cpu.py"), "--hidden", "256", "--intermediate", "512"]
    command += ["--format", fmt, "--layers", "1", "--steps", "3", "--rows", "1,2", "--prompt", "20", "--json", str(out)]
    subprocess.run(command, check=True)
    results = json.loads(out.read_text())
    now, before = results["served"].values()
    assert now["linears"] == {"Q8Linear (float8_e4m3fn)": 7} and before["linears"] == {"Linear (float32)": 7}
    assert before["linear_mib"] / 4 < now["linear_mib"] < before["linear_mib"] / 3
    assert all(now[f"step_ms_{n}_rows"] > 0 for n in (1, 2)) and now["prompt_chunk_ms_20_tokens"] > 0
    assert all(v["same_greedy_tokens"] for v in results["kept_vs_dequantized"].values())
