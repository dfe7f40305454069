"""Random fp8 weights for the fp8 products' tests (test_fp8_gemv.py, test_fp8_w8a8.py), and the choices those
tests start without."""

from __future__ import annotations

import pytest
import torch

from lmiserve.engine.model import fp8_gemv
from lmiserve.engine.model.fp8_ops import dequantize_fp8, quantize_fp8


def fp8_weight(out: int, inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``[out, inputs]`` weight in fp8 with its per-channel scales, and its de-quantized fp32 copy."""
    torch.manual_seed(seed)
    q, scale = quantize_fp8(torch.randn(out, inputs) * 0.05)
    return q, scale, dequantize_fp8(q, scale)


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """No choice of `fp8_gemv` kept from another test (import it into a test module to apply it there)."""
    monkeypatch.setattr(fp8_gemv, "_chosen", {})
