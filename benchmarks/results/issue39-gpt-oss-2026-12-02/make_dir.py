"""A model directory of gpt-oss-20b's layer shape (`benchmarks/gpu_check.py`'s `gpt-oss-20b`: hidden 2880, 64 heads
of 64, 8 KV heads, experts of 2880 with 4 a token, sinks, a 128-token window on every other layer, YaRN RoPE) cut to
4 layers, 8 experts and a 32,000-word vocabulary so that it fits this machine in fp32: config, generation config and
tokenizer, no weights (`load_format=dummy`).

    python benchmarks/results/issue39-gpt-oss-2026-12-02/make_dir.py OUT_DIR
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
import gpu_check  # noqa: E402

cut = {"num_hidden_layers": 4, "num_local_experts": 8, "vocab_size": 32000, "layer_types": ["sliding_attention", "full_attention"] * 2}
gpu_check.SHAPES["gpt-oss-cut"] = {**gpu_check.SHAPES["gpt-oss-20b"], **cut}
gpu_check.dummy_model_dir("gpt-oss-cut", Path(sys.argv[1]))
(HERE / "config.json").write_text(json.dumps(gpu_check.SHAPES["gpt-oss-cut"], indent=1))
