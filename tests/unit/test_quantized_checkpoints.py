"""Quantized checkpoints (issue #39): fp8 (compressed-tensors per channel and per tensor, FBGEMM fp8), AWQ
and GPTQ 4-bit, written from a tiny random Llama by `models.quant_pack`, and compressed-tensors' 4-bit
``pack-quantized`` (W4A16 symmetric and asymmetric) written by the compressed-tensors package itself
(`helpers.compressed_ints`), loaded by `load_causal_lm`.

The reference de-quantization here is written from the formats' published unpacking (AutoAWQ's
`unpack_awq` + `reverse_awq_order`, AutoGPTQ's `wf` shifts with ``zeros + 1``, compressed-tensors'
``weight * weight_scale``; for W4A16, compressed-tensors' own decompressor), independently of `quant_formats`; every linear must equal it exactly (fp32),
and the engine's greedy tokens must equal transformers' forward on the de-quantized float model.

The tests of `on the test device` run on LMISERVE_TEST_DEVICE in bf16 (benchmarks/gpu_check.py runs this file
with it set to cuda: fp8 through `torch._scaled_mm` on Hopper, AWQ/GPTQ de-quantized or through the Triton
int4 kernel)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from helpers.compressed_ints import FORMATS as COMPRESSED_INT4
from helpers.compressed_ints import INT4_FORMATS, decompressed
from helpers.decode_graphs import graphs_on_the_test_device
from helpers.modelopt_checkpoints import FORMATS as MODELOPT
from helpers.modelopt_checkpoints import installed as modelopt_installed
from helpers.published_unpacking import ref_awq, ref_gptq
from helpers.quantizable import quantizable_llama, write_checkpoint
from helpers.tiny_model import build_tiny_tokenizer
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention import cpu_kernel
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model import int4_triton
from lmiserve.engine.model.packed_codes import unpack_int8
from lmiserve.engine.model.quant_formats import (
    Fp8Linear,
    fp8_module,
    fp8_scaled_mm_supported,
    int8_module,
    quantize_fp8,
    unpack_awq,
    unpack_gptq,
)
from lmiserve.engine.model.quantize import Int4Linear, Int8Linear, Q8Linear, int4_available, quantize_weight
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm
from lmiserve.models.quant_pack import rtn_int4

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = {  # id: (quant_pack format, act_order, group)
    "fp8-channel": ("fp8-channel", False, 0),
    "fp8-tensor": ("fp8-tensor", False, 0),
    "fbgemm-fp8": ("fbgemm-fp8", False, 0),
    "fp8-block-b32": ("fp8-block", False, 32),  # (Qwen3's FP8 releases: blocks of 128; dequantized at load)
    "awq-g128": ("awq", False, 128),
    "gptq-g128": ("gptq", False, 128),
    "gptq-g64-desc-act": ("gptq", True, 64),
    "gptq-int8-g32": ("gptq-int8", False, 32),  # symmetric 8-bit codes (Qwen's GPTQ-Int8 releases; groups of 128)
    "gptq-int8-g64-desc-act": ("gptq-int8", True, 64),  # (on the CPU's q8 kernel, the inputs in group order)
    "w4a16-g32": ("w4a16", False, 32),  # compressed-tensors pack-quantized (llm-compressor's GPTQ W4A16)
    "w4a16-asym-g64": ("w4a16-asym", False, 64),  # with zero points (llm-compressor's AWQ, W4A16_ASYM)
    "w4a16-channel": ("w4a16", False, -1),  # one scale an output channel
    "w8a8": ("w8a8", False, 0),  # compressed-tensors int-quantized: int8 by channel (activations left float)
    "w8a16-g32": ("w8a16", False, 32),  # compressed-tensors pack-quantized 8-bit codes
    "modelopt-fp8": ("modelopt-fp8", False, 0),  # NVIDIA ModelOpt's export (helpers.modelopt_checkpoints): FP8
    "modelopt-fp8-channel": ("modelopt-fp8-channel", False, 0),  # FP8_PER_CHANNEL_PER_TOKEN
    "modelopt-fp8-block": ("modelopt-fp8-block", False, 0),  # FP8_PB_WO: blocks of 128 x 128
}
BLOCK_FP8 = ("fp8-block-b32", "modelopt-fp8-block")
PER_ROW_FP8 = ("fp8-channel", "fp8-tensor", "fbgemm-fp8", "modelopt-fp8", "modelopt-fp8-channel")
INT4 = ("awq", "gptq", *INT4_FORMATS)
INT8 = ("gptq-int8", "w8a8", "w8a16")  # (symmetric 8-bit codes)


def tiny_llama() -> tuple[LlamaForCausalLM, object]:
    return quantizable_llama(39), build_tiny_tokenizer()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model, _ = tiny_llama()
    root = tmp_path_factory.mktemp("quantized")
    dirs = {"float": write_checkpoint(model, root / "float", "float")}
    for case, (fmt, act_order, group) in CASES.items():
        if fmt in MODELOPT and not modelopt_installed():
            continue  # (the GPU check's kit has no ModelOpt: `written` skips those cases)
        dirs[case] = write_checkpoint(model, root / case, fmt, group or 128, act_order)
    return dirs


@pytest.fixture(autouse=True)
def written(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> None:
    """A case whose checkpoint its writer could not make here (ModelOpt's, without ModelOpt) is skipped."""
    case = getattr(request.node, "callspec", None) and request.node.callspec.params.get("case")
    if case and case not in checkpoints:
        pytest.skip(f"{case}: nvidia-modelopt, which writes it, is not installed")


# --- the published unpacking, written out as the reference -------------------------------------------------


def ref_fp8(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"].float()


def ref_fp8_block(t: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    out, inputs = t["weight"].shape
    q = t["weight"].float().reshape(out // block, block, inputs // block, block)
    return (q * t["weight_scale_inv"][:, None, :, None]).reshape(out, inputs)


def ref_modelopt(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """ModelOpt's ``weight * weight_scale``: one scale, ``[out]`` (a row's), or ``[out / 128, 1, in / 128, 1]`` (a
    block's, as its blocks broadcast)."""
    weight, scale = t["weight"].float(), t["weight_scale"].float()
    if scale.dim() == 4:
        out, inputs = weight.shape
        return (weight.reshape(scale.shape[0], 128, scale.shape[2], 128) * scale).reshape(out, inputs)
    return weight * (scale[:, None] if scale.dim() == 1 else scale)


def reference(case: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    fmt, _, group = CASES[case]
    if fmt.startswith("modelopt"):
        return ref_modelopt(t)
    if fmt == "fp8-block":
        return ref_fp8_block(t, group)
    if fmt in COMPRESSED_INT4:
        return decompressed(fmt, group, t)
    return ref_awq(t, group) if fmt == "awq" else ref_gptq(t) if fmt.startswith("gptq") else ref_fp8(t)


def stored(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    flat = load_file(str(path / "model.safetensors"))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, _, part = key.rpartition(".")
        out.setdefault(name, {})[part] = value
    return out


def dequantized_float_model(checkpoint: Path, case: str) -> LlamaForCausalLM:
    model, _ = tiny_llama()
    tensors = stored(checkpoint)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in LINEARS:
                module.weight.copy_(reference(case, tensors[name]))
    return model


# --- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["awq-g128", "gptq-g128", "gptq-g64-desc-act", "gptq-int8-g32", "gptq-int8-g64-desc-act"]
)
def test_the_packer_round_trips_through_the_published_unpacking(checkpoints: dict[str, Path], case: str) -> None:
    """What quant_pack writes, the reference formulas read as RTN of the float weights (within half a step)."""
    model, _ = tiny_llama()
    tensors = stored(checkpoints[case])
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in LINEARS:
            continue
        t = tensors[name]
        want = reference(case, t)
        step = t["scales"].float().max().item()
        assert (want - module.weight.detach()).abs().max().item() <= step / 2 + 1e-6, name
        fmt, _, group = CASES[case]
        parts = (
            unpack_awq(t["qweight"], t["qzeros"], t["scales"], group)
            if fmt == "awq"
            else unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, bits=8 if "int8" in fmt else 4)
        )
        assert torch.equal(parts.dequantize(), want), name


@pytest.mark.parametrize("case", list(CASES))
def test_each_format_loads_with_every_linear_equal_to_the_reference(checkpoints: dict[str, Path], case: str) -> None:
    loaded = load_causal_lm(checkpoints[case], device="cpu")
    tensors = stored(checkpoints[case])
    fmt, _, _ = CASES[case]
    for name, module in loaded.model.named_modules():
        if name.rpartition(".")[2] not in LINEARS:
            continue
        # the CPU's kernels: 4-bit codes on the int4 kernel, symmetric 8-bit codes and fp8 weights on the q8 kernel
        # (cpu_codes); act-order too, its inputs in group order (input_order)
        kind = Int4Linear if fmt in INT4 else Q8Linear
        assert isinstance(module, kind if int4_available() else torch.nn.Linear), (name, type(module))
        if isinstance(module, Q8Linear):  # (fp8 weights kept as the checkpoint's bytes)
            assert module.weight.dtype == (torch.int8 if fmt in INT8 else torch.float8_e4m3fn), name
        got = module.dequantized() if isinstance(module, (Int4Linear, Q8Linear)) else module.weight.detach()
        assert got.dtype == torch.float32 and torch.equal(got, reference(case, tensors[name])), name
    assert type(loaded.model.lm_head) is torch.nn.Linear


def engine_tokens(loaded, prompts: list[list[int]], tokens: int) -> tuple[str, list[list[int]]]:
    async def serve() -> tuple[str, list[list[int]]]:
        engine = create_engine(loaded, EngineConfig())
        engine.start()

        async def one(i: int, ids: list[int]) -> list[int]:
            await asyncio.sleep(0.01 * i)  # later requests join a running batch
            request = GenerationRequest(
                "", SamplingParams(max_new_tokens=tokens, ignore_eos_token=True), prompt_ids=ids
            )
            return [e.token.id async for e in engine.generate(request) if e.token]

        try:
            return engine.runner.path, await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.stop()

    return asyncio.run(serve())


PROMPTS = [[1, 5, 9, 17, 33], [4, 60, 2, 11], [8, 8, 30, 45, 12, 19, 50]]


def greedy(model: torch.nn.Module, ids: list[int], tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)  # type: ignore[operator]
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_decodes_what_transformers_decodes_with_the_dequantized_weights(
    checkpoints: dict[str, Path], case: str
) -> None:
    loaded = load_causal_lm(checkpoints[case], device="cpu")
    path, results = engine_tokens(loaded, PROMPTS, 12)
    assert path == "fast"
    reference_model = dequantized_float_model(checkpoints[case], case)
    for ids, got in zip(PROMPTS, results, strict=True):
        assert got == greedy(reference_model, ids, 12), ids


def test_fp8_linears_run_scaled_mm_on_the_fast_path(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Fp8Linear` (what a Hopper GPU gets) fused by the fast path: on the test device where it runs fp8
    (`fp8_scaled_mm_supported`, within bf16's rounding of transformers' forward on the same layers), else
    through torch's CPU `_scaled_mm` (the same tokens; older torch's CPU op takes per-tensor scales only). On a
    CPU the attention runs torch's bf16 ops, which round as transformers' do: the compiled kernel's fp32 sums
    over a bf16 cache move this random model's logits by bf16's rounding, which changes one sequence's tokens
    (a token 5 % of the logits' range below the best, as an fp32 forward of the same weights judges it; bf16
    `generate` itself leaves fp32's tokens on another, by 2 %), so the tokens would not show the products alone."""
    device = DEVICE if fp8_scaled_mm_supported(DEVICE) else torch.device("cpu")
    monkeypatch.setattr(cpu_kernel, "CACHE_DTYPES", (torch.float32,))
    loaded = load_causal_lm(checkpoints["float"], device=str(device), dtype="bf16")
    for name, module in list(loaded.model.named_modules()):
        if name.rpartition(".")[2] in LINEARS:
            parent, _, child = name.rpartition(".")
            weight, scale = quantize_fp8(module.weight)
            made = fp8_module(weight, scale, None, torch.bfloat16, loaded.device, keep_fp8=True)
            setattr(loaded.model.get_submodule(parent), child, made)
    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, Fp8Linear)
    x = torch.randn(3, 256, dtype=torch.bfloat16).to(device)
    layer = loaded.model.model.layers[0].mlp.up_proj
    want = x.float() @ layer.dequantized().t()
    torch.testing.assert_close(layer(x).float(), want, rtol=0.1, atol=0.1 * want.abs().max().item())
    path, results = engine_tokens(loaded, PROMPTS, 8)
    assert path == "fast"
    for ids, got in zip(PROMPTS, results, strict=True):
        if device.type == "cpu":
            assert got == greedy(loaded.model, ids, 8), ids
        else:
            assert max(greedy_gaps(loaded.model, ids, got)) <= 0.02, ids


def fp8_kept(checkpoint: Path):
    """An fp8 checkpoint loaded in fp32 on the CPU with its linears kept fp8 (`Fp8Linear`, as a GPU with fp8
    products keeps them; the loader de-quantizes them on a CPU) from the checkpoint's own tensors."""
    loaded = load_causal_lm(checkpoint, device="cpu", dtype="fp32")
    tensors = stored(checkpoint)
    for name, _ in list(loaded.model.named_modules()):
        if name.rpartition(".")[2] in LINEARS:
            parent, _, child = name.rpartition(".")
            t = tensors[name]
            made = fp8_module(t["weight"], t["weight_scale"], None, torch.float32, loaded.device, keep_fp8=True)
            setattr(loaded.model.get_submodule(parent), child, made)
    return loaded


@pytest.mark.parametrize("case", ["fp8-channel", "fp8-block-b32", "modelopt-fp8-block"])
@pytest.mark.parametrize("widened", [False, True], ids=["fp8-gpu", "no-fp8-gpu"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fp8_linears_on_the_triton_decode_kernel_decode_what_transformers_decodes_dequantized(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, graphs: bool, widened: bool, case: str
) -> None:
    """Every product of the fast path through `fp8_gemv`'s weight-only kernel, under Triton's interpreter on CPU
    tensors: as a GPU with fp8 products chooses it for decode rows where it measures faster (prompts too here,
    `MAX_ROWS` raised), and as a GPU without them (an A10G, where bf16 would not fit: the loader keeps the fp8
    weights, `fp8_gemv.weights_kept_for`) runs it at every row count, widening the bytes itself. fp32
    activations, so the engine's greedy tokens are the de-quantized float model's. Also with the decode steps in
    the decode graphs (as on a GPU; tests/conftest.py checks their steps would capture). A block-wise checkpoint
    (Qwen3's FP8 releases' format, blocks of 32 here; ModelOpt's FP8_PB_WO, blocks of 128) is kept fp8 by the loader
    where asked, on either GPU (the blocks' scales never go to ``_scaled_mm``), and runs every product on the
    kernel's block-wise scales."""
    from helpers.decode_graphs import graphs_on_the_test_device
    from lmiserve.engine import fp8_devices
    from lmiserve.engine.model import fp8_gemv

    if not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)")
    record = graphs_on_the_test_device(monkeypatch) if graphs else None
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_chosen", {})
    one, more = (
        fp8_gemv.Config(False, 1, 256, 128),
        fp8_gemv.Config(True, 16, 256, 128),
    )  # few programs: the interpreter
    if widened or case in BLOCK_FP8:
        if widened:
            monkeypatch.setattr(fp8_devices, "native", lambda device: False)
        monkeypatch.setattr(fp8_gemv, "weights_kept_for", lambda model, device, name, blocks=False: True)
        monkeypatch.setattr(fp8_gemv, "choose", lambda x, *_: one if x.shape[0] == 1 else more)
        loaded = load_causal_lm(checkpoints[case], device="cpu", dtype="fp32")
    else:
        monkeypatch.setattr(fp8_gemv, "MAX_ROWS", 64)
        monkeypatch.setattr(
            fp8_gemv, "choose", lambda x, *_: None if x.shape[0] > 64 else one if x.shape[0] == 1 else more
        )
        loaded = fp8_kept(checkpoints[case])
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert loaded.model.model.layers[0].mlp.down_proj.scales.dim() == (2 if case in BLOCK_FP8 else 1)
    ran: list[tuple[int, bool]] = []
    kernel = fp8_gemv.fp8_gemv
    monkeypatch.setattr(
        fp8_gemv,
        "fp8_gemv",
        lambda x, *rest: ran.append((x.shape[0], fp8_devices.native(x.device))) or kernel(x, *rest),
    )
    path, results = engine_tokens(loaded, PROMPTS, 8)
    assert path == "fast" and ran and max(rows for rows, _ in ran) >= len(PROMPTS[-1])  # decode rows, prompts' rows
    assert {native for _, native in ran} == {not widened}
    if record is not None:
        assert record.steps  # decode steps replayed the graphs
    reference_model = dequantized_float_model(checkpoints[case], case)
    for ids, got in zip(PROMPTS, results, strict=True):
        assert got == greedy(reference_model, ids, 8), ids


@pytest.mark.parametrize("case", ["w8a8", "w8a16-g32", "gptq-int8-g32", "gptq-int8-g64-desc-act"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_int8_codes_kept_on_the_triton_kernel_decode_what_transformers_decodes_dequantized(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, graphs: bool, case: str
) -> None:
    """compressed-tensors' 8-bit codes where a GPU keeps them (`int8_weights`: bf16 would not fit), loaded on CPU
    tensors with the loader's answer given: every linear an `Int8WeightLinear`, q/k/v and gate/up fused by the fast
    path, every product (decode rows and prompts) on `fp8_gemv`'s kernel under Triton's interpreter, also from the
    decode graphs, the output projection's too (stored quantized here); fp32 activations, so the engine's greedy
    tokens are the de-quantized float model's."""
    from lmiserve.engine.model import fp8_gemv, int8_weights
    from lmiserve.engine.model.llama_layout import fused_layers

    if not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)")
    record = graphs_on_the_test_device(monkeypatch) if graphs else None
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_chosen", {})
    one, more = fp8_gemv.Config(False, 1, 256, 128), fp8_gemv.Config(True, 16, 256, 128)  # few programs
    monkeypatch.setattr(fp8_gemv, "choose", lambda x, *_: one if x.shape[0] == 1 else more)
    monkeypatch.setattr(int8_weights, "weights_kept_for", lambda model, device, name: True)
    loaded = load_causal_lm(checkpoints[case], device="cpu", dtype="fp32")
    for name, module in loaded.model.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            assert isinstance(module, int8_weights.Int8WeightLinear), name
    # an output projection stored quantized too (untied: some releases quantize it): its scales pick its product
    q, scale = quantize_weight(loaded.model.lm_head.weight)  # symmetric int8 a channel (W8A8's), read as stored
    head = unpack_int8({"weight": q, "weight_scale": scale}, group_size=0)
    loaded.model.lm_head = int8_module(head, None, torch.float32, loaded.device, keep_codes=True)
    ran: list[tuple[int, torch.dtype]] = []
    kernel = fp8_gemv.fp8_gemv
    monkeypatch.setattr(
        fp8_gemv, "fp8_gemv", lambda x, w, *rest: ran.append((x.shape[0], w.dtype)) or kernel(x, w, *rest)
    )
    path, results = engine_tokens(loaded, PROMPTS, 8)
    assert path == "fast" and all(layer.fused for layer in fused_layers(loaded.model))
    assert min(r for r, _ in ran) <= len(PROMPTS) and max(r for r, _ in ran) >= len(PROMPTS[-1])  # decode, prompts
    assert {dtype for _, dtype in ran} == {torch.int8}
    if record is not None:
        assert record.steps  # decode steps replayed the graphs
    reference_model = dequantized_float_model(checkpoints[case], case)
    reference_model.lm_head = torch.nn.Linear(head.codes.shape[1], head.codes.shape[0], bias=False)
    reference_model.lm_head.weight = torch.nn.Parameter(head.dequantize(), requires_grad=False)
    for ids, got in zip(PROMPTS, results, strict=True):
        assert got == greedy(reference_model, ids, 8), ids


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_w8a8_rows_in_int8_decode_what_transformers_decodes_with_its_rows_quantized(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> None:
    """A W8A8 checkpoint (compressed-tensors' own, int8 activations by token) whose codes a GPU keeps: where its
    products choose `int8_w8a8`'s (every one here), every product of the decode rows and the prompts takes its rows
    in int8 (each over its own range) into torch's integer product, also from the decode graphs; the engine's greedy
    tokens are those of transformers' float model whose linears quantize their input rows so (fp32 activations)."""
    from lmiserve.engine.model import fp8_gemv, int8_w8a8, int8_weights

    if not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)")
    record = graphs_on_the_test_device(monkeypatch) if graphs else None
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "choose", lambda x, w, s, other, int8_rows=False: int8_rows and int8_w8a8.INT8_ROWS)
    monkeypatch.setattr(int8_weights, "weights_kept_for", lambda model, device, name: True)
    loaded = load_causal_lm(checkpoints["w8a8"], device="cpu", dtype="fp32")
    for name, module in loaded.model.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            assert isinstance(module, int8_weights.Int8WeightLinear) and module.scales.int8_rows, name
    ran: list[int] = []
    product = int8_w8a8.product
    monkeypatch.setattr(int8_w8a8, "product", lambda x, *rest: ran.append(x.shape[0]) or product(x, *rest))
    path, results = engine_tokens(loaded, PROMPTS, 8)
    assert path == "fast" and min(ran) <= len(PROMPTS) and max(ran) >= len(PROMPTS[-1])  # decode rows, prompts
    if record is not None:
        assert record.steps  # decode steps replayed the graphs
    reference_model = dequantized_float_model(checkpoints["w8a8"], "w8a8")
    for name, module in reference_model.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            module.register_forward_pre_hook(
                lambda m, args: (int8_w8a8.INT8_ROWS.quantized(args[0].reshape(-1, m.in_features)).view_as(args[0]),)
            )
    for ids, got in zip(PROMPTS, results, strict=True):
        assert got == greedy(reference_model, ids, 8), ids


ONE_ROW_TOKENS = 4  # (Triton's interpreter runs every product: a few decode steps show each kernel's row)


@pytest.mark.parametrize(
    ("fused", "graphs"), [(False, False), (True, False), (True, True)], ids=["eager-norms", "fused-norms", "graphs"]
)
def test_a_per_tensor_fp8_checkpoint_decodes_one_row_on_the_tensor_wise_product(
    checkpoints: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    graph_step_hazards: Any,
    fused: bool,
    graphs: bool,
) -> None:
    """A per-tensor fp8 checkpoint (compressed-tensors, AutoFP8; what ``quantize=fp8`` makes on a GPU with fp8
    products) where the GPU has fp8 products: the fast path puts each fused product's parts (q, k and v; gate and
    up), each on its own scale in the checkpoint, on one scale (`quant_formats.one_scale_for`), so every product of
    one decode row can run on `fp8_w8a8.ONE_SCALE` (cuBLAS's tensor-wise product; here torch's CPU
    ``_scaled_mm`` and Triton's interpreter), which `fp8_gemv.choose` keeps where it times fastest. Its tokens are
    those of transformers' forward over the same layers (fp32 activations; rows in fp8 there too). With the
    fused norms (`fused_norm`, as on a GPU where they measure faster), the norms write their rows in fp8 too and
    the q/k/v and gate/up products of one row take them (`fp8_w8a8.given_rows`): no quantizing kernel of their own,
    the same tokens. In the decode graphs (over the Triton attention, as on a GPU) the attention's kernel writes
    o's row in fp8 too: every product of a decode row takes its row from the kernel before it."""
    from lmiserve.engine.model import fp8_gemv, fp8_w8a8, fused_norm, kernel_choice

    if not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)")
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_chosen", {})
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: () for b in fp8_gemv.CANDIDATES})
    monkeypatch.setattr(fp8_gemv, "MAX_ROWS", 64)  # transformers' forward below: rows in fp8 too, fp32 sums

    def timer(call: object, device: torch.device) -> float:
        choice = getattr(call, "args", (None,))[0]
        return 1e-6 if choice is fp8_w8a8.ONE_SCALE else 1e-5 if choice is fp8_w8a8.W8A8 else 1e-3

    monkeypatch.setattr(kernel_choice, "time_gpu", timer)
    monkeypatch.setattr(kernel_choice, "time_call", timer)
    loaded = fp8_kept(checkpoints["fp8-tensor"])
    attention = loaded.model.model.layers[0].self_attn
    assert len({attention.q_proj.scales[0].item(), attention.k_proj.scales[0].item()}) == 2  # as stored
    ran: list[tuple[int, int]] = []
    one_scale = fp8_w8a8.product_one_scale

    uniform: dict[int, torch.Tensor] = {}  # the scales seen one value (each read once: a graph's step reads none)

    def recorded(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if id(scales) not in uniform:
            assert bool((scales == scales[0]).all())
            uniform[id(scales)] = scales
        ran.append(tuple(weight.shape))
        return one_scale(x, weight, scales)

    monkeypatch.setattr(fp8_w8a8, "product_one_scale", recorded)
    given: list[tuple[int, bool]] = []  # each product's rows in fp8: (rows, given by the norm)
    rows_in_fp8 = fp8_w8a8._rows_in_fp8

    def taken(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen = fp8_w8a8._given
        given.append((x.shape[0], seen is not None and seen[0]() is x))
        return rows_in_fp8(x)

    monkeypatch.setattr(fp8_w8a8, "_rows_in_fp8", taken)
    made = graphs_on_the_test_device(monkeypatch) if graphs else None
    if fused:
        monkeypatch.setattr(fused_norm, "wanted", lambda device: True)
        monkeypatch.setattr(fused_norm, "USE_ON_CUDA", True)  # (forced: not measured)
    prompts = [PROMPTS[0], PROMPTS[-1]]
    if made is not None and graph_step_hazards is not None:  # (on a CPU: no capture, so no warm-up before it)
        engine_tokens(loaded, prompts[:1], 3)  # a GPU's warm-up: the products chosen, the scales read once
        graph_step_hazards.clear()
        made.steps.clear()
        ran.clear()
        given.clear()
    path, results = engine_tokens(loaded, prompts[:1], ONE_ROW_TOKENS)  # one stream: decode steps of one row
    assert path == "fast"
    config = loaded.model.config
    head = config.hidden_size // config.num_attention_heads
    qkv = config.hidden_size + 2 * config.num_key_value_heads * head
    shapes = {(qkv, config.hidden_size), (2 * config.intermediate_size, config.hidden_size)}  # the fused products
    chosen = {(k[1], k[2]) for k, v in fp8_gemv.chosen().items() if k[3] == 1 and v is fp8_w8a8.ONE_SCALE}
    assert shapes <= chosen and all(ran.count(shape) > 1 for shape in shapes)  # (once: the self-check's probe)
    assert attention.q_proj.scales[0].item() == attention.k_proj.scales[0].item()  # the fused parts: one scale
    # fused: in each decode step, each layer's q/k/v and gate/up rows from the norms, down's from SiLU's
    # kernel, o's from the attention's in the graphs (else, and the probes', quantized by the product)
    steps = ONE_ROW_TOKENS - 1
    by_norm = [by_norm for rows, by_norm in given if rows == 1].count(True)
    assert by_norm == (steps * (4 if graphs else 3) * config.num_hidden_layers if fused else 0)
    assert made is None or len(made.steps) == steps
    results += engine_tokens(loaded, prompts[1:], ONE_ROW_TOKENS)[1]
    for ids, got in zip(prompts, results, strict=True):
        assert max(greedy_gaps(loaded.model, ids, got)) <= 1e-3, ids


def test_quantize_fp8_on_a_float_checkpoint_quantizes_per_channel_at_load(checkpoints: dict[str, Path]) -> None:
    loaded = load_causal_lm(checkpoints["float"], device="cpu", quantize="fp8")
    original, _ = tiny_llama()
    for name, module in original.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            q, scale = quantize_fp8(module.weight)
            kept = loaded.model.get_submodule(name)  # (a CPU's: fp8 on the q8 kernel, cpu_codes)
            assert isinstance(kept, Q8Linear if int4_available() else torch.nn.Linear), name
            got = kept.dequantized() if isinstance(kept, Q8Linear) else kept.weight
            assert torch.equal(got, q.float() * scale[:, None]), name
    assert torch.equal(loaded.model.lm_head.weight, original.lm_head.weight)  # the output projection stays float


@pytest.mark.parametrize(
    ("case", "quantize", "says"),
    [
        ("gptq-g128", "awq", "quantize=awq, but gptq-g128 is a gptq checkpoint"),
        ("awq-g128", "fp8", "quantize=fp8, but awq-g128 is a awq checkpoint"),
        ("fp8-channel", "gptq", "is a fp8 checkpoint (compressed-tensors)"),
        ("float", "awq", "quantize=awq: float is not a AWQ checkpoint"),
    ],
)
def test_a_quantize_that_is_not_the_checkpoints_is_refused_in_one_line(
    checkpoints: dict[str, Path], case: str, quantize: str, says: str
) -> None:
    with pytest.raises(ModelLoadError) as error:
        load_causal_lm(checkpoints[case], device="cpu", quantize=quantize)
    assert says in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("method", "bits"), [("gptq", 3), ("gptq", 2), ("awq", 8)])
def test_other_bit_widths_are_refused_in_one_line(method: str, bits: int) -> None:
    """GPTQ reads 4 and 8 bits (the cases above), AWQ 4: a 3-bit GPTQ or an 8-bit AWQ config stops the start."""
    from lmiserve.models.quant_config import checkpoint_spec

    with pytest.raises(ModelLoadError) as error:
        checkpoint_spec({"quant_method": method, "bits": bits, "group_size": 128})
    assert f"{method} with {bits} bits is not supported" in str(error.value) and "\n" not in str(error.value)
    assert checkpoint_spec({"quant_method": "gptq", "bits": 8, "group_size": 128}).bits == 8


def test_the_matching_quantize_is_honoured_and_int4_dtype_refused(checkpoints: dict[str, Path]) -> None:
    loaded = load_causal_lm(checkpoints["gptq-g128"], device="cpu", quantize="gptq")
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, Int4Linear if int4_available() else torch.nn.Linear)
    with pytest.raises(ModelLoadError, match="does not combine with quantize awq"):
        load_causal_lm(checkpoints["awq-g128"], device="cpu", dtype="int4")


def test_the_quantize_option_takes_fp8_awq_gptq_and_refuses_others_in_one_line() -> None:
    from lmiserve.config.errors import ConfigError
    from lmiserve.config.sources import load_settings

    assert load_settings({"quantize": "awq"}, environ={}).quantize == "awq"
    assert load_settings({}, environ={}).quantize is None
    assert load_settings(environ={"OPTION_QUANTIZE": "fp8"}).quantize == "fp8"
    with pytest.raises(ConfigError) as error:
        load_settings({"quantize": "bitsandbytes"}, environ={})
    assert "quantize" in str(error.value) and "fp8" in str(error.value)


@pytest.mark.parametrize("case", ["awq-g128", "gptq-g64-desc-act"])
def test_awq_and_gptq_on_the_triton_int4_kernel_decode_what_transformers_decodes_dequantized(
    checkpoints: dict[str, Path], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's AWQ/GPTQ layers (`int4_triton.Int4TritonLinear`, made here on CPU tensors from the checkpoint's
    parts as `quant_formats.int4_module` makes them on CUDA) under Triton's interpreter: the fast path fuses
    q/k/v and gate/up into one product each (act-order's too: they share the order of their inputs), runs
    every product on the kernel, decode rows and prompts, and the engine's greedy tokens are those of
    transformers' forward on the de-quantized float model (fp32 activations)."""
    from lmiserve.engine.model.llama_layout import fused_layers

    if not int4_triton.available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)")
    monkeypatch.setattr(int4_triton, "_chosen", {})
    wide = int4_triton.Config(False, 1, 256, 64), int4_triton.Config(True, 16, 256, 64)  # few programs: the
    monkeypatch.setattr(
        int4_triton, "CANDIDATES", {1: wide[:1], 4: wide[1:], 16: wide[1:], 64: wide[1:]}
    )  # interpreter
    loaded = load_causal_lm(checkpoints[case], device="cpu", dtype="fp32")
    tensors = stored(checkpoints[case])
    fmt, _, group = CASES[case]
    for name, _ in list(loaded.model.named_modules()):
        if name.rpartition(".")[2] in LINEARS:
            t = tensors[name]
            parts = (
                unpack_awq(t["qweight"], t["qzeros"], t["scales"], group)
                if fmt == "awq"
                else unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group)
            )
            made = int4_triton.Int4TritonLinear.from_parts(
                parts.codes, parts.scale, parts.zero, parts.g_idx, None, torch.float32, loaded.device
            )
            parent, _, child = name.rpartition(".")
            setattr(loaded.model.get_submodule(parent), child, made)
    ran: list[int] = []
    kernel = int4_triton.int4_gemm
    monkeypatch.setattr(int4_triton, "int4_gemm", lambda x, *rest: ran.append(x.shape[0]) or kernel(x, *rest))
    path, results = engine_tokens(loaded, PROMPTS, 8)
    assert path == "fast" and all(layer.fused for layer in fused_layers(loaded.model))
    assert min(ran) <= len(PROMPTS) and max(ran) >= len(PROMPTS[-1])  # decode rows and a prompt's rows
    reference_model = dequantized_float_model(checkpoints[case], case)
    for ids, got in zip(PROMPTS, results, strict=True):
        assert got == greedy(reference_model, ids, 8), ids


def test_a_dummy_load_takes_quantize_fp8(checkpoints: dict[str, Path]) -> None:
    """load_format=dummy (the GPU check's 8B shape without weights) with quantize=fp8: random weights in fp8."""
    loaded = load_causal_lm(checkpoints["float"], device="cpu", load_format="dummy", quantize="fp8")
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    weight = q_proj.dequantized() if isinstance(q_proj, Q8Linear) else q_proj.weight
    assert isinstance(q_proj, Q8Linear) or not int4_available()
    q, scale = quantize_fp8(weight)
    assert torch.equal(weight, q.float() * scale[:, None])


@pytest.mark.parametrize("quantize", ["awq", "gptq"])
def test_a_dummy_load_with_quantize_awq_or_gptq_rounds_the_random_weights_to_4_bit_codes(
    checkpoints: dict[str, Path], quantize: str
) -> None:
    """load_format=dummy with a 4-bit format (the GPU check's 4-bit bench of the 8B shape): the random
    linears rounded to 4 bits in groups of 128 and made as a checkpoint's (fp32 on CPU: `Int4Linear` where
    its kernel runs), each within half a step of the float weight it replaces; the output projection stays."""
    float_model = load_causal_lm(checkpoints["float"], device="cpu", load_format="dummy").model
    loaded = load_causal_lm(checkpoints["float"], device="cpu", load_format="dummy", quantize=quantize)
    for name, module in loaded.model.named_modules():
        if name.rpartition(".")[2] not in LINEARS:
            continue
        assert isinstance(module, Int4Linear if int4_available() else torch.nn.Linear), (name, type(module))
        got = module.dequantized() if isinstance(module, Int4Linear) else module.weight.detach()
        want = float_model.get_submodule(name).weight.detach()
        assert 0 < (got - want).abs().max().item() <= 1.01 * (want.max() - want.min()).item() / 30, name
    assert type(loaded.model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize(
    ("case", "int4_kernel"),
    [(case, False) for case in CASES]
    + [("awq-g128", True), ("gptq-g64-desc-act", True), ("w8a8", True), ("w8a16-g32", True)],
    ids=[*CASES, "awq-g128-triton", "gptq-g64-desc-act-triton", "w8a8-triton", "w8a16-g32-triton"],
)
def test_on_the_test_device_each_format_serves_in_bf16(
    checkpoints: dict[str, Path], case: str, int4_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each format in bf16 on the test device (on a CPU: every linear kept on its kernel, as in fp32, since
    2026-12-07): every linear's product is the reference de-quantized weight's within bf16's (and fp8 activations')
    rounding, and the engine's greedy tokens are transformers'
    forward's over the same layers. fp8 runs `Fp8Linear` exactly where `_scaled_mm` takes fp8 (compute
    capability 8.9+); `-triton`: AWQ/GPTQ through the Triton int4 kernel, compressed-tensors' 8-bit codes through
    `fp8_gemv`'s, on CUDA (`int4_triton.USE_ON_CUDA`, `int8_weights.USE_ON_CUDA`; on a CPU their interpreter tests
    above cover them)."""
    from lmiserve.engine.model import fp8_gemv, int8_weights

    int8 = CASES[case][0] in ("w8a8", "w8a16")
    if int4_kernel:
        if DEVICE.type != "cuda" or not int4_triton.available():
            pytest.skip("the Triton kernels serve on CUDA only")
        monkeypatch.setattr(int4_triton, "USE_ON_CUDA", True)
        monkeypatch.setattr(int8_weights, "USE_ON_CUDA", True)
        monkeypatch.setattr(int4_triton, "_chosen", {})
        monkeypatch.setattr(fp8_gemv, "_chosen", {})
    loaded = load_causal_lm(checkpoints[case], device=str(DEVICE), dtype="bf16")
    tensors = stored(checkpoints[case])
    fp8 = CASES[case][0] in PER_ROW_FP8
    generator = torch.Generator().manual_seed(5)
    for name, module in loaded.model.named_modules():
        if name.rpartition(".")[2] not in LINEARS:
            continue
        if fp8:
            assert isinstance(module, Fp8Linear) == fp8_scaled_mm_supported(DEVICE), (name, type(module))
        if int4_kernel:
            kind = int8_weights.Int8WeightLinear if int8 else int4_triton.Int4TritonLinear
            assert isinstance(module, kind), (name, type(module))
        if DEVICE.type == "cpu" and int4_available():  # kept on the CPU's kernels in bf16 too (W8A8: torch's int8)
            fmt = CASES[case][0]
            kind = Int4Linear if fmt in INT4 else Int8Linear if fmt == "w8a8" else Q8Linear
            assert isinstance(module, kind), (name, type(module))
        weight = reference(case, tensors[name])
        x = torch.randn(3, weight.shape[1], generator=generator).to(DEVICE, torch.bfloat16)
        want = x.float() @ weight.to(DEVICE).t()
        got = module(x).float()
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item(), msg=name)
    path, results = engine_tokens(loaded, PROMPTS, 8)
    assert path == "fast"
    if int4_kernel:  # every shape and row bucket measured; 4-bit: a tile passed its check, none de-quantized
        chosen = fp8_gemv.chosen() if int8 else int4_triton.chosen()
        assert chosen and (int8 or None not in chosen.values()), chosen
    for ids, got_ids in zip(PROMPTS, results, strict=True):
        gaps = greedy_gaps(loaded.model, ids, got_ids)
        assert max(gaps) <= 0.02, (ids, gaps)


def greedy_gaps(model: torch.nn.Module, ids: list[int], got: list[int]) -> list[float]:
    """For each token the engine chose, how far below the best logit transformers' forward over the same
    layers puts it (teacher-forced on the engine's own output, as a share of the step's logit range): 0 where
    the engine took transformers' greedy token, a rounding's worth where bf16 breaks a near tie otherwise."""
    device = model.get_input_embeddings().weight.device  # type: ignore[operator]
    with torch.inference_mode():
        logits = model(torch.tensor([ids + got], device=device)).logits[0, len(ids) - 1 : -1].float()  # type: ignore[operator]
    chosen = logits.gather(1, torch.tensor(got, device=device)[:, None])[:, 0]
    best = logits.max(-1).values
    return ((best - chosen) / (best - logits.min(-1).values)).tolist()


@pytest.mark.parametrize("kind", ["fp8", "int4-triton"])
def test_tensor_parallelism_refuses_a_checkpoints_fp8_or_4_bit_layers(checkpoints: dict[str, Path], kind: str) -> None:
    """A shard cuts a linear's weight rows or columns, not its scales: a model of `Fp8Linear` (an fp8
    checkpoint on Hopper) or `Int4TritonLinear` (AWQ/GPTQ on the Triton kernel) is refused in one line,
    never served with another rank's scales."""
    from lmiserve.engine.model.sharding import shard_model

    loaded = load_causal_lm(checkpoints["float"], device="cpu")
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    weight = q_proj.weight.detach()
    if kind == "fp8":
        q, scale = quantize_fp8(weight)
        made = fp8_module(q, scale, None, torch.float32, loaded.device, keep_fp8=True)
    else:
        g_idx = torch.arange(weight.shape[1]) // 128
        codes, scale, zero = rtn_int4(weight, g_idx, weight.shape[1] // 128)
        made = int4_triton.Int4TritonLinear.from_parts(
            codes, scale.float(), zero, g_idx, None, torch.float32, loaded.device
        )
    loaded.model.model.layers[0].self_attn.q_proj = made
    with pytest.raises(ValueError, match="shards float models: this one has quantized linears"):
        shard_model(loaded.model, 0, 2, None)
