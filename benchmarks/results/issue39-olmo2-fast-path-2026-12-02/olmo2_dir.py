"""The model directory of the OLMo 2 1B measurement: OLMo-2-0425-1B's shape (its config's keys), made by
`gpu_check.dummy_model_dir` (a word-level tokenizer as large as the vocabulary, no weights)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import gpu_check  # noqa: E402

gpu_check.SHAPES["olmo2-1b"] = {
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "vocab_size": 100352,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}
gpu_check.dummy_model_dir("olmo2-1b", Path(sys.argv[1]))
