"""`benchmarks/decode_paths.py`: the options it loads the model with, and its long contexts (``--context``) with the
decode rate that leaves the prefill out."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def decode_paths() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decode_paths", ROOT / "benchmarks" / "decode_paths.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_paths_loads_the_model_with_the_options_the_server_takes(
    decode_paths: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`benchmarks/decode_paths.py -o quantize=fp8` loads the model quantized, as the server does (it measured fp32
    before 2026-12-07: the option was dropped)."""
    from lmiserve.models import compose, load

    assert compose.load_causal_lm is load.load_causal_lm  # (imported before the patch: it keeps the real loader)
    asked: dict = {}

    def loading(*args, **kwargs):
        asked.update(kwargs)
        raise LookupError("loaded")

    monkeypatch.setattr(load, "load_causal_lm", loading)
    with pytest.raises(LookupError, match="loaded"):
        decode_paths.run("some-dir", {"quantize": "fp8", "load_format": "dummy"}, "cpu", [1], 2, ["eager"])
    assert asked["quantize"] == "fp8" and asked["load_format"] == "dummy"


def test_each_prompt_opens_with_its_own_context_and_the_decode_rate_starts_after_every_first_token(
    decode_paths: ModuleType,
) -> None:
    assert decode_paths._filler(3, 0) == ""
    first, second = decode_paths._filler(0, 200), decode_paths._filler(1, 200)
    assert len(first.split()) == 202 and first != second  # "Notes 0:" and 200 words, each prompt its own
    # two prompts: the second's first token at 0.5 s; after it 5 tokens in 2.5 s
    assert decode_paths._decode_rate([[0.0, 1.0, 2.0, 3.0], [0.5, 1.5, 2.5]]) == 2.0
    assert decode_paths._decode_rate([[0.0, 1.0], []]) is None  # a prompt without a token: no rate
    assert decode_paths._decode_rate([[1.0]]) is None


def test_a_run_with_long_contexts_reports_both_rates(decode_paths: ModuleType, tmp_path: Path) -> None:
    report_file = tmp_path / "report.json"
    argv = ["--device", "cpu", "--paths", "eager", "--concurrency", "2", "--max-new-tokens", "6", "--context", "40"]
    assert decode_paths.main([*argv, "--json", str(report_file)]) == 0
    level = json.loads(report_file.read_text())["paths"]["eager"]["2"]
    assert level["tokens_per_s"] > 0 and level["decode_tokens_per_s"] > 0
    assert level["identical_to_eager"] == 2
