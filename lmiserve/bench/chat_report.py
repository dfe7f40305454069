"""The report's chat scenario, peer and A/B sections (issue #15), and their lines in the table.

- `peer_comparisons`: lmiserve's tokens/s over each other server's at the same concurrency, per
  scenario (completion: LMI /invocations against the peer's /v1/completions; chat and vision: both
  over /v1/chat/completions), and the targets: concurrency 1 >= 1 x the peer, the highest concurrency
  >= 8 at >= 2 x the peer's aggregate.
- `ab_comparison`: with `--ab-option KEY=VALUE` the bench ran a second lmiserve with those options
  (B) beside the first (A): tokens/s B / A per level and the chat scenario's TTFT p50 of turns >= 3,
  A / B; with ``enable_prefix_caching=false`` that is the prefix cache's effect, target <= 0.25.
  The peers are compared with B too (``--ab-option dtype=int4``: the best dtype against llama.cpp).
- `forward_targets`: each lmiserve's lead over the bare forward of the same run, concurrency 1
  >= 1.5 x and 32 >= 1.3 x.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmiserve.bench.conversations import LATE_TURN, late_ttft_ratios
from lmiserve.bench.stats import ratio

Json = dict[str, Any]

PEER_C1_TARGET = 1.0
PEER_HIGH_TARGET = 2.0
PEER_HIGH_MIN_CONCURRENCY = 8
FORWARD_TARGETS = ((1, 1.5), (32, 1.3))  # issue #15: (concurrency, server tokens/s over the bare forward)
PREFIX_CACHE_TARGET = 0.25
PREFIX_CACHE_OFF = ("enable_prefix_caching", "false")


def _rates(levels: Sequence[Json]) -> dict[int, float | None]:
    return {lv["concurrency"]: lv.get("output_tokens_per_s") for lv in levels}


def peer_comparisons(main: Json | None, peers: Sequence[Json]) -> list[Json]:
    """Per peer and scenario: this lmiserve's (`main`: A, or the --ab-option B) tokens/s over the
    peer's at each concurrency both ran."""
    out: list[Json] = []
    if main is None:
        return out
    for peer in peers:
        for scenario, key in (("completion", "levels"), ("chat", "chat_levels"), ("vision", "vision_levels")):
            mine, theirs = _rates(main.get(key, ())), _rates(peer.get(key, ()))
            rows = [
                {
                    "concurrency": c,
                    "lmiserve_tokens_per_s": mine[c],
                    "peer_tokens_per_s": theirs[c],
                    "lmiserve_over_peer": ratio(mine[c], theirs[c]),
                }
                for c in sorted(set(mine) & set(theirs))
            ]
            if rows:
                out.append({"server": main["name"], "peer": peer["name"], "scenario": scenario, "rows": rows})
    return out


def _target(tid: str, description: str, threshold: float, value: float | None, passed: bool | None) -> Json:
    out = {"id": tid, "issue": 15, "description": description, "threshold": threshold, "value": value}
    out["passed"] = passed
    if value is None:
        out["note"] = "not measured"
    return out


def peer_targets(comparisons: Sequence[Json]) -> list[Json]:
    """The issue's targets against each peer, on the completion scenario (the chat one when alone), for
    each lmiserve compared (A, then the --ab-option B: ids of B's end in ``@<its name>``)."""
    targets = []
    servers = list(dict.fromkeys(c["server"] for c in comparisons))
    pairs = list(dict.fromkeys((c["server"], c["peer"]) for c in comparisons))
    for name, peer in pairs:
        suffix = "" if name == servers[0] else f"@{name}"
        mine = [c for c in comparisons if c["peer"] == peer and c["server"] == name]
        chosen = next((c for c in mine if c["scenario"] == "completion"), mine[0])
        rows = {r["concurrency"]: r for r in chosen["rows"]}
        c1 = rows.get(1, {}).get("lmiserve_over_peer")
        targets.append(
            _target(
                f"c1_vs_{peer}{suffix}",
                f"concurrency 1 ({chosen['scenario']}): {name} tokens/s >= {peer}'s single stream",
                PEER_C1_TARGET,
                c1,
                None if c1 is None else c1 >= PEER_C1_TARGET,
            )
        )
        high = max((c for c in rows if c >= PEER_HIGH_MIN_CONCURRENCY), default=None)
        value = rows[high]["lmiserve_over_peer"] if high is not None else None
        targets.append(
            _target(
                f"high_vs_{peer}{suffix}",
                f"concurrency {high if high is not None else '>= 8'} ({chosen['scenario']}): {name} tokens/s "
                f">= 2 x {peer}'s aggregate",
                PEER_HIGH_TARGET,
                value,
                None if value is None else value >= PEER_HIGH_TARGET,
            )
        )
    return targets


def forward_targets(servers: Sequence[Json]) -> list[Json]:
    """Issue #15's lead over the bare forward (same run, its dtype) for each lmiserve (A, then B):
    concurrency 1 >= 1.5 x and 32 >= 1.3 x; servers without the ratios (no baselines) are skipped."""
    targets = []
    for number, server in enumerate(servers):
        rows = {r["concurrency"]: r for r in server.get("ratios", ())}
        if not rows:
            continue
        suffix = "" if number == 0 else f"@{server['name']}"
        for c, threshold in FORWARD_TARGETS:
            value = rows.get(c, {}).get("server_over_forward")
            targets.append(
                _target(
                    f"c{c}_vs_forward_15{suffix}",
                    f"concurrency {c}: {server['name']} tokens/s >= {threshold} x the bare forward at batch {c}",
                    threshold,
                    value,
                    None if value is None else value >= threshold,
                )
            )
    return targets


def ab_comparison(a: Json | None, b: Json | None, options: Sequence[tuple[str, str]]) -> Json | None:
    """Server B (lmiserve with `options`) against A: tokens/s B / A, chat TTFT turns >= 3 A / B."""
    if a is None or b is None:
        return None
    throughput = []
    for scenario, key in (("completion", "levels"), ("chat", "chat_levels"), ("vision", "vision_levels")):
        rates_a, rates_b = _rates(a.get(key, ())), _rates(b.get(key, ()))
        for c in sorted(set(rates_a) & set(rates_b)):
            throughput.append(
                {
                    "scenario": scenario,
                    "concurrency": c,
                    "a_tokens_per_s": rates_a[c],
                    "b_tokens_per_s": rates_b[c],
                    "b_over_a": ratio(rates_b[c], rates_a[c]),
                }
            )
    return {
        "a": a["name"],
        "b": b["name"],
        "b_options": dict(options),
        "throughput": throughput,
        "late_turn_ttft": late_ttft_ratios(a.get("chat_levels", ()), b.get("chat_levels", ())),
    }


LORA_TARGET = 0.8  # issue #26: requests spread over 4 adapters >= 0.8x the base model's throughput
LORA_LEVELS = (8, 32)


def lora_targets(ab: Json | None, lora: Json | None) -> list[Json]:
    """Tokens/s with every request on an adapter over the base model's, at concurrency 8 and 32 (--lora)."""
    if ab is None or not lora:
        return []
    out = []
    for row in ab["throughput"]:
        if row["scenario"] != "completion" or row["concurrency"] not in LORA_LEVELS:
            continue
        value = row["b_over_a"]
        out.append(
            {
                **_target(
                    f"lora_throughput_c{row['concurrency']}",
                    f"requests over {lora['adapters']} LoRA adapters (rank {lora['rank']}, {lora['targets']}) >= "
                    f"{LORA_TARGET} x the base model's tokens/s at concurrency {row['concurrency']}",
                    LORA_TARGET,
                    value,
                    None if value is None else value >= LORA_TARGET,
                ),
                "issue": 26,
            }
        )
    return out


