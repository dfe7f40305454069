"""`lmiserve bench` report on synthetic figures: ratios to the baselines, the issue's targets with
pass/fail, the JSON written, the printed table and the PNG chart."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from lmiserve.bench.chart import draw_chart
from lmiserve.bench.report import SCHEMA, build_report, format_table, ratios, write_json


def level(c, tok_s, itl_p50=50.0, itl_p99=80.0, failed=0, wrong=0):
    return {
        "concurrency": c,
        "requests": 3 * c,
        "measured_requests": 2 * c,
        "failed_requests": failed,
        "errors": [],
        "token_count_errors": wrong,
        "token_count_examples": [],
        "tokens_expected": 3 * c * 128,
        "tokens_received": 3 * c * 128,
        "steady_window": True,
        "window_s": 10.0,
        "window_tokens": int(tok_s * 10),
        "elapsed_s": 20.0,
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"p50": 100.0 * c, "p99": 150.0 * c, "mean": 110.0 * c, "max": 160.0 * c, "count": 2 * c},
        "itl_ms": {"p50": itl_p50, "p99": itl_p99, "mean": itl_p50, "max": itl_p99, "count": 200 * c},
        "itl_p99_over_p50": round(itl_p99 / itl_p50, 3),
    }


BASELINES = {
    "device": "cpu",
    "dtype": "float32",
    "threads": 2,
    "model_path": "/m",
    "forward": [
        {
            "batch_size": b,
            "tokens": b * 128,
            "prefill_s": 0.1,
            "decode_s": 1.0,
            "decode_tokens_per_s": r,
            "total_tokens_per_s": r * 0.9,
        }
        for b, r in ((1, 20.0), (8, 100.0), (32, 200.0))
    ],
    "generate": [
        {"batch_size": b, "tokens": b * 128, "seconds": 1.0, "tokens_per_s": r}
        for b, r in ((1, 15.0), (8, 60.0), (32, 90.0))
    ],
}
META = {
    "command": "lmiserve bench",
    "device": "cpu",
    "dtype": "float32",
    "model": {"name": "M"},
    "settings": {"max_new_tokens": 128},
    "machine": {"cpu_count": 2},
    "versions": {"torch": "x"},
}


def make_report(levels, baselines=BASELINES, memory=None, compare=()):
    servers = [{"name": "lmiserve", "url": "http://a", "kind": "lmi", "started_by_bench": True, "levels": levels}]
    servers += [
        {"name": name, "url": "http://b", "kind": "openai", "started_by_bench": False, "levels": lv}
        for name, lv in compare
    ]
    return build_report(dict(META), servers, baselines, memory)


def targets_by_id(report):
    return {t["id"]: t for t in report["targets"]}


def test_ratios_divide_server_rate_by_baselines_at_equal_batch():
    rows = ratios([level(1, 19.0), level(8, 120.0), level(32, 180.0), level(64, 1.0)], BASELINES)
    assert [r["server_over_forward"] for r in rows] == [0.95, 1.2, 0.9, None]
    assert [r["server_over_generate"] for r in rows] == [1.267, 2.0, 2.0, None]
    assert rows[2]["forward_decode_tokens_per_s"] == 200.0 and rows[2]["generate_tokens_per_s"] == 90.0
    assert ratios([level(1, 19.0)], None)[0]["server_over_forward"] is None


def test_transformers_continuous_batching_baseline_gets_its_ratio_and_column():
    """On CUDA the baselines carry `continuous` (transformers' generate_batch): a ratio and a table column."""
    continuous = [
        {"batch_size": b, "tokens": b * 128, "seconds": 1.0, "tokens_per_s": r}
        for b, r in ((1, 10.0), (8, 40.0), (32, 60.0))
    ]
    baselines = {**BASELINES, "continuous": continuous}
    rows = ratios([level(1, 19.0), level(32, 180.0)], baselines)
    assert [r["server_over_continuous"] for r in rows] == [1.9, 3.0]
    assert rows[1]["continuous_tokens_per_s"] == 60.0
    assert "server_over_continuous" not in ratios([level(1, 19.0)], BASELINES)[0]  # CPU runs: no such baseline
    table = format_table(make_report([level(1, 19.0), level(32, 180.0)], baselines))
    assert "generate_batch tok/s" in table
    assert "generate_batch" not in format_table(make_report([level(1, 19.0)]))


def test_targets_pass():
    memory = {"rss_start_mib": 500.0, "soak": {"requests": 1000, "drift_pct": -3.0}}
    t = targets_by_id(make_report([level(1, 19.0), level(8, 120.0), level(32, 180.0)], memory=memory))
    assert t["c32_vs_forward"]["value"] == 0.9 and t["c32_vs_forward"]["passed"] is True
    assert t["c32_vs_generate"]["value"] == 2.0 and t["c32_vs_generate"]["passed"] is True
    assert t["c1_vs_forward"]["value"] == 0.95 and t["c1_vs_forward"]["passed"] is True
    assert t["steady_itl"]["value"] == 1.6 and t["steady_itl"]["passed"] is True
    assert t["rss_stable"]["value"] == 3.0 and t["rss_stable"]["passed"] is True
    assert t["exact_tokens"]["passed"] is True


def test_targets_fail():
    levels = [level(1, 17.0), level(32, 160.0, itl_p50=40.0, itl_p99=90.0, wrong=2)]
    memory = {"soak": {"requests": 1000, "drift_pct": 7.5}}
    t = targets_by_id(make_report(levels, memory=memory))
    assert t["c32_vs_forward"]["passed"] is False and t["c32_vs_forward"]["threshold"] == 0.85
    assert t["c32_vs_generate"]["value"] == 1.778 and t["c32_vs_generate"]["passed"] is False
    assert t["c1_vs_forward"]["value"] == 0.85 and t["c1_vs_forward"]["passed"] is False
    assert t["steady_itl"]["value"] == 2.25 and t["steady_itl"]["worst_concurrency"] == 32
    assert t["steady_itl"]["passed"] is False
    assert t["rss_stable"]["passed"] is False
    assert t["exact_tokens"]["value"] == 2 and t["exact_tokens"]["passed"] is False


def test_targets_not_measured_are_none_with_a_note():
    t = targets_by_id(make_report([level(1, 19.0), level(2, 30.0)], baselines=None))
    for tid in ("c32_vs_forward", "c32_vs_generate", "c1_vs_forward", "rss_stable"):
        assert t[tid]["passed"] is None and t[tid]["value"] is None and t[tid]["note"], tid
    assert t["steady_itl"]["passed"] is True  # measured without baselines


def test_compare_servers_get_ratios_but_targets_follow_lmiserve():
    report = make_report([level(1, 19.0)], compare=[("vllm", [level(1, 10.0)])])
    assert report["servers"][1]["ratios"][0]["server_over_forward"] == 0.5
    assert targets_by_id(report)["c1_vs_forward"]["value"] == 0.95


def test_json_schema_round_trips(tmp_path):
    report = make_report(
        [level(1, 19.0), level(8, 120.0), level(32, 180.0)],
        memory={"samples": 3, "rss_start_mib": 1.0, "rss_end_mib": 1.0, "rss_max_mib": 1.0, "soak": None},
    )
    path = write_json(report, tmp_path / "bench.json")
    loaded = json.loads(path.read_text())
    assert loaded == report
    assert loaded["schema"] == SCHEMA
    for key in (
        "command",
        "machine",
        "versions",
        "device",
        "dtype",
        "model",
        "settings",
        "servers",
        "baselines",
        "memory",
        "targets",
    ):
        assert key in loaded, key
    server = loaded["servers"][0]
    assert set(server) >= {"name", "url", "kind", "levels", "ratios"}
    assert all({"id", "description", "threshold", "value", "passed"} <= set(t) for t in loaded["targets"])


def test_table_shows_levels_baselines_memory_and_verdicts():
    memory = {
        "samples": 10,
        "rss_start_mib": 500.0,
        "rss_end_mib": 510.0,
        "rss_max_mib": 520.0,
        "soak": {
            "requests": 1000,
            "concurrency": 32,
            "max_new_tokens": 16,
            "rss_before_mib": 505.0,
            "rss_after_mib": 510.0,
            "rss_max_mib": 520.0,
            "drift_pct": 0.99,
            "failed_requests": 0,
            "token_count_errors": 0,
        },
    }
    text = format_table(make_report([level(1, 19.0), level(32, 160.0, failed=1)], memory=memory))
    lines = text.splitlines()
    row1 = next(line for line in lines if line.startswith("lmiserve") and line.split()[1] == "1")
    assert row1.split() == ["lmiserve", "1", "19.0", "100.0", "150.0", "50.0", "80.0", "1.60", "0.95", "1.27", "yes"]
    assert any(line.startswith("lmiserve") and "NO (1 failed, 0 wrong)" in line for line in lines)
    assert "forward decode tok/s" in text and "200.0" in text
    assert "start 500.0, end 510.0, max 520.0" in text and "drift 0.99 %" in text
    assert "PASS  concurrency 1" in text and "FAIL  concurrency 32" in text


@pytest.mark.parametrize("with_baselines", [True, False])
def test_chart_is_a_png_of_the_expected_size(tmp_path, with_baselines):
    report = make_report(
        [level(1, 19.0), level(8, 120.0), level(32, 180.0)],
        baselines=BASELINES if with_baselines else None,
        compare=[("other", [level(1, 10.0), level(8, 50.0)])],
    )
    path = draw_chart(report, tmp_path / "bench.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    image = imread(path)
    assert image.shape[0] == 520 and image.shape[1] == 1600
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_table_names_the_cpu_its_kernel_flags_the_load_and_the_dtype_asked():
    report = make_report([level(1, 19.0)])
    report["machine"] = {
        "cpu": "Intel(R) Xeon(R) Processor",
        "cpu_count": 2,
        "cpu_flags": ["avx2", "avx512f", "avx512_bf16"],
        "load_average_start": [3.0, 2.0, 1.0],
        "load_average_end": [0.5, 1.25, 2.0],
    }
    report["dtype_setting"] = "int8"
    lines = format_table(report).splitlines()
    assert "(int8)" in lines[0]
    assert lines[1] == (
        "CPU: Intel(R) Xeon(R) Processor x2 (avx2 avx512f avx512_bf16); "
        "load average 1/5/15 min at the start 3.00/2.00/1.00, at the end 0.50/1.25/2.00"
    )
