"""fp8 weights with one scale a tensor (issue #39): ``quantize=fp8`` quantizes per tensor where the GPU has fp8
products (vLLM's online fp8; per channel elsewhere, `fp8_ops.per_tensor_at_load`, ``LMISERVE_FP8_PER_TENSOR``
forces either), and the fast path puts a fused product's per-tensor parts on one scale
(`quant_formats.one_scale_for`), so one decode row runs on cuBLAS's tensor-wise product (`fp8_w8a8.ONE_SCALE`)."""

from __future__ import annotations

import pytest
import torch

from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_ops, fp8_w8a8
from lmiserve.engine.model.quant_formats import Fp8Linear, dequantize_fp8, one_scale_for, quantize_fp8


def test_per_tensor_quantization_takes_one_scale_over_the_whole_weight_or_the_ranks_maximum() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 64) * torch.logspace(-2, 0, 32)[:, None]  # rows of very different ranges
    q, scale = quantize_fp8(w, per_tensor=True)
    assert torch.equal(scale, (w.abs().amax() / 448).reshape(1))
    assert torch.equal(q, (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
    half, whole = quantize_fp8(w[:16], per_tensor=True), quantize_fp8(w[16:], w.abs().amax(), per_tensor=True)
    assert half[1].item() <= whole[1].item() == scale.item()  # a rank's part: the whole weight's maximum
    # per channel keeps the small rows' precision that one scale gives up (the price of the tensor-wise product)
    channel = dequantize_fp8(*quantize_fp8(w))
    tensor = dequantize_fp8(q, scale)
    assert (channel - w)[:8].abs().max() < (tensor - w)[:8].abs().max()


def test_quantize_fp8_is_per_tensor_on_a_gpu_with_fp8_products_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fp8_ops, "PER_TENSOR", None)
    monkeypatch.setattr(fp8_devices, "native", lambda device: True)
    assert fp8_ops.per_tensor_at_load(cuda) and not fp8_ops.per_tensor_at_load(torch.device("cpu"))
    monkeypatch.setattr(fp8_devices, "native", lambda device: False)  # an A100: the widening kernel, per channel
    assert not fp8_ops.per_tensor_at_load(cuda)
    monkeypatch.setattr(fp8_ops, "PER_TENSOR", True)
    assert fp8_ops.per_tensor_at_load(cuda) and fp8_ops.per_tensor_at_load(torch.device("cpu"))
    monkeypatch.setattr(fp8_ops, "PER_TENSOR", False)
    monkeypatch.setattr(fp8_devices, "native", lambda device: True)
    assert not fp8_ops.per_tensor_at_load(cuda)


def parts(*ranges: float, per_tensor: bool = True) -> list[Fp8Linear]:
    torch.manual_seed(1)
    made = []
    for i, r in enumerate(ranges):
        q, s = quantize_fp8(torch.randn(16 * (i + 1), 64) * r, per_tensor=per_tensor)
        made.append(Fp8Linear(q, s.expand(q.shape[0]).contiguous(), None))
    return made


def test_fused_per_tensor_parts_are_put_on_the_largest_scale() -> None:
    """q, k and v (or gate and up) quantized each on its own scale: each part's fp8 values re-rounded at the
    largest scale (its weights within half a step of that scale's grid of the original), the largest part's
    bytes unchanged, every part's scales that one value."""
    q, k, v = parts(0.05, 0.5, 0.1)
    before = [m.dequantized() for m in (q, k, v)]
    largest = k.weight.clone()
    top = k.scales[0].item()
    one_scale_for([q, k, v])
    for m, was in zip((q, k, v), before, strict=True):
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight.is_contiguous()
        assert fp8_w8a8.one_scale(m.scales) and m.scales[0].item() == top
        step = top * 2.0 ** (torch.floor(torch.log2(was.abs() / top).clamp(min=-6)) - 3)  # e4m3's spacing
        assert ((m.dequantized() - was).abs() <= step / 2 + 1e-12).all()
    assert torch.equal(k.weight.view(torch.uint8), largest.view(torch.uint8))


@pytest.mark.parametrize("case", ["per-channel", "one-scale-already", "no-fp8-gpu", "one-part"])
def test_other_parts_are_left_as_they_are(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts with a scale a channel, parts on one scale already, a GPU without fp8 products (an A100's widening
    kernel applies any scales at no cost: re-rounding would only lose precision), a product of one part."""
    made = {
        "per-channel": lambda: parts(0.05, 0.5, per_tensor=False),
        "one-scale-already": lambda: parts(0.5, 0.5),
        "no-fp8-gpu": lambda: parts(0.05, 0.5),
        "one-part": lambda: parts(0.05),
    }[case]()
    if case == "no-fp8-gpu":
        monkeypatch.setattr(fp8_devices, "native", lambda device: False)
    if case == "one-scale-already":
        made[1].scales = made[0].scales[:1].expand(made[1].weight.shape[0]).contiguous()
    before = [(m.weight.clone(), m.scales.clone()) for m in made]
    one_scale_for(made)
    for m, (weight, scales) in zip(made, before, strict=True):
        assert torch.equal(m.weight.view(torch.uint8), weight.view(torch.uint8)) and torch.equal(m.scales, scales)
