"""benchmarks/gpu_check.py --rehearse: every step of the GPU check run on the CPU with tiny models of each
shape, so that a session lent a GPU for a few minutes does not lose them to a step whose script changed
under it (an option renamed, a report moved, a test file gone). The figures mean nothing here; each step
must run to its end and write what the summary reads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu-rehearsal")
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--rehearse", "--executor"]
    proc = subprocess.run(
        [*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "summary.json").read_text()), (out / "summary.md").read_text(), proc.stdout


def test_every_step_runs_to_its_end(rehearsal):
    summary, _, stdout = rehearsal
    assert summary["rehearsal"] is True
    names = [step["step"] for step in summary["steps"]]
    assert names == [
        "engine tests on cpu",
        "bench 1b",
        "bench 8b",
        "decode paths 1b",
        "engine process 1b",
        "graph prompts 1b",
        "quantized fp8 bench 8b",
        "quantized fp8_channel bench 8b",
        "quantized int4 bench 8b",
        "quantized kernels",
        "fp8 experts",
        "quantized quality",
        "overlap scheduling 1b",
        "step profile 1b",
        "step profile 8b bf16",
        "step profile 8b fp8",
        "fp8 kv",
        "lora decode paths 1b",
        "decode paths qwen3 0.6b",
        "decode paths phi3 mini",
        "decode paths gemma3 1b",
        "vlm paths smolvlm",
        "decode paths qwen3 30b a3b",
        "decode paths gpt oss 20b",
        "tensor parallel tiny",
        "tensor parallel 1b",
        "tensor parallel overlap",
        "executor cpu 1b",
    ]
    for step in summary["steps"]:
        assert step["exit"] == 0 and not step["timed_out"] and not step.get("skipped"), (step, stdout[-6000:])
    # the engine's tests that the GPU check runs on CUDA are all there and import
    counts = summary["steps"][0]["counts"]
    assert counts.get("collected", 0) > 300 and "error" not in counts and "errors" not in counts, counts


def test_the_benches_report_every_level_against_generate(rehearsal):
    summary, _, _ = rehearsal
    for shape, concurrency in (("1b", [1, 4]), ("8b", [1])):  # the 8B shape at one stream: its bandwidth share
        levels = summary[f"bench_{shape}"]["levels"]
        assert [level["concurrency"] for level in levels] == concurrency
        for level in levels:
            assert level["failed"] == 0 and level["wrong_token_counts"] == 0, level
            assert level["tokens_per_s"] > 0 and level["generate_tokens_per_s"] > 0
            assert level["server_over_generate"] is not None
            # the clients split over processes (2 in the rehearsal; 4 on the GPU), one a stream at most
            assert level["client_processes"] == min(2, level["concurrency"]) and level["client_busy"] > 0
            # the server's steps over the level, from its /metrics (with prompts: eager on a GPU)
            steps = level["engine_steps"]
            assert steps["prefill_steps"] > 0 and steps["decode_steps"] > 0 and steps["decode_step_ms"] > 0
        # Triton compiles nothing here (its interpreter): the count is read from the server's log all the same
        assert summary[f"bench_{shape}"]["compiles_after_warmup"] == 0


def test_issue_39_entries_are_filled(rehearsal):
    summary, _, _ = rehearsal
    paths = summary["decode_paths"]["paths"]
    # (their tokens drawn, not the greedy path's)
    sampled = {"graphs-sampled", "graphs-sampled-eager", "graphs-sampled-generators", "graphs-sampled-top-p"}
    assert set(paths) == {"graphs", "graphs-fused", "triton", "torch", "graphs-top-n", *sampled}
    # what a server measures at start for the fused element-wise kernels (the interpreter: slower than eager here)
    choice = summary["decode_paths"]["fused_choice"]
    assert choice["refused"] is None and set(choice["times"]) == {"1", "16", "128"} and not choice["fused"]
    for name, path in paths.items():
        if name in sampled:
            assert all(r["tokens_per_s"] > 0 for r in path.values())
            if name == "graphs-sampled-eager":  # the same draws as sampled inside the graphs
                assert {level: r["identical_to_graphs-sampled"] for level, r in path.items()} == {"1": 1, "2": 2}
        else:
            assert {level: r["identical_to_graphs"] for level, r in path.items()} == {"1": 1, "2": 2}
    # the fast forward's graphs, and transformers' forward
    for entry in ("decode_paths_qwen3", "decode_paths_phi3", "decode_paths_gemma3", "decode_paths_moe"):
        runs = summary[entry]["paths"]
        assert {path: {level: r["runner"] for level, r in levels.items()} for path, levels in runs.items()} == {
            "graphs": {"1": "fast", "2": "fast"},
            "generic": {"1": "generic", "2": "generic"},
        }
        assert {level: r["identical_to_graphs"] for level, r in runs["generic"].items()} == {"1": 1, "2": 2}
    # gpt-oss (its sinks; transformers' forward over the blocks cannot run it): the graphs against the eager forward
    runs = summary["decode_paths_gpt_oss"]["paths"]
    assert {path: {level: r["runner"] for level, r in levels.items()} for path, levels in runs.items()} == {
        "graphs": {"1": "fast", "2": "fast"},
        "eager": {"1": "fast", "2": "fast"},
    }
    assert {level: r["identical_to_graphs"] for level, r in runs["eager"].items()} == {"1": 1, "2": 2}
    # a VLM's decoder (SmolVLM-256M's shape): its image requests on the fast forward and on the VLM's, alike
    vlm = summary["vlm_paths"]
    assert [(r["path"], r["streams"]) for r in vlm["levels"]] == [("fast", 1), ("fast", 2), ("vlm", 1), ("vlm", 2)]
    assert all(r["same_tokens_as_first_path"] and r["tokens_per_s"] > 0 for r in vlm["levels"])
    assert vlm["steps"]["fast"]["fast"] > 0 and vlm["steps"]["fast"]["vlm"] == 0
    lora = summary["decode_paths_lora"]
    assert lora["lora_adapters"] == 4 and set(lora["paths"]) == {"graphs", "triton"}
    for path in lora["paths"].values():
        assert {level: r["identical_to_graphs"] for level, r in path.items()} == {"1": 1, "2": 2}
    engine_process = summary["engine_process"]["4"]
    assert engine_process["ratio"] > 0 and engine_process["engine_process"]["us_cpu_per_token_median"] > 0
    # issue 39's 128-stream ratio in the same run: each mode over static generate() at the level's batch
    assert engine_process["generate_tokens_per_s"] > 0
    assert all(engine_process[mode]["over_generate"] > 0 for mode in ("in_process", "engine_process"))
    # steps with prompt tokens in the graphs (B) against eager (A): on a CPU both eager, only the plumbing
    (prompts,) = summary["graph_prompts"]
    assert prompts["concurrency"] == 4 and prompts["b_over_a"] > 0
    assert all(prompts[s]["failed"] == 0 and prompts[s]["engine_steps"]["prefill_steps"] > 0 for s in "ab")
    assert [(r["rows"], r.get("constrained", 0)) for r in summary["overlap"]] == [(1, 0), (4, 0), (4, 1)]
    assert all(r["same_tokens"] for r in summary["overlap"])
    assert summary["overlap"][-1]["steps_ahead_share"] > 0.5  # (a grammar stream's steps planned ahead too)
    for kind in ("fp8", "fp8_channel", "int4"):
        bench = summary["quantized"][f"{kind}_bench"]
        assert bench["shape"] == "8b" and bench["failed"] == 0 and bench["over_bf16"] > 0
    kernels = summary["quantized"]["kernels"]
    assert kernels and all(r[kind]["error"] < 0.05 for r in kernels for kind in ("bf16", "fp8", "int4_triton"))
    assert all(r["int4_tile"].startswith(("sum", "dot")) for r in kernels)  # measured, as the engine would
    decode_rows = [r for r in kernels if r["rows"] <= 16]  # the weight-only fp8 kernel's rows
    assert decode_rows and all(r["fp8_gemv"]["error"] < 0.01 and r["fp8_gemv_tile"] for r in decode_rows)
    # every candidate's time, the split tiles' beside the others' (whether a split pays is the GPU's answer)
    assert all(any("split=" in t for t in r["fp8_gemv_tiles_us"]) for r in decode_rows)
    assert all(r["fp8_gemv_widened"]["error"] < 0.01 for r in decode_rows)  # (as an A100 widens the bytes)
    # the rows in fp8 for cuBLAS's tensor-wise product: fp8 activations' error, not a lost scale's
    assert all(r["fp8_w8a8"]["error"] < 0.1 for r in decode_rows)
    assert all(r["fp8_w8a8_one_scale"]["error"] < 0.1 for r in decode_rows if r["rows"] == 1)  # (two kernels)
    assert any(r["rows"] == 1 for r in decode_rows)
    # block-wise fp8 (Qwen3's FP8 releases' scales) as the engine runs it at every row count: fp32 here, exact
    assert all(r["fp8_block"]["error"] < 1e-4 for r in kernels)
    # a mixture of experts' layer kept fp8 and 4-bit (the kernels interpreted here): fp16 rows, within their rounding
    experts = summary["quantized"]["fp8_experts"]
    assert [r["tokens"] for r in experts] == [1, 4]
    kept = ("fp8_channel", "fp8_block", "int4", "mxfp4")
    assert all(r[kind]["error"] < 0.01 and r[kind]["us"] > 0 for r in experts for kind in kept)
    quality = summary["quantized"]["quality"]
    assert {"bf16", "fp8-channel", "fp8-tensor", "fp8-dynamic", "awq", "gptq"} <= set(quality)
    assert all(r["perplexity"] > 1 for r in quality.values())
    profile = summary["step_profile"]
    assert [r["rows"] for r in profile] == [1, 1, 4, 4] and all(r["ms"]["model"] > 0 for r in profile)
    # each row count's steps with a prompt joining, against its decode-only steps
    assert [r["path"] for r in profile] == ["fast", "fast, mixed 32"] * 2
    assert all(r["mixed_over_decode"] > 0 for r in profile[1::2])
    # overlap scheduling over the ranks: each step sent before the one before it is answered, the same tokens
    (overlap_tp,) = [step["report"] for step in summary["steps"] if step["step"] == "tensor parallel overlap"]
    assert [r["rows"] for r in overlap_tp] == [1, 2]
    assert all(r["same_tokens"] and r["sent_ahead_share"] > 0.5 and r["ratio"] > 0 for r in overlap_tp), overlap_tp
    kv = {r["kv_cache_dtype"]: r for r in summary["fp8_kv"]["results"]}
    assert set(kv) == {"auto", "fp8_e4m3", "fp8_e5m2"}
    assert kv["fp8_e4m3"]["pool_blocks"] == 2 * kv["auto"]["pool_blocks"]  # bf16 -> fp8 doubles the pool


def test_summary_md_renders_every_table(rehearsal):
    _, text, _ = rehearsal
    assert text.startswith("# GPU check rehearsal (CPU, tiny models: no figure means anything)")
    for heading in (
        "## 1B shape",
        "## 8B shape",
        "## Decode paths, 1B shape",
        "## Decode paths with 4 LoRA adapters",
        "## Decode paths, Qwen3-0.6B's shape",
        "## Decode paths, Phi-3-mini's shape",
        "## The engine in its own process, 1B shape",
        "## Steps with prompt tokens: eager (A) or in the decode graphs (B",
        "## Overlap scheduling, 1B shape",
        "## fp8 weights (quantize=fp8), 8B shape",
        "## Quantized products, one linear",
        "## fp8 and 4-bit experts, one layer",
        "## Quantized formats' quality",
        "## fp8 KV cache",
        "## A decode step's time, 1B shape",
    ):
        assert heading in text, heading
    assert "| client busy (processes) |" in text and " (2) |" in text  # the 4-stream level's two client processes
    assert "| over `generate()` (in, engine process) |" in text


def test_steps_chooses_what_runs_and_a_terminated_check_still_writes_its_summary(tmp_path):
    """--steps runs the steps a session still lacks (the others are recorded as not chosen); a check that
    a device call's limit terminates (SIGTERM) still leaves summary.json and summary.md with what ran."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--rehearse"]

    def steps_of(out: Path, timeout: float, *options: str) -> dict[str, dict]:
        """The steps of a check run with `options` into `out`, by name (the run must exit 0)."""
        proc = subprocess.run(
            [*command, *options, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return {step["step"]: step for step in json.loads((out / "summary.json").read_text())["steps"]}

    steps = steps_of(tmp_path / "chosen", 600, "--steps", "step-profile,step-profile-8b")
    for name in ("step profile 1b", "step profile 8b bf16", "step profile 8b fp8"):
        assert steps[name]["exit"] == 0 and not steps[name].get("skipped"), steps[name]
    summary = json.loads((tmp_path / "chosen" / "summary.json").read_text())
    assert set(summary["step_profile_8b"]) == {"bf16", "fp8"}  # (no kernels on a CPU: the GPU's time alone)
    assert "## The GPU's time a decode step by kernel, 8B shape" in (tmp_path / "chosen" / "summary.md").read_text()
    for name in ("engine tests on cpu", "bench 1b", "bench 8b", "decode paths 1b", "tensor parallel"):
        assert steps[name]["skipped"] == "not in --steps", steps[name]
    # the engine tests alone in a second device call's small budget (benchmarks/README.md's plan) take it all
    steps = steps_of(tmp_path / "tests-alone", 300, "--steps", "tests", "--budget", "120")
    assert steps["engine tests on cpu"]["exit"] == 0, steps["engine tests on cpu"]
    bad = subprocess.run([*command, "--steps", "bench,nope"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "unknown --steps bench, nope" in bad.stderr

    stopped = tmp_path / "stopped"
    check = subprocess.Popen(
        [*command, "--steps", "bench-1b", "--out", str(stopped)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert check.stdout is not None
    for line in check.stdout:  # the step has started: the check is inside it
        if "bench 1b:" in line:
            break
    check.terminate()
    check.wait(timeout=120)
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["rehearsal"] is True and "env" in summary
    assert (stopped / "summary.md").read_text().startswith("#")
    # and the bench it was running, and the server that bench started, ended with it (a process the check
    # killed last may take a moment to go on a busy machine)
    deadline = time.monotonic() + 15
    while (left := running(str(stopped))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def running(pattern: str) -> list[str]:
    """The command lines of this machine's live processes that contain `pattern` (zombies have none)."""
    found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True, check=False).stdout
    return [line for line in found.splitlines() if pattern in line]
