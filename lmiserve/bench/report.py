"""The JSON report of `lmiserve bench`: ratios to the baselines, the targets of issue #5 with
pass/fail, and the table printed to stdout. Pure data in, data out (the chart is chart.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmiserve.bench.chat_report import (
    ab_comparison,
    chat_lines,
    forward_targets,
    lora_targets,
    peer_comparisons,
    peer_targets,
    prefix_cache_target,
)
from lmiserve.bench.stats import ratio
from lmiserve.bench.structured import structured_target
from lmiserve.bench.vision_report import add_vision_ratios, vision_lines

SCHEMA = "lmiserve-bench/1"
Json = dict[str, Any]

# (id, concurrency, baseline, threshold, description) — server tokens/s / baseline tokens/s >= threshold
RATIO_TARGETS: tuple[tuple[str, int, str, float, str], ...] = (
    (
        "c32_vs_forward",
        32,
        "forward",
        0.85,
        "concurrency 32: server tokens/s >= 0.85 x the bare forward decode rate at batch 32",
    ),
    (
        "c32_vs_generate",
        32,
        "generate",
        2.0,
        "concurrency 32: server tokens/s >= 2 x static model.generate at batch 32",
    ),
    (
        "c1_vs_forward",
        1,
        "forward",
        0.9,
        "concurrency 1: server tokens/s >= 0.9 x the bare forward decode rate at batch 1",
    ),
)
ITL_TARGET = 2.0
RSS_TARGET_PCT = 5.0


def baseline_rate(baselines: Json | None, kind: str, batch_size: int) -> float | None:
    """Tokens/s of baseline `kind` ("forward": decode rate, "generate", "continuous": transformers'
    generate_batch) at `batch_size`."""
    if not baselines:
        return None
    key = "decode_tokens_per_s" if kind == "forward" else "tokens_per_s"
    for row in baselines.get(kind, ()):
        if row["batch_size"] == batch_size:
            value: float | None = row.get(key)
            return value
    return None


def ratios(levels: Sequence[Json], baselines: Json | None) -> list[Json]:
    """Per concurrency: server tokens/s over the bare forward (a), over model.generate (b) and, where it
    was measured (CUDA), over transformers' continuous batching (generate_batch)."""
    out = []
    for level in levels:
        c, rate = level["concurrency"], level["output_tokens_per_s"]
        forward, generate = baseline_rate(baselines, "forward", c), baseline_rate(baselines, "generate", c)
        row = {
            "concurrency": c,
            "server_tokens_per_s": rate,
            "forward_decode_tokens_per_s": forward,
            "generate_tokens_per_s": generate,
            "server_over_forward": ratio(rate, forward),
            "server_over_generate": ratio(rate, generate),
        }
        continuous = baseline_rate(baselines, "continuous", c)
        if continuous is not None:
            row.update(continuous_tokens_per_s=continuous, server_over_continuous=ratio(rate, continuous))
        out.append(row)
    return out


def _target(
    tid: str, description: str, threshold: float, value: float | None, passed: bool | None, **extra: Any
) -> Json:
    return {"id": tid, "description": description, "threshold": threshold, "value": value, "passed": passed, **extra}


def evaluate_targets(server: Json | None, memory: Json | None) -> list[Json]:
    """The issue's targets on the lmiserve server's figures; `passed` is None when not measured."""
    targets: list[Json] = []
    rows = {r["concurrency"]: r for r in (server or {}).get("ratios", ())}
    for tid, c, kind, threshold, description in RATIO_TARGETS:
        value = rows.get(c, {}).get(f"server_over_{kind}")
        note = {} if value is not None else {"note": f"not measured (needs concurrency {c} and the baselines)"}
        targets.append(
            _target(tid, description, threshold, value, None if value is None else value >= threshold, **note)
        )

    levels = [lv for lv in (server or {}).get("levels", ()) if lv.get("itl_p99_over_p50") is not None]
    worst = max(levels, key=lambda lv: lv["itl_p99_over_p50"], default=None)
    description = "steady load (closed loop): inter-token latency p99 <= 2 x p50 at every concurrency"
    if worst is None:
        targets.append(_target("steady_itl", description, ITL_TARGET, None, None, note="not measured"))
    else:
        value = worst["itl_p99_over_p50"]
        targets.append(
            _target(
                "steady_itl",
                description,
                ITL_TARGET,
                value,
                value <= ITL_TARGET,
                worst_concurrency=worst["concurrency"],
            )
        )

    soak = (memory or {}).get("soak")
    description = "resident memory stable within 5 % over the soak requests (issue: 1,000 requests)"
    if not soak or soak.get("drift_pct") is None:
        targets.append(
            _target(
                "rss_stable",
                description,
                RSS_TARGET_PCT,
                None,
                None,
                note="not measured (needs a server started by the bench and --soak-requests)",
            )
        )
    else:
        value = abs(soak["drift_pct"])
        targets.append(
            _target(
                "rss_stable", description, RSS_TARGET_PCT, value, value <= RSS_TARGET_PCT, requests=soak["requests"]
            )
        )

    all_levels = [
        *(server or {}).get("levels", ()),
        *(server or {}).get("constrained_levels", ()),
        *(server or {}).get("chat_levels", ()),
        *(server or {}).get("vision_levels", ()),
    ]
    wrong = sum(lv["token_count_errors"] + lv["failed_requests"] for lv in all_levels)
    targets.append(
        _target(
            "exact_tokens",
            "every request streamed exactly the forced number of tokens",
            0,
            wrong,
            wrong == 0 if all_levels else None,
        )
    )
    return targets


