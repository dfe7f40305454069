"""A tiny Llama whose linears every quantized format of `models.quant_pack` can write (256 inputs: whole groups of
128 and blocks of 128; 4 heads of 64, 2 KV heads), with the tiny tokenizer's vocabulary; written as a checkpoint of a
format by `write_checkpoint`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.compressed_ints import FORMATS as COMPRESSED_INT4
from helpers.compressed_ints import write_compressed
from helpers.modelopt_checkpoints import FORMATS as MODELOPT
from helpers.modelopt_checkpoints import write_modelopt
from helpers.tiny_model import build_tiny_tokenizer
from lmiserve.models.quant_pack import write_quantized


def quantizable_llama(seed: int, bias: bool = False, intermediate: int = 512) -> LlamaForCausalLM:
    """Random weights drawn wide (peaked logits: greedy tokens do not tie); with `bias`, random biases on every
    linear (transformers' zeros would hide a bias cut wrong). `intermediate`: the MLP's size (384: 3 groups of 128,
    so a rank's half or quarter of down_proj's inputs starts inside one)."""
    config = LlamaConfig(
        vocab_size=len(build_tiny_tokenizer()),
        hidden_size=256,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=True,
        attention_bias=bias,
        mlp_bias=bias,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    if bias:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.5)
    return model


def write_checkpoint(model: torch.nn.Module, folder: Path, fmt: str, group: int = 128, act_order: bool = False) -> Path:
    """`model` in `folder` as a `fmt` checkpoint of `models.quant_pack`, compressed-tensors' 4-bit (`write_compressed`:
    ``w4a16``, ``w4a16-asym``; `group` 0: by channel), NVIDIA ModelOpt's fp8 (`write_modelopt`: ``modelopt-fp8``,
    ``modelopt-fp8-channel``, ``modelopt-fp8-block``) or ``float``, with the tiny tokenizer."""
    if fmt == "float":
        model.save_pretrained(folder)  # type: ignore[operator]
    elif fmt in COMPRESSED_INT4:
        write_compressed(model, folder, fmt, group)
    elif fmt in MODELOPT:
        write_modelopt(model, folder, fmt)
    else:
        write_quantized(model, folder, fmt, group=group, act_order=act_order)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder
