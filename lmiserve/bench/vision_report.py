"""The report's vision scenario (`lmiserve bench --scenario vision`): each server's ``vision_levels``
(the completion scenario's figures per concurrency, plus the prompt tokens the server reported) get
``vision_ratios``, the server's tokens/s over `model.generate` on the same images at batch =
concurrency (`baselines_vision.py`, the report's ``vision_baselines``), and their lines in the table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmiserve.bench.stats import ratio

Json = dict[str, Any]


def vision_ratios(levels: Sequence[Json], baselines: Json | None) -> list[Json]:
    """Per concurrency: server tokens/s over `model.generate` at batch = concurrency (None unmeasured)."""
    rows = {r["batch_size"]: r for r in (baselines or {}).get("generate", ())}
    out = []
    for level in levels:
        c, rate = level["concurrency"], level["output_tokens_per_s"]
        generate = rows.get(c, {})
        out.append(
            {
                "concurrency": c,
                "server_tokens_per_s": rate,
                "generate_tokens_per_s": generate.get("tokens_per_s"),
                "generate_batched": generate.get("batched"),
                "server_over_generate": ratio(rate, generate.get("tokens_per_s")),
            }
        )
    return out


def add_vision_ratios(servers: Sequence[Json], baselines: Json | None) -> None:
    """Give every server that ran the vision scenario its ``vision_ratios``."""
    for server in servers:
        if "vision_levels" in server:
            server["vision_ratios"] = vision_ratios(server["vision_levels"], baselines)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def vision_lines(report: Json, table: Any) -> list[str]:
    """The vision scenario's table and its baseline (`table`: report._table)."""
    rows = []
    for server in report["servers"]:
        by_c = {r["concurrency"]: r for r in server.get("vision_ratios", ())}
        for lv in server.get("vision_levels", ()):
            ok = lv["token_count_errors"] == 0 and lv["failed_requests"] == 0
            rows.append(
                [
                    server["name"],
                    str(lv["concurrency"]),
                    _fmt(lv["output_tokens_per_s"]),
                    _fmt(lv["ttft_ms"]["p50"]),
                    _fmt(lv["ttft_ms"]["p99"]),
                    _fmt(lv["itl_ms"]["p50"]),
                    _fmt(lv["itl_ms"]["p99"]),
                    _fmt(lv.get("prompt_tokens_mean"), 0),
                    _fmt(by_c.get(lv["concurrency"], {}).get("generate_tokens_per_s")),
                    _fmt(by_c.get(lv["concurrency"], {}).get("server_over_generate"), 2),
                    "yes" if ok else f"NO ({lv['failed_requests']} failed, {lv['token_count_errors']} wrong)",
                ]
            )
    if not rows:
        return []
    baselines = report.get("vision_baselines") or {}
    width, height = baselines.get("image_size") or (report.get("settings") or {}).get("vision_image_size") or ("?", "?")
    out = ["", f"vision scenario (one {width}x{height} PNG a request over /v1/chat/completions):"]
    header = ["server", "conc", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "prompt tok", "gen tok/s"]
    out += table([*header, "vs gen", "tokens ok"], rows)
    generate = baselines.get("generate") or []
    if generate:
        out.append(
            f"generate() with pixel inputs, in process ({baselines.get('device')}, {baselines.get('dtype')}, "
            f"{baselines.get('threads')} threads):"
        )
        for g in generate:
            how = "one batch" if g["batched"] else g.get("note", "one by one")
            out.append(
                f"  batch {g['batch_size']}: {_fmt(g['tokens_per_s'])} tok/s ({how}; prompt "
                f"{_fmt(g['prompt_tokens_mean'], 0)} tokens, processor {_fmt(g['preprocess_s'], 3)} s)"
            )
    return out