def prefix_cache_target(ab: Json | None) -> Json | None:
    """TTFT p50 of chat turns >= 3, cache on / off (the worst concurrency); None unless B turned it off."""
    if ab is None or str(ab["b_options"].get(PREFIX_CACHE_OFF[0], "")).lower() != PREFIX_CACHE_OFF[1]:
        return None
    values = [r["a_over_b"] for r in ab["late_turn_ttft"] if r["a_over_b"] is not None]
    value = max(values) if values else None
    return _target(
        "prefix_cache_chat_ttft",
        f"chat turns >= {LATE_TURN}: TTFT p50 with the prefix cache <= 0.25 x without (worst concurrency)",
        PREFIX_CACHE_TARGET,
        value,
        None if value is None else value <= PREFIX_CACHE_TARGET,
    )


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def chat_lines(report: Json, table: Any) -> list[str]:
    """The chat scenario's per-turn table, the peer ratios and the A/B figures (`table`: report._table)."""
    out: list[str] = []
    rows = []
    for server in report["servers"]:
        for lv in server.get("chat_levels", ()):
            for t in lv["turns"]:
                rows.append(
                    [
                        server["name"],
                        str(lv["concurrency"]),
                        str(t["turn"]),
                        str(t["requests"]),
                        _fmt(t["ttft_ms"]["p50"]),
                        _fmt(t["ttft_ms"]["p99"]),
                        _fmt(t["itl_ms"]["p50"]),
                        _fmt(t["itl_ms"]["p99"]),
                        _fmt(t["request_tokens_per_s"]),
                        _fmt(t["prompt_tokens_mean"], 0),
                        _fmt(t["cached_tokens_mean"], 0),
                        _fmt(lv["output_tokens_per_s"]),
                    ]
                )
    if rows:
        out += ["", f"chat scenario (per turn; turns >= {LATE_TURN} resend at least two earlier replies):"]
        header = ["server", "conc", "turn", "n", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
        out += table([*header, "req tok/s", "prompt tok", "cached tok", "level tok/s"], rows)
    peers = report.get("peers") or []
    if peers:
        out += ["", "lmiserve over each peer (tokens/s, same run):"]
        out += table(
            ["lmiserve", "peer", "scenario", "conc", "lmiserve tok/s", "peer tok/s", "ratio"],
            [
                [
                    p["server"],
                    p["peer"],
                    p["scenario"],
                    str(r["concurrency"]),
                    _fmt(r["lmiserve_tokens_per_s"]),
                    _fmt(r["peer_tokens_per_s"]),
                    _fmt(r["lmiserve_over_peer"], 2),
                ]
                for p in peers
                for r in p["rows"]
            ],
        )
    ab = report.get("ab")
    if ab:
        opts = ",".join(f"{k}={v}" for k, v in ab["b_options"].items())
        lora = report.get("settings", {}).get("lora")
        b_is = f"-o {opts}" if opts else "every request on an adapter" if lora else "the same options"
        out += ["", f"A/B: {ab['a']} (A) against {ab['b']} (B: {b_is}), same run:"]
        if lora:
            loads = lora.get("load") or {}
            times = ", ".join(f"{name} {v['load_ms']:.0f} ms ({v['mib']:.1f} MiB)" for name, v in loads.items())
            out.append(f"adapter load times (server log): {times or 'not found'}")
        rows = [
            [
                r["scenario"],
                str(r["concurrency"]),
                _fmt(r["a_tokens_per_s"]),
                _fmt(r["b_tokens_per_s"]),
                _fmt(r["b_over_a"], 3),
            ]
            for r in ab["throughput"]
        ]
        out += table(["scenario", "conc", "A tok/s", "B tok/s", "B / A"], rows)
        rows = [
            [str(r["concurrency"]), _fmt(r["a_ms"]), _fmt(r["b_ms"]), _fmt(r["a_over_b"], 3)]
            for r in ab["late_turn_ttft"]
        ]
        if rows:
            out += table(["conc", f"A TTFT p50 turns>={LATE_TURN}", "B", "A / B"], rows)
    return out
