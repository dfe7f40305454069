"""The group-quantized CPU kernels (engine/model/group_kernels.py, group_tiles.py) and the layers built on them
(`quantize.Int4Linear`, `quantize.Q8Linear`): products against a float reference made from the same
codes, the blocked layouts' round trip, and the q8 output projection of a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmiserve.engine.model import group_kernels as gk
from lmiserve.engine.model.quantize import (
    Int4Linear,
    Q8Linear,
    install_output_q8,
    int4_codes,
    quantize_linears_int4,
    quantize_output_q8,
    quantized_linear,
)

pytestmark = pytest.mark.skipif(not gk.available(), reason="numba is not installed")

SHAPES = [(1, 48, 64), (3, 40, 96), (5, 80, 576), (9, 96, 128), (16, 16, 32), (17, 33, 64), (32, 64, 64)]


def _q4_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    n = codes.shape[0]
    w = codes.double().view(n, -1, gk.Q4_GROUP) * scale.double()[..., None] + low.double()[..., None]
    return x.double() @ w.view(n, -1).T


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_q4_product_matches_the_float_weight_of_its_codes(rows: int, n: int, k: int):
    torch.manual_seed(rows * 1000 + n)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, low = torch.rand(n, k // 32) * 0.1, torch.randn(n, k // 32) * 0.1
    packed, scales = gk.pack_q4(codes, scale, low)
    assert packed.shape == (-(-n // 16), k * 8) and scales.shape == (-(-n // 16), k)
    back = gk.unpack_q4(packed, scales, n)
    assert torch.equal(back[0].int(), codes) and torch.equal(back[1], scale) and torch.equal(back[2], low)
    x = torch.randn(rows, k)
    y = gk.q4_linear(x, packed, scales, n)
    assert y.shape == (rows, n) and y.dtype == torch.float32 and y.is_contiguous()
    torch.testing.assert_close(y.double(), _q4_reference(x, codes, scale, low), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_q8_product_matches_the_float_weight_of_its_codes(rows: int, n: int, k: int, group: int):
    torch.manual_seed(rows * 1000 + n + group)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // group) * 0.01
    packed, scales = gk.pack_q8(codes, scale)
    back = gk.unpack_q8(packed, scales, n)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale)
    x = torch.randn(rows, k)
    w = (codes.double().view(n, -1, group) * scale.double()[..., None]).view(n, k)
    y = gk.q8_linear(x, packed, scales, n)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y.double(), x.double() @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_f4_product_matches_the_float_weight_of_its_4_bit_floats(rows: int, n: int, k: int):
    """MXFP4's e2m1 codes (every one of the 16, subnormal and negative zero included) times their group's scale,
    powers of two from 2 ** -127 (the smallest MXFP4 writes) to 2 ** 20: the layout's round trip, and the product of
    the float weight they encode, in tiles of 1 to 8 rows and more."""
    torch.manual_seed(rows * 1000 + n + 7)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    codes[0, :16] = torch.arange(16)
    scale = torch.exp2(torch.randint(-12, 21, (n, k // 32)).float())
    scale[0, 0] = 2.0**-127
    packed, scales = gk.pack_f4(codes, scale)
    assert packed.shape == (-(-n // 16), k * 8) and scales.shape == (-(-n // 16), k // 2)
    back = gk.unpack_f4(packed, scales, n)
    assert torch.equal(back[0].int(), codes) and torch.equal(back[1], scale)
    fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    w = (fp4.double()[codes].view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    x = torch.randn(rows, k)
    y = gk.f4_linear(x, packed, scales, n)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    want = x.double() @ w.T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    one = torch.zeros(1, k)
    one[0, :16] = torch.arange(1.0, 17.0)  # (row 0's first 16 inputs: each code once, its scale 2 ** -127)
    assert gk.f4_linear(one, packed, scales, n)[0, 0].item() == (fp4[:16] * one[0, :16]).sum().item() * 2.0**-127


def test_inputs_of_any_float_dtype_and_strides():
    codes, scale, low = torch.randint(0, 16, (32, 64)), torch.rand(32, 2), torch.rand(32, 2)
    packed, scales = gk.pack_q4(codes, scale, low)
    x = torch.randn(64, 3).t()  # not contiguous
    expected = gk.q4_linear(x.contiguous(), packed, scales)
    assert torch.equal(gk.q4_linear(x, packed, scales), expected)
    torch.testing.assert_close(
        gk.q4_linear(x.bfloat16(), packed, scales), gk.q4_linear(x.bfloat16().float(), packed, scales)
    )


def test_int4_linear_keeps_a_q4_1_weights_codes_and_fp32_scales():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    codes, scale, low = int4_codes(linear.weight)
    module = Int4Linear.from_linear(linear)
    assert module.out_features == 40 and module.weight.shape == (3, 96 * 8)
    got = module.codes()
    assert torch.equal(got[0].int(), codes) and torch.equal(got[1], scale) and torch.equal(got[2], low)
    x = torch.randn(2, 3, 96)
    y = module(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32
    expected = (_q4_reference(x.view(-1, 96), codes, scale, low) + linear.bias.double()).view(2, 3, 40)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    # from a file's own codes: the same module
    direct = Int4Linear.from_codes(codes.to(torch.uint8), scale, low, linear.bias)
    assert torch.equal(direct.weight, module.weight) and torch.equal(direct.scales, module.scales)
    assert torch.equal(
        quantized_linear(x.view(-1, 96), module.weight, module.scales)[:, :40] + linear.bias, y.view(-1, 40)
    )
    torch.testing.assert_close(module.dequantized(), linear.weight.detach(), rtol=0, atol=scale.max().item())


def test_q8_linear_quantizes_as_q8_0_and_takes_codes():
    torch.manual_seed(1)
    weight = torch.randn(48, 64)
    module = Q8Linear.from_linear(weight)
    codes, scale = module.codes()
    assert codes.dtype == torch.int8 and scale.shape == (48, 2)
    groups = weight.view(48, 2, 32)
    torch.testing.assert_close(scale, groups.abs().amax(dim=-1) / 127)
    assert torch.equal(codes, torch.round(groups / scale[..., None]).to(torch.int8).view(48, 64))
    torch.testing.assert_close(module.dequantized(), weight, rtol=0, atol=scale.max().item() / 2 + 1e-6)
    x = torch.randn(5, 64)
    torch.testing.assert_close(module(x), x @ module.dequantized().T, rtol=1e-5, atol=1e-5)
    sixteen = Q8Linear.from_codes(*Q8Linear.from_linear(weight, group=16).codes())
    torch.testing.assert_close(sixteen(x), x @ sixteen.dequantized().T, rtol=1e-5, atol=1e-5)


def test_a_q8_output_projection_serves_the_fast_path(tiny_model_dir: Path):
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine
    from lmiserve.engine.model.layer_ops import rms_norm
    from lmiserve.models.load import load_causal_lm

    loaded = load_causal_lm(tiny_model_dir, dtype="fp32", device="cpu")
    model = loaded.model
    assert quantize_linears_int4(model) > 0
    embed = model.model.embed_tokens.weight.detach().clone()
    reference = Q8Linear.from_linear(model.lm_head)
    assert quantize_output_q8(model)
    head = model.lm_head
    assert isinstance(head, Q8Linear) and torch.equal(head.weight, reference.weight)
    assert torch.equal(model.model.embed_tokens.weight, embed)  # untied: the embeddings keep their weights
    engine = create_engine(loaded, EngineConfig())
    assert engine.runner.path == "fast"  # int4 layers of outputs a multiple of 16 fuse
    fast = engine.runner.fast
    h = torch.randn(3, embed.shape[1])
    assert fast.packed is not None and fast.packed.head is not None  # the final norm formed in the kernel
    # the same fp32 formula, the norm's mean summed in another order (engine/model/q4_decode.py)
    torch.testing.assert_close(fast._logits(h), head(rms_norm(h, fast.norm)), rtol=1e-5, atol=1e-5)
    install_output_q8(model, *reference.codes())
    assert torch.equal(model.lm_head.scales, reference.scales)