def build_report(
    meta: Json,
    servers: list[Json],
    baselines: Json | None,
    memory: Json | None,
    structured: Json | None = None,
    ab_options: Sequence[tuple[str, str]] = (),
    vision_baselines: Json | None = None,
) -> Json:
    """The whole report: `meta` (command, machine, versions, model, settings...) plus figures;
    `structured` (with --json-schema: the schema, compile times, mask cost) gets the lmiserve
    server's constrained/unconstrained comparison; `vision_baselines` (--scenario vision: generate() on
    the same images) the vision levels' ratios. The first `lmi` server is lmiserve (A); a server with
    `"ab": true` is the second lmiserve of --ab-option (B); the other kinds are peers."""
    for server in servers:
        server["ratios"] = ratios(server["levels"], baselines)
    add_vision_ratios(servers, vision_baselines)
    main = next((s for s in servers if s.get("kind") == "lmi" and not s.get("ab")), None)
    variant = next((s for s in servers if s.get("ab")), None)
    others = [s for s in servers if s.get("kind") != "lmi"]
    peers = peer_comparisons(main, others) + peer_comparisons(variant, others)
    ab = ab_comparison(main, variant, ab_options)
    if structured is not None:
        structured["comparison"] = (main or {}).get("constrained_over_unconstrained", [])
    targets = evaluate_targets(main, memory)
    extra = structured_target(structured)
    if extra is not None:
        targets.append(extra)
    targets += forward_targets([s for s in (main, variant) if s is not None])
    targets += peer_targets(peers)
    targets += lora_targets(ab, meta.get("settings", {}).get("lora"))
    cache = prefix_cache_target(ab)
    if cache is not None:
        targets.append(cache)
    return {
        "schema": SCHEMA,
        **meta,
        "servers": servers,
        "baselines": baselines,
        "vision_baselines": vision_baselines,
        "memory": memory,
        "structured": structured,
        "peers": peers,
        "ab": ab,
        "targets": targets,
    }


def write_json(report: Json, path: Path) -> Path:
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return path


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _machine_line(machine: Json) -> str:
    flags = " ".join(machine.get("cpu_flags") or []) or "-"

    def load(key: str) -> str:
        values = machine.get(key)
        return "/".join(f"{x:.2f}" for x in values) if values else "-"

    cpu = f"{machine.get('cpu', '?')} x{machine.get('cpu_count', '?')}"
    return (
        f"CPU: {cpu} ({flags}); load average 1/5/15 min at the start {load('load_average_start')}, "
        f"at the end {load('load_average_end')}"
    )


