"""benchmarks/gpu_check.py, the parts that need no GPU: the dummy model directory it benches and the
summary it writes (the run itself is in benchmarks/README.md, "The GPU check")."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_dummy_directory_has_the_shape_and_a_tokenizer_as_large_as_its_vocabulary(gpu_check, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from lmiserve.bench.prompts import PROMPTS

    out = gpu_check.dummy_model_dir("1b", tmp_path / "m")
    config = AutoConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (2048, 16, 8)
    assert not list(out.glob("*.safetensors"))  # no weights: load_format=dummy draws them
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == config.vocab_size == 128256  # every id the model can sample decodes
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert tokenizer.unk_token_id not in ids and len(ids) == len(PROMPTS[0].replace(".", " .").split())
    assert tokenizer.decode([128255]).startswith("w")  # the last id is a filler word, not nothing


def test_summary_of_the_recorded_h200_run_renders(gpu_check):
    summary = json.loads((ROOT / "benchmarks/results/gpu-check-2026-11-26-h200/summary.json").read_text())
    text = gpu_check.markdown(summary)
    assert "NVIDIA H200" in text and "## 1B shape" in text and "## 8B shape" in text
    assert "| 128 | 2720.5 |" in text
