"""Build a tiny random Llama model + trained byte-level BPE tokenizer, saved like a real model.

The directory is loaded by the server through the same path as real models (`load_causal_lm`).
Everything is deterministic: same corpus, same tokenizer, `torch.manual_seed(SEED)` for weights.
"""

from __future__ import annotations

from pathlib import Path

TINY_SEED = 1234
TINY_VOCAB_SIZE = 512
TINY_MAX_POSITIONS = 256
# 10x the usual 0.02: logits then have std ~1.6 (next-token entropy ~5 nats of ln(512)=6.2), so
# greedy output varies from token to token and top-1/top-2 logit gaps are large enough (median
# ~0.5) that batched and single-sequence decoding agree. No EOS bias is applied: P(EOS) is ~0.1%
# per step, so greedy decoding practically never stops at EOS within a few dozen tokens.
TINY_INIT_STD = 0.2
# Context of `with_context(..., ENDLESS_CONTEXT)` copies: asking for most of it keeps a request
# generating for many minutes, longer than any test waits.
ENDLESS_CONTEXT = 2**20

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NON_ASCII_SAMPLE = "héllo wörld — naïve café 日本語 emoji 🎉"

_ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Deep learning is a subfield of machine learning that uses neural networks.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a little model that generated text one token at a time.",
    "Hello world! How are you today? I am fine, thank you.",
    "Large language models predict the next token given the previous tokens.",
    "The server streams tokens to the client as soon as they are generated.",
    "Numbers like 1, 2, 3, 42 and 2024 appear in text too.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets new requests join a running batch between decoding steps.",
]


def training_corpus() -> list[str]:
    """Mostly English (learned merges) plus a little non-ASCII, so multi-byte characters stay split."""
    return _ENGLISH * 20 + [NON_ASCII_SAMPLE, "naïve café", "日本語のテキスト", "emoji 🎉🚀"]


def build_tiny_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_corpus(), trainer=trainer)
    bos_id = backend.token_to_id("<s>")
    # Like Llama: BOS is prepended when add_special_tokens=True (chat templates tokenize without it).
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_MAX_POSITIONS,
    )


# A reasoning model's chat template (DeepSeek-R1 / Qwen3-thinking style): the generation prompt opens the
# `<think>` block, so the output starts inside it; `enable_thinking: false` gives a closed empty block
# instead (Qwen3's switch); `reasoning_effort` becomes a system line.
THINK_START, THINK_END = "<think>", "</think>"
THINKING_CHAT_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|system|>Reasoning effort: {{ reasoning_effort }}</s>{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def build_thinking_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The tiny tokenizer with `<think>` and `</think>` as added (not special) tokens, as Qwen3 has them,
    and `THINKING_CHAT_TEMPLATE`."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([THINK_START, THINK_END])
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE
    return tokenizer


def build_thinking_model_dir(out_dir: str | Path) -> Path:
    """A tiny model (random weights) with the thinking tokenizer and chat template."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_thinking_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_model(tokenizer, kv_heads: int = 2):  # -> transformers.LlamaForCausalLM
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=False,
        initializer_range=TINY_INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.eval()


def build_tiny_model_dir(out_dir: str | Path, kv_heads: int = 2) -> Path:
    """Write model (safetensors, fp32) + tokenizer + generation config into `out_dir`. `kv_heads`: 2
    (grouped-query attention) or 4 (one per head: every linear's outputs a multiple of 64, as int4's
    fused packing needs)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, kv_heads)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# The end-of-sequence token of `build_unreachable_eos_model_dir`: one token past the model's vocabulary.
UNREACHABLE_EOS = "<|unreachable-eos|>"


def build_unreachable_eos_model_dir(tiny_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of the tiny model whose end-of-sequence token can never be generated, so an unseeded
    sampled request always makes exactly `max_new_tokens` tokens (for tests that cannot send a seed,
    such as TGI's `best_of` > 1).

    The tokenizer gets one more special token, `UNREACHABLE_EOS`, and it becomes the EOS of the tokenizer
    and of generation_config.json. Its id is the model's `vocab_size` (the logits have `vocab_size`
    entries, so no sampler can pick it); `</s>` becomes an ordinary special token. Weights, the other
    tokens and the chat template are unchanged.
    """
    import json
    import shutil

    from transformers import AutoTokenizer

    out = Path(out_dir)
    shutil.copytree(tiny_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"eos_token": UNREACHABLE_EOS})
    eos_id = tokenizer.convert_tokens_to_ids(UNREACHABLE_EOS)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    if eos_id != config["vocab_size"]:
        raise AssertionError(f"{UNREACHABLE_EOS} got id {eos_id}, expected the vocab_size {config['vocab_size']}")
    # The model config's EOS must lie inside the vocabulary (transformers warns otherwise), so it has
    # none; the generation config and the tokenizer name the unreachable one.
    for name, eos in (("config.json", None), ("generation_config.json", eos_id)):
        path = out / name
        values = json.loads(path.read_text())
        values["eos_token_id"] = eos
        path.write_text(json.dumps(values, indent=2))
    return out


def with_context(tiny_dir: str | Path, out_dir: str | Path, context: int) -> Path:
    """A copy of the tiny model with a `context`-token context (Llama's rotary positions need no new weights)."""
    import json
    import shutil

    out = Path(out_dir)
    shutil.copytree(tiny_dir, out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = context
    config_path.write_text(json.dumps(config, indent=2))
    return out