def format_table(report: Json) -> str:
    """The human-readable summary printed at the end of a run."""
    s = report.get("settings", {})
    out = [
        f"lmiserve bench: {report.get('model', {}).get('name', '?')} on {report.get('device', '?')} "
        f"({report.get('dtype_setting', report.get('dtype', '?'))}), "
        f"{s.get('max_new_tokens', '?')} new tokens per request",
        _machine_line(report.get("machine") or {}),
        "",
    ]
    header = [
        "server",
        "conc",
        "tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "p99/p50",
        "vs fwd",
        "vs gen",
        "tokens ok",
    ]
    rows = []
    for server in report["servers"]:
        by_c = {r["concurrency"]: r for r in server.get("ratios", ())}
        tagged = [(server["name"], lv, by_c.get(lv["concurrency"], {})) for lv in server["levels"]]
        tagged += [(server["name"] + "+schema", lv, {}) for lv in server.get("constrained_levels", ())]
        for name, lv, r in tagged:
            ok = (
                "yes"
                if lv["token_count_errors"] == 0 and lv["failed_requests"] == 0
                else (f"NO ({lv['failed_requests']} failed, {lv['token_count_errors']} wrong)")
            )
            rows.append(
                [
                    name,
                    str(lv["concurrency"]),
                    _fmt(lv["output_tokens_per_s"]),
                    _fmt(lv["ttft_ms"]["p50"]),
                    _fmt(lv["ttft_ms"]["p99"]),
                    _fmt(lv["itl_ms"]["p50"]),
                    _fmt(lv["itl_ms"]["p99"]),
                    _fmt(lv["itl_p99_over_p50"], 2),
                    _fmt(r.get("server_over_forward"), 2),
                    _fmt(r.get("server_over_generate"), 2),
                    ok,
                ]
            )
    if rows or not any(server.get("vision_levels") for server in report["servers"]):  # not a vision run alone
        out += [
            *_table(header, rows),
            "(latencies in ms; vs fwd / vs gen = server tokens/s over the bare forward "
            "decode rate / model.generate at batch = concurrency)",
        ]
    baselines = report.get("baselines")
    if baselines and baselines.get("forward"):
        out += [
            "",
            f"baselines in process ({baselines.get('device')}, {baselines.get('dtype')}, "
            f"{baselines.get('threads')} threads):",
        ]
        continuous = baselines.get("continuous") or []
        rows = [
            [
                str(f["batch_size"]),
                _fmt(f["decode_tokens_per_s"]),
                _fmt(f["total_tokens_per_s"]),
                _fmt(f["prefill_s"], 2),
                _fmt(g["tokens_per_s"]),
                *([_fmt(c["tokens_per_s"])] if c is not None else []),
            ]
            for f, g, c in zip(
                baselines["forward"], baselines["generate"], continuous or [None] * len(baselines["forward"])
            )
        ]
        header = ["batch", "forward decode tok/s", "forward incl. prefill", "prefill s", "generate tok/s"]
        out += _table([*header, "generate_batch tok/s"] if continuous else header, rows)
    memory = report.get("memory")
    if memory:
        out += [
            "",
            f"server RSS (MiB): start {_fmt(memory.get('rss_start_mib'))}, end {_fmt(memory.get('rss_end_mib'))}, "
            f"max {_fmt(memory.get('rss_max_mib'))} ({memory.get('samples')} samples)",
        ]
        soak = memory.get("soak")
        if soak:
            out.append(
                f"soak: {soak['requests']} requests x {soak['max_new_tokens']} tokens at concurrency "
                f"{soak['concurrency']}: RSS {_fmt(soak['rss_before_mib'])} -> {_fmt(soak['rss_after_mib'])} MiB "
                f"(drift {_fmt(soak['drift_pct'], 2)} %, max {_fmt(soak['rss_max_mib'])} MiB), "
                f"{soak['failed_requests']} failed, {soak['token_count_errors']} wrong token counts"
            )
    out += _structured_lines(report.get("structured"))
    out += chat_lines(report, _table)
    out += vision_lines(report, _table)
    for heading, targets in (
        ("targets (issue #5):", [t for t in report["targets"] if t.get("issue") not in (15, 26)]),
        ("targets (issue #15):", [t for t in report["targets"] if t.get("issue") == 15]),
        ("targets (issue #26, LoRA):", [t for t in report["targets"] if t.get("issue") == 26]),
    ):
        if not targets:
            continue
        out += ["", heading]
        for t in targets:
            verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["passed"]]
            note = "  (" + t["note"] + ")" if t.get("note") else ""
            out.append(f"  {verdict}  {t['description']}: {_fmt(t['value'], 3)}{note}")
    return "\n".join(out)


def _structured_lines(structured: Json | None) -> list[str]:
    """The --json-schema section: throughput with and without the schema, compile and mask figures."""
    if not structured:
        return []
    out = ["", f"structured output (JSON schema: {structured.get('source')}):"]
    rows = [
        [
            str(r["concurrency"]),
            _fmt(r["unconstrained_tokens_per_s"]),
            _fmt(r["constrained_tokens_per_s"]),
            _fmt(r["constrained_over_unconstrained"], 3),
        ]
        for r in structured.get("comparison", ())
    ]
    out += _table(["conc", "unconstrained tok/s", "JSON schema tok/s", "ratio"], rows)
    compile_figures = structured.get("compile")
    if compile_figures:
        out.append(
            f"compile: cold {_fmt(compile_figures['cold_compile_ms'], 2)} ms "
            f"(+ first mask {_fmt(compile_figures['cold_first_mask_ms'], 2)} ms), "
            f"cached {_fmt(compile_figures['cached_compile_ms'], 3)} ms; "
            f"the library's tokenizer {_fmt(compile_figures['tokenizer_build_ms'], 0)} ms once per model"
        )
    for m in structured.get("mask", ()):
        out.append(
            f"mask at batch {m['batch_size']}: {_fmt(m['step_mask_ms'], 3)} ms a step "
            f"({_fmt(m['per_row_us'])} us a row; bitmask fill {_fmt(m['fill_ms'], 3)} ms), median of {m['steps']} steps"
        )
    return out
