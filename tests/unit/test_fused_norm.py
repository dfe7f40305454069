"""engine/model/fused_norm.py: the residual add with the RMS norm, and SiLU with its product, each one Triton
kernel (on CUDA; here under Triton's interpreter, as tests/conftest.py sets it on a CPU), against the
eager ops `FastLlama` runs without them, and the fast forward with them against `generate()`."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from helpers.llama_variants import PROMPTS, greedy_tokens, serve_prompts
from lmiserve.core.events import FinishReason
from lmiserve.engine.attention import kv_quant, triton_ops
from lmiserve.engine.attention.backend_base import KvStore
from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.model import fast_llama, fused_norm, layer_ops

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
pytestmark = pytest.mark.skipif(
    not fused_norm.available() or not (DEVICE.type == "cuda" or triton_ops.interpreting()),
    reason="the kernels run on CUDA, or on a CPU under Triton's interpreter",
)
# bf16 arithmetic is wrong under the interpreter: checked on a GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def close(dtype: torch.dtype) -> dict[str, float]:
    """Within a rounding of the dtype (the sum of squares is added in another order)."""
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}


def counted(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """`module.name` replaced by itself counting its calls (the list grows by one a call)."""
    calls: list[int] = []
    original = getattr(module, name)

    def count(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the function's own
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, count)
    return calls


def rows(width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(5, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("width", [64, 96])  # a power of two, and a row the block masks
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_then_transformers_rms_norm(dtype, width):
    x, residual = rows(width, dtype, 0), rows(width, dtype, 1)
    weight = (1 + 0.1 * rows(width, torch.float32, 2)[0]).to(dtype)
    added, h = fused_norm.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(added, x + residual)  # the add rounds to the dtype as eager's does
    torch.testing.assert_close(h, layer_ops.rms_norm(x + residual, (weight, 1e-5)), **close(dtype))
    same, h = fused_norm.add_rms_norm(x, None, weight, 1e-5)  # a model's first layer: no residual yet
    assert torch.equal(same, x)
    torch.testing.assert_close(h, layer_ops.rms_norm(x, (weight, 1e-5)), **close(dtype))


@pytest.mark.parametrize("inter", [48, 1500])  # inside one block, and across two with a masked tail
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_the_gate_times_the_up_half(dtype, inter):
    gate_up = rows(2 * inter, dtype, 3)
    want = torch.nn.SiLU()(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(fused_norm.silu_mul(gate_up, inter), want, **close(dtype))


@pytest.mark.parametrize("head_dim", [16, 24])  # a power of two, and a half the block masks
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_the_eager_rotation_of_the_q_and_k_heads(dtype, head_dim):
    """The q and k heads of a fused q/k/v row (the v heads after them untouched), each row at its own
    position: the eager ops' values, rounded as they round them."""
    heads, kv_heads, tokens = 4, 2, 5
    qkv = rows((heads + 2 * kv_heads) * head_dim, dtype, 4)[:tokens]
    angles = torch.arange(tokens)[:, None] * (0.1 + torch.arange(head_dim // 2))[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None].to(DEVICE, dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)[:, None].to(DEVICE, dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    want = layer_ops.rotate(qk, cos, sin)
    got = fused_norm.rope(qkv, cos, sin, heads + kv_heads, head_dim)
    assert got.shape == want.shape and got.dtype == dtype
    if DEVICE.type == "cpu":  # the interpreter rounds as the eager ops do: the same values
        assert torch.equal(got, want)
    else:  # a GPU may fuse a product into its sum (fp32)
        torch.testing.assert_close(got, want, **close(dtype))


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("head_dim", [16, 24])  # a power of two, and a half the block masks
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_q_and_stores_k_and_v_as_the_backends_write_does(dtype, head_dim, kv):
    """One kernel for the rotation and the cache's write (`rope_store`): q's heads as `rope` rotates them, and the
    cache's rows after it exactly those after `rope` and `kv_quant.store` of the rotated keys and the values (an fp8
    cache's bytes too, over the layer's scales, saturated), only the `written` rows' (padding rows after them: not),
    every other row of the cache untouched."""
    heads, kv_heads, tokens, written = 4, 2, 5, 4
    qkv = rows((heads + 2 * kv_heads) * head_dim, dtype, 5)[:tokens]
    qkv[1, -head_dim:] *= 600  # a value head past e4m3's range: saturated at 448 * scale
    angles = torch.arange(tokens)[:, None] * (0.3 + torch.arange(head_dim // 2))[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None].to(DEVICE, dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)[:, None].to(DEVICE, dtype)
    cache_dtype = torch.float8_e4m3fn if kv == "fp8" else dtype
    scales = (0.5, 2.0) if kv == "fp8" else (1.0, 1.0)
    slots = 3 * tokens * kv_heads
    start = rows(head_dim, torch.float32, 6).repeat(slots, 1)[:slots].to(cache_dtype)
    keys, values = start.clone(), start.clone()
    at = torch.randperm(slots, generator=torch.Generator().manual_seed(7))[: written * kv_heads].to(DEVICE)
    q = fused_norm.rope_store(qkv, cos, sin, heads, kv_heads, KvStore(keys, values, at, scales, written))
    qk = fused_norm.rope(qkv, cos, sin, heads + kv_heads, head_dim)
    want_keys, want_values = start.clone(), start.clone()
    kv_quant.store(want_keys, at, qk[:written, heads:].reshape(-1, head_dim), scales[0])
    v = qkv[:written, (heads + kv_heads) * head_dim :].reshape(-1, head_dim)
    kv_quant.store(want_values, at, v, scales[1])
    assert torch.equal(q, qk[:, :heads])
    bytes_of = (lambda t: t.view(torch.uint8)) if kv == "fp8" else (lambda t: t)
    assert torch.equal(bytes_of(keys), bytes_of(want_keys))
    assert torch.equal(bytes_of(values), bytes_of(want_values))
    if kv == "fp8":
        assert values[at[3]].float().abs().max().item() == 448.0  # (token 1's last value head, saturated)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_norms_each_q_and_k_head_first_as_qwen3s_norms(dtype, kv):
    """Qwen3's RMS norm of each q and k head before the rotation, in the same kernel: q's heads and the stored
    keys as the eager norm then `rope` make them, within a rounding (the sum of squares is added in another
    order; an fp8 key within an e4m3 step), the values stored exactly."""
    heads, kv_heads, tokens, head_dim = 4, 2, 5, 24
    qkv = rows((heads + 2 * kv_heads) * head_dim, dtype, 8)[:tokens]
    weight = (1 + 0.3 * torch.randn(heads + kv_heads, head_dim, generator=torch.Generator().manual_seed(9))).to(
        DEVICE, dtype
    )
    angles = torch.arange(tokens)[:, None] * (0.3 + torch.arange(head_dim // 2))[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None].to(DEVICE, dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)[:, None].to(DEVICE, dtype)
    cache_dtype = torch.float8_e4m3fn if kv == "fp8" else dtype
    keys = torch.zeros(tokens * kv_heads, head_dim, dtype=cache_dtype, device=DEVICE)
    values = keys.clone()
    at = torch.arange(tokens * kv_heads, device=DEVICE).flip(0)
    q = fused_norm.rope_store(
        qkv, cos, sin, heads, kv_heads, KvStore(keys, values, at, (1.0, 1.0), tokens), (weight, 1e-6)
    )
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    want = layer_ops.rotate(layer_ops.rms_norm(qk, (weight, 1e-6)), cos, sin)
    torch.testing.assert_close(q, want[:, :heads], **close(dtype))
    want_keys, want_values = torch.zeros_like(keys), torch.zeros_like(values)
    kv_quant.store(want_keys, at, want[:, heads:].reshape(-1, head_dim))
    kv_quant.store(want_values, at, qkv[:, (heads + kv_heads) * head_dim :].reshape(-1, head_dim))
    step = {"rtol": 0.07, "atol": 2**-9} if kv == "fp8" else close(dtype)  # (e4m3: 3 mantissa bits)
    torch.testing.assert_close(keys.float(), want_keys.float(), **step)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_fast_forward_with_the_fused_kernels_gives_generates_greedy_tokens(tiny_model, monkeypatch, graphs):
    """Every layer's norms with their residual adds, its rotary embedding and its SiLU product through the kernels (what
    `USE_ON_CUDA` turns on), continuous batching with requests joining: `generate()`'s greedy tokens. Also with
    the decode steps in the decode graphs, prompt rows too (the GPU check's graphs-fused path;
    tests/conftest.py checks their steps would capture)."""
    from helpers.decode_graphs import graphs_on_the_test_device

    made = graphs_on_the_test_device(monkeypatch) if graphs else None
    monkeypatch.setattr(fused_norm, "wanted", lambda device: True)
    monkeypatch.setattr(fused_norm, "USE_ON_CUDA", True)  # (forced: not measured)
    stored = counted(monkeypatch, fused_norm, "rope_store")
    config = EngineConfig(graph_prompt_tokens=8 if graphs else 0)
    engine, results = asyncio.run(serve_prompts(tiny_model, config, 12))
    assert engine.runner.path == "fast" and engine.runner.fast.fused_elementwise
    assert made is None or made.steps  # decode steps replayed the graphs
    # the Triton backend's layers (the graphs'): rotated and stored in one kernel; the CPU backends store their own
    assert bool(stored) == graphs
    for prompt, events in zip(PROMPTS, results, strict=True):
        assert [e.token.id for e in events if e.token] == greedy_tokens(tiny_model, prompt, 12), prompt
        assert events[-1].finish.reason is FinishReason.LENGTH


def decode_logits(model: torch.nn.Module, fused: bool, kv_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Two prompts of 4 tokens, then 3 decode steps of both rows from the decode graphs' buffers, through the fast
    forward over the Triton attention, with or without the fused kernels: each step's logits."""
    from lmiserve.engine.attention.cuda_graphs import DecodeGraphs
    from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
    from lmiserve.engine.model.step_inputs import StepInputs

    cfg, shape = model.config, AttentionShape.of(model.config)
    cache = PagedKVCache(
        cfg.num_hidden_layers, 17, 4, shape.kv_heads, shape.head_dim, model.dtype, DEVICE, kv_dtype=kv_dtype
    )
    fused_norm.USE_ON_CUDA = fused  # (the test's monkeypatch restores it)
    fast = fast_llama.FastLlama(model, cache, 64)
    assert fast.fused_elementwise == fused and fast.triton
    fast.graphs = DecodeGraphs(fast, 2, 16, capture=DEVICE.type == "cuda")
    tables = [[0, 1, 2], [3, 4, 5]]
    fast.forward(StepInputs(chunks=[(tables[i], 0, seq[:4]) for i, seq in enumerate(SEQS)]))
    rows = [[seq[step] for seq in SEQS] for step in range(4, 7)]
    return [
        fast.forward(
            StepInputs(decode_ids=ids, decode_positions=[4 + n] * 2, decode_tables=tables, keep=[0, 1])
        ).clone()  # (the graphs' output buffer: the next step's)
        for n, ids in enumerate(rows)
    ]


SEQS = [torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 7)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@torch.inference_mode()
def test_the_fused_forwards_logits_are_transformers(monkeypatch, kv, arch):
    """With the fused kernels over the Triton attention (every norm weighted at random, the final one too; the
    rotation storing the keys and values, an e4m3 cache's too), prompts and then decode steps from the decode
    graphs' buffers: each row's logits are those of transformers' forward of its sequence, or over an fp8 cache
    those of the unfused forward over one. (Greedy tokens alone would not tell: an RMS norm of unit weights only
    scales a row.) Qwen3's: each q and k head normed first, in the same kernel."""
    from helpers.llama_variants import ARCHS, build

    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(fused_norm, "wanted", lambda device: True)
    monkeypatch.setattr(fused_norm, "USE_ON_CUDA", True)
    stored = counted(monkeypatch, fused_norm, "rope_store")
    model = build(*ARCHS[arch]).to(DEVICE)
    for name, weight in model.named_parameters():
        if name.endswith("norm.weight"):
            weight.uniform_(0.5, 1.5)
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else None
    got = decode_logits(model, True, kv_dtype)
    if kv == "fp8":
        want = decode_logits(model, False, kv_dtype)
    else:
        full = [model(torch.tensor([seq], device=DEVICE)).logits[0] for seq in SEQS]
        want = [torch.stack([logits[step] for logits in full]) for step in range(4, 7)]
    # (a GPU may fuse the rotation's products into its sums, and a key an ulp apart can round to the next e4m3 value)
    tol = 1e-2 if kv == "fp8" and DEVICE.type == "cuda" else 1e-4
    for step_got, step_want in zip(got, want, strict=True):
        torch.testing.assert_close(step_got, step_want, rtol=tol, atol=tol)
    assert stored  # (the store in the rotation's kernel served)


def test_a_model_whose_activation_is_not_silu_keeps_the_eager_ops(tiny_model, monkeypatch):
    """`silu_mul` computes SiLU: a model of another activation (GELU here) does not take the kernels."""
    monkeypatch.setattr(fused_norm, "wanted", lambda device: True)
    monkeypatch.setattr(fused_norm, "USE_ON_CUDA", True)
    layer = fast_llama.fused_layers(tiny_model.model)[0]  # the layers every forward of this model shares
    monkeypatch.setattr(layer, "act", torch.nn.GELU())
    fast = fast_llama.FastLlama(tiny_model.model, paged_cache(tiny_model.model, 4, 16), 64)
    assert not fast.fused_elementwise


@pytest.mark.parametrize("count", [1, 5, 17])  # one row, a few, and more than a padded block (not written)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_norm_writes_its_rows_in_fp8_as_the_products_quantizer_does(dtype, count, monkeypatch):
    """`fp8_rows`: the normed rows (the same as without it) also in fp8, bytes and scales those of `fp8_w8a8`'s
    quantizing kernel on the stored rows, padded with zero rows to 16, and given to the products of those rows,
    which then launch no quantizing kernel; more rows than 16 (a prompt's) are not written."""
    from lmiserve.engine.model import fp8_w8a8

    if not fp8_w8a8.applies(torch.empty(16, 16, dtype=torch.float8_e4m3fn), DEVICE):
        pytest.skip("needs fp8 products (a GPU of compute capability 8.9+, or torch's CPU _scaled_mm)")
    x = torch.randn(count, 96, generator=torch.Generator().manual_seed(count)).to(DEVICE, dtype) * 3
    residual = rows(96, dtype, 1)[:1].expand(count, -1)
    weight = (1 + 0.1 * rows(96, torch.float32, 2)[0]).to(dtype)
    plain = fused_norm.add_rms_norm(x, residual, weight, 1e-5)
    monkeypatch.setattr(fp8_w8a8, "_given", None)
    added, h = fused_norm.add_rms_norm(x, residual, weight, 1e-5, fp8_rows=True)
    assert torch.equal(added, plain[0]) and torch.equal(h, plain[1])
    given = fp8_w8a8._given
    if count > fp8_w8a8.PAD:
        assert given is None
        return
    assert given is not None and given[0]() is h
    want_q, want_scales = fp8_w8a8._rows_in_fp8(h.clone())  # (another tensor: quantized by the product's kernel)
    assert torch.equal(given[1].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(given[2][:count], want_scales[:count]) and not given[1][count:].view(torch.uint8).any()
    monkeypatch.setattr(fp8_w8a8, "_kernels", lambda: pytest.fail("the rows were quantized again"))
    assert fp8_w8a8._rows_in_fp8(h)[0] is given[1]


@pytest.mark.parametrize("count", [1, 17])
@pytest.mark.parametrize("inter", [48, 1500])  # one block, and a row past the unquantized kernel's block
def test_silu_writes_its_rows_in_fp8_as_the_products_quantizer_does(count, inter, monkeypatch):
    """`silu_mul`'s `fp8_rows` as `add_rms_norm`'s: the same rows, and up to 16 of them in fp8 as `fp8_w8a8`'s
    quantizing kernel writes them, given to the down product."""
    from lmiserve.engine.model import fp8_w8a8

    if not fp8_w8a8.applies(torch.empty(16, 16, dtype=torch.float8_e4m3fn), DEVICE):
        pytest.skip("needs fp8 products (a GPU of compute capability 8.9+, or torch's CPU _scaled_mm)")
    gate_up = torch.randn(count, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(DEVICE) * 3
    plain = fused_norm.silu_mul(gate_up, inter)
    monkeypatch.setattr(fp8_w8a8, "_given", None)
    h = fused_norm.silu_mul(gate_up, inter, fp8_rows=True)
    assert torch.equal(h, plain)
    given = fp8_w8a8._given
    if count > fp8_w8a8.PAD:
        assert given is None
        return
    assert given is not None and given[0]() is h
    want_q, want_scales = fp8_w8a8._rows_in_fp8(h.clone())
    assert torch.equal(given[1].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(given[2][:count], want_scales[:count])
