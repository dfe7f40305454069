"""Tiny GGUF files with quantized weights of every type gguf_codes reads, and their conversion.

`write_gguf` makes a one-layer llama, qwen2, qwen3 or gemma3 file (the same linears in each; qwen3's
and gemma3's per-head q/k norms and gemma3's extra norms besides); `transformers_weights` is what
transformers' GGUF loader reads from it (the reference the codes are checked against);
`write_converted_dir` lays it out as `bundled.convert_gguf` would (config, fp32 safetensors, a
tokenizer, the source record) without needing a tokenizer in the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

FP16_FIELDS = {  # byte offsets of every block's fp16 fields (d, and m or dmin)
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 256, 512, 64, 4, 2
LAYER_TYPES = {  # one layer using every type; Q4_K_M files mix Q4_K, Q6_K (and Q5_0, Q8_0 for odd shapes)
    "attn_q": ("Q4_K", HIDDEN, HIDDEN),
    "attn_k": ("Q4_1", KV_HEADS * HIDDEN // HEADS, HIDDEN),
    "attn_v": ("Q6_K", KV_HEADS * HIDDEN // HEADS, HIDDEN),
    "attn_output": ("Q5_0", HIDDEN, HIDDEN),
    "ffn_gate": ("Q4_0", FFN, HIDDEN),
    "ffn_up": ("Q5_K", FFN, HIDDEN),
    "ffn_down": ("Q5_1", HIDDEN, FFN),
}
# qwen3's head width is transformers' Qwen3Config default (its GGUF loader does not read key_length): 2
# heads of 128 (1 kv head) give the same q/k/v shapes as the others' 4 heads of 64 (2 kv heads)
QWEN3_HEADS, QWEN3_KV_HEADS, QWEN3_HEAD_DIM = 2, 1, 128
GEMMA3_SLIDING_WINDOW = 32


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random raw blocks uint8 [rows, bytes per row]: random bytes, finite random fp16 fields."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        values = (rng.standard_normal((rows, cols // block, 1)) * 0.01).astype(np.float16)
        blocks[..., offset : offset + 2] = values.view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, arch: str, *, output: str | None = None, extra: bool = False) -> Path:
    """A one-layer model of `arch` with quantized weights of every type (`output`: the type of an untied
    output.weight; None: tied to the Q8_0 token_embd). `extra`: also string, nested and numeric arrays
    (a tokenizer's kind of keys) and an alignment of 64. qwen3 and gemma3 files also get their per-head
    attn_q_norm / attn_k_norm and head width (key_length, value_length); gemma3's also its
    post_attention_norm / post_ffw_norm and sliding window (llama and qwen2 files: none of these)."""
    heads, kv_heads = (QWEN3_HEADS, QWEN3_KV_HEADS) if arch == "qwen3" else (HEADS, KV_HEADS)
    head_dim = HIDDEN // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(GEMMA3_SLIDING_WINDOW)
        writer.add_rope_freq_base(1_000_000.0)
    writer.add_vocab_size(VOCAB)
    if extra:
        writer.add_custom_alignment(64)
        writer.add_array("test.strings", [f"token {i} é" for i in range(300)] + [""])
        writer.add_array("test.floats", [0.5, 1.5, -2.0])
        writer.add_array("test.nested", [[1, 2], [3]])
        writer.add_string("test.string", "naïve")
        writer.add_bool("test.bool", True)
        writer.add_float64("test.f64", 1.25)
        writer.add_int64("test.i64", -7)
    writer.add_tensor(
        "token_embd.weight", random_blocks("Q8_0", VOCAB, HIDDEN, seed=1), raw_dtype=GGMLQuantizationType.Q8_0
    )
    for seed, (name, (qtype, rows, cols)) in enumerate(LAYER_TYPES.items(), start=2):
        blocks = random_blocks(qtype, rows, cols, seed=seed)
        writer.add_tensor(f"blk.0.{name}.weight", blocks, raw_dtype=GGMLQuantizationType[qtype])
    for norm in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(norm, np.ones(HIDDEN, dtype=np.float32))
    if arch in ("qwen3", "gemma3"):
        for norm in ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"):
            writer.add_tensor(norm, np.ones(head_dim, dtype=np.float32))
    if arch == "gemma3":
        for norm in ("blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"):
            writer.add_tensor(norm, np.ones(HIDDEN, dtype=np.float32))
    if output is not None:
        writer.add_tensor(
            "output.weight", random_blocks(output, VOCAB, HIDDEN, seed=9), raw_dtype=GGMLQuantizationType[output]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_model(path: Path, *, empty: bool = True):  # -> transformers.PreTrainedModel
    """The architecture transformers' GGUF loader makes of `path`'s config (on the meta device if `empty`)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.for_model(**load_gguf_checkpoint(path)["config"])
    if not empty:
        return AutoModelForCausalLM.from_config(config)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def transformers_weights(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights transformers' GGUF loader reads from `path` (renamed, llama's q/k un-permuted,
    gemma3's norms less 1)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=transformers_model(path))["tensors"]


def write_converted_dir(gguf_path: Path, out_dir: Path, seed: int = 0) -> Path:
    """`gguf_path` as `bundled.convert_gguf` leaves it: the model in fp32 safetensors (tensors the file
    lacks, such as qwen2's attention biases, random), a (tiny, unrelated) tokenizer, the source record."""
    from helpers.tiny_model import build_tiny_tokenizer
    from lmiserve.models import bundled

    torch.manual_seed(seed)
    model = transformers_model(gguf_path, empty=False)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.data.normal_(0, 0.1)
    model.load_state_dict(transformers_weights(gguf_path), strict=False)
    model.save_pretrained(out_dir)
    build_tiny_tokenizer().save_pretrained(out_dir)
    record = {"gguf_path": str(gguf_path), "gguf_cache_key": bundled.gguf_cache_key(gguf_path)}
    (out_dir / bundled.GGUF_SOURCE_FILE).write_text(json.dumps(record))
    return out_dir
