"""An int4 model's layers in few kernel calls (engine/model/q4_decode.py): the kernels' input sides
(`group_kernels.PRE_RMS`, `PRE_SILU_MUL`) and output side (the residual add) against the op-by-op
products, RoPE in place against `layer_ops.rotate`, and `FastLlama` steps with and without it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.llama_variants import ARCHS, build
from lmiserve.engine.attention import cpu_kernel
from lmiserve.engine.attention.paged import PagedKVCache
from lmiserve.engine.model import group_kernels as gk
from lmiserve.engine.model import q4_decode
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.engine.model.layer_ops import rms_norm, rotate
from lmiserve.engine.model.quantize import quantize_linears_int4, quantize_output_q8

pytestmark = pytest.mark.skipif(not gk.available(), reason="numba is not installed")


def _packed(kind: str, n: int, k: int) -> tuple[gk.Packed, torch.Tensor, torch.Tensor]:
    if kind == "q4":
        packed, scales = gk.pack_q4(
            torch.randint(0, 16, (n, k)), torch.rand(n, k // 32) * 0.1, torch.randn(n, k // 32) * 0.1
        )
    else:
        packed, scales = gk.pack_q8(torch.randint(-127, 128, (n, k)), torch.rand(n, k // 32) * 0.01)
    return gk.Packed(packed, scales), packed, scales


def _product(kind: str, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (gk.q4_linear if kind == "q4" else gk.q8_linear)(x, packed, scales)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 64), (3, 96, 576), (5, 32, 128), (9, 64, 96)])
def test_the_kernel_forms_its_input_and_adds_its_output_as_the_ops_do(kind: str, rows: int, n: int, k: int):
    torch.manual_seed(rows * 100 + k)
    weight, packed, scales = _packed(kind, n, k)
    x, norm = torch.randn(rows, k) * 3, torch.randn(k)
    out = np.empty((rows, n), dtype=np.float32)
    # the RMS norm: the same fp32 formula, the mean summed in another order
    weight(x.numpy(), out, gk.PRE_RMS, norm.numpy(), 1e-5)
    torch.testing.assert_close(
        torch.from_numpy(out), _product(kind, rms_norm(x, (norm, 1e-5)), packed, scales), rtol=1e-5, atol=1e-5
    )
    # silu(gate) * up of a [M, 2K] input
    gate_up = torch.randn(rows, 2 * k) * 2
    weight(gate_up.numpy(), out, gk.PRE_SILU_MUL)
    expected = _product(kind, F.silu(gate_up[:, :k]) * gate_up[:, k:], packed, scales)
    torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-5, atol=1e-5)
    # the residual add: one fp32 add to what the output holds, as ``x + o``
    residual = torch.randn(rows, n)
    out[:] = residual.numpy()
    weight(x.numpy(), out, add=True)
    assert torch.equal(torch.from_numpy(out), residual + _product(kind, x, packed, scales))
    weight(x.numpy(), out)
    assert torch.equal(torch.from_numpy(out), _product(kind, x, packed, scales))


def test_rope_in_place_is_rotate_half_bit_for_bit():
    torch.manual_seed(0)
    rows, heads, dim = 3, 6, 16
    qkv = torch.randn(rows, (heads + 2) * dim)
    cos, sin = torch.randn(rows, 1, dim), torch.randn(rows, 1, dim)
    expected = rotate(qkv[:, : heads * dim].reshape(rows, heads, dim), cos, sin).reshape(rows, -1)
    got = qkv.clone()
    q4_decode._rope_compiled()(got.numpy(), heads, dim, cos[:, 0].numpy(), sin[:, 0].numpy())
    assert torch.equal(got[:, : heads * dim], expected)
    assert torch.equal(got[:, heads * dim :], qkv[:, heads * dim :])  # the values untouched


def _int4(arch: str = "llama") -> torch.nn.Module:
    model = build(*ARCHS[arch])
    assert quantize_linears_int4(model) > 0 and quantize_output_q8(model)
    return model


def _fast(
    model: torch.nn.Module, kv_dtype: torch.dtype | None = None, scales: list[tuple[float, float]] | None = None
) -> FastLlama:
    cfg = model.config
    cache = PagedKVCache(
        cfg.num_hidden_layers,
        16,
        4,
        cfg.num_key_value_heads,
        16,
        model.dtype,
        model.device,
        kv_dtype=kv_dtype,
        scales=scales,
    )
    return FastLlama(model, cache, 256)


def _steps(fast: FastLlama, lora: object = None) -> list[torch.Tensor]:
    """A prompt chunk of 9 tokens, a step of two decode rows and a 3-token chunk, then steps of decode
    rows alone (two, then one: the compiled attention on the qkv buffer's views)."""
    steps = [
        StepInputs(chunks=[([0, 1, 2], 0, list(range(5, 14)))], keep=[*range(9)]),
        StepInputs([7, 9], [9, 0], [[0, 1, 2], [3]], chunks=[([4], 0, [11, 12, 13])], keep=[0, 1, 4]),
        StepInputs([8, 21], [10, 3], [[0, 1, 2], [4]], keep=[0, 1]),
        StepInputs([30], [11], [[0, 1, 2]], keep=[0]),
    ]
    return [fast.forward(dataclasses.replace(step, lora=lora)) for step in steps]


def _recorded_lean(fast: FastLlama, lean: list[bool]) -> None:
    decode_kernel = fast.attention.decode_kernel  # type: ignore[attr-defined]

    def recorded(meta):
        call = decode_kernel(meta)
        lean.append(call is not None)
        return call

    fast.attention.decode_kernel = recorded  # type: ignore[attr-defined]


@torch.inference_mode()
def test_an_int4_model_runs_its_layers_through_the_packed_kernels():
    model = _int4()
    fast = _fast(model)
    assert fast.packed is not None and fast.packed.head is not None
    calls, lean = [], []
    run = fast.packed.run
    fast.packed.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]
    _recorded_lean(fast, lean)
    fused = _steps(fast)
    assert len(calls) == 4 and lean == [False, False, True, True]
    plain = _fast(model)
    plain.packed = None  # the op-by-op layers and output projection
    for got, expected in zip(fused, _steps(plain), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@torch.inference_mode()
def test_the_lean_attention_reads_and_writes_bf16_and_fp8_pools_as_the_backend_does(kv_dtype: torch.dtype):
    """Decode rows over a bf16 or fp8 pool take the one-call attention too: its new keys and values stored as the
    pool stores them (an fp8 pool's over the layer's scales, here not 1), the scales applied as the backend's
    call applies them. The same packed layers with the backend's call give the same logits and the same pool."""
    model = _int4()
    layers = model.config.num_hidden_layers
    scales = [(0.5, 2.0), (1.5, 0.25)] + [(1.0, 1.0)] * (layers - 2)
    lean: list[bool] = []
    fast, backend = _fast(model, kv_dtype, scales), _fast(model, kv_dtype, scales)
    for pool in (*fast.cache.keys, *fast.cache.values, *backend.cache.keys, *backend.cache.values):
        pool.view(torch.uint8).zero_()  # (the pools are compared whole below)
    assert type(fast.attention).__name__ == "CpuKernelBackend"
    _recorded_lean(fast, lean)
    got = _steps(fast)
    assert lean == [False, False, True, True]
    backend.attention.decode_kernel = lambda meta: None  # type: ignore[attr-defined]
    for mine, theirs in zip(got, _steps(backend), strict=True):
        assert torch.equal(mine, theirs)
    bits = cpu_kernel.bits
    for pool in ("keys", "values"):
        for a, b in zip(getattr(fast.cache, pool), getattr(backend.cache, pool), strict=True):
            assert np.array_equal(bits(a), bits(b))
    # and near the fp32 pool's logits, by the pool's rounding (measured: <= 0.008, 0.14, 0.24 of their norm)
    bound = {torch.bfloat16: 0.02, torch.float8_e4m3fn: 0.2, torch.float8_e5m2: 0.35}[kv_dtype]
    for mine, exact in zip(got, _steps(_fast(model)), strict=True):
        assert (mine - exact).norm() <= bound * exact.norm()


class _NoAdapter:
    """A LoRA batch that adds nothing but must see every product's input."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.names.append(name)


@torch.inference_mode()
def test_lora_steps_and_long_steps_keep_the_op_by_op_layers(monkeypatch):
    model = _int4()
    fast = _fast(model)
    assert fast.packed is not None
    expected = _steps(fast)
    monkeypatch.setattr(q4_decode.PackedLayers, "run", lambda *a: pytest.fail("packed layers on a LoRA step"))
    fast = _fast(model)
    lora = _NoAdapter()
    for got, want in zip(_steps(fast, lora), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert lora.names[:4] == ["0.qkv", "0.o", "0.gate_up", "0.down"]
    long = q4_decode.MAX_ROWS + 1
    out = fast.forward(StepInputs(chunks=[(list(range(16)), 0, [5] * long)], keep=[long - 1]))
    assert out.shape == (1, model.config.vocab_size)


def test_float_models_and_biased_int4_layers_keep_the_op_by_op_path():
    assert _fast(build(*ARCHS["llama"])).packed is None  # fp32
    assert _fast(build(*ARCHS["llama"]).bfloat16()).packed is None
    assert _fast(_int4("qwen2_bias")).packed is None  # q/k/v biases
    assert _fast(_int4("smollm3_nope")).packed is None  # a layer without RoPE (the kernels rotate every layer)
    assert _fast(_int4("qwen3")).packed is None  # the heads' norms
    assert _fast(_int4("granite")).packed is None  # its multipliers
    assert _fast(_int4("gemma")).packed is None  # (1 + w) norms, GELU
    assert _fast(_int4("gemma3_window")).packed is None  # and the norms of attention's and the MLP's outputs
    assert _fast(_int4("olmo2")).packed is None  # norms of the outputs alone, of the whole q and k
    assert _fast(_int4("starcoder2_window")).packed is None  # LayerNorms, an MLP without a gate
    assert _fast(_int4("glm")).packed is None  # RoPE by pairs over half of each head
