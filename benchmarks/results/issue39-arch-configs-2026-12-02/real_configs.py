"""Published configs' quirks through lmiserve's own forward (issue #39, 2026-12-02): Phi-4-mini's (a legacy
``rope_scaling`` of type longrope, 3/4 of each head rotated, tied embeddings), EXAONE 4 32B's (windows on three
layers of four, no RoPE on the fourth, llama3 RoPE scaling), GLM-4-0414's (half of each head rotated by pairs,
q/k/v biases) and Gemma 3 1B's (its legacy RoPE keys and window pattern), at tiny sizes with random weights:
whether the fast forward takes each (`unsupported_reason` None), and its logits against transformers'. Phi-4-mini
at its 131,072-token context takes the long factors (the difference on a short sequence is expected: transformers
takes the short ones there); at 4,096 the short ones; and past 4,096 positions both take the long ones.

    .venv/bin/python benchmarks/results/issue39-arch-configs-2026-12-02/real_configs.py
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs, unsupported_reason

cfgs = {
    "phi4-mini": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        sliding_window=262144,
        pad_token_id=3,
        rope_scaling={
            "type": "longrope",
            "long_factor": [1.0 + i for i in range(12)],
            "short_factor": [1.0 + 0.01 * i for i in range(12)],
        },
    ),
    "exaone4-32b": dict(
        model_type="exaone4",
        architectures=["Exaone4ForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=131072,
        sliding_window=8,
        sliding_window_pattern=4,
        rope_theta=1000000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 16.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "glm4-0414": dict(
        model_type="glm4",
        architectures=["Glm4ForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=32768,
        partial_rotary_factor=0.5,
        attention_bias=True,
        rope_theta=10000.0,
        pad_token_id=3,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=32768,
        sliding_window=8,
        sliding_window_pattern=6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        query_pre_attn_scalar=32,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        pad_token_id=0,
    ),
}
with torch.inference_mode():
    for name, c in cfgs.items():
        config = AutoConfig.for_model(**c)
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(config).eval()
        r = unsupported_reason(m)
        seq = list(range(5, 30))
        ref = m(torch.tensor([seq])).logits[0]
        ctx = config.max_position_embeddings
        f = FastLlama(m, paged_cache(m, 16, 4), ctx)
        out = f.forward(StepInputs(chunks=[(list(range(8)), 0, seq)], keep=list(range(len(seq)))))
        print(
            name,
            r,
            getattr(config, "layer_types", None),
            f.rope.rotary_dim,
            f.rope._long_past,
            f.rope_layers,
            float((out - ref).abs().max()),
        )
with torch.inference_mode():
    c = cfgs["phi4-mini"]
    config = AutoConfig.for_model(**c)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config).eval()
    seq = list(range(5, 30))
    ref = m(torch.tensor([seq])).logits[0]
    f = FastLlama(m, paged_cache(m, 16, 4), 4096)
    out = f.forward(StepInputs(chunks=[(list(range(8)), 0, seq)], keep=list(range(len(seq)))))
    print("phi4-mini at 4096", f.rope._long_past, float((out - ref).abs().max()))
    seq = [5 + (i * 7) % 500 for i in range(4100)]
    ref = m(torch.tensor([seq])).logits[0, -3:]
    f = FastLlama(m, paged_cache(m, 1030, 4), 131072)
    out = f.forward(StepInputs(chunks=[(list(range(1026)), 0, seq)], keep=[4097, 4098, 4099]))
    print("phi4-mini past 4096", f.rope._long_past, float((out - ref).abs().max()))
