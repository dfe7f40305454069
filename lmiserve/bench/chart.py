"""The PNG chart of `lmiserve bench`: throughput, time to first token and inter-token latency
against concurrency, for every server and the in-process baselines (matplotlib, Agg, no pyplot)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Json = dict[str, Any]


def _series(levels: list[Json], get: Callable[[Json], Any]) -> tuple[list[int], list[float]]:
    values = [(lv["concurrency"], get(lv)) for lv in levels]
    points = [(c, v) for c, v in values if v is not None]
    return [c for c, _ in points], [v for _, v in points]


def _stat(key: str, stat: str) -> Callable[[Json], Any]:
    """Reads `level[key][stat]` (e.g. the p50 of ttft_ms)."""
    return lambda level: level[key][stat]


def _axis(ax: Any, title: str, ylabel: str, concurrencies: list[int]) -> None:  # ax: a matplotlib Axes
    ax.set_title(title)
    ax.set_xlabel("concurrency (clients) / batch size")
    ax.set_ylabel(ylabel)
    if concurrencies:
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies)
        ax.set_xticklabels([str(c) for c in concurrencies])
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)


def _levels(server: Json) -> list[Json]:
    """The completion levels, or the vision scenario's when it ran alone."""
    levels: list[Json] = server["levels"] or server.get("vision_levels") or []
    return levels


def draw_chart(report: Json, path: Path) -> Path:
    """Write the chart of `report` to `path` (PNG) and return the path."""
    fig = Figure(figsize=(16, 5.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    throughput, ttft, itl = fig.subplots(1, 3)
    concurrencies = sorted({lv["concurrency"] for s in report["servers"] for lv in _levels(s)})
    colors = ["tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]

    for i, server in enumerate(report["servers"]):
        color = colors[i % len(colors)]
        levels = _levels(server)
        x, y = _series(levels, lambda lv: lv["output_tokens_per_s"])
        throughput.plot(x, y, "o-", color=color, label=server["name"])
        for ax, key in ((ttft, "ttft_ms"), (itl, "itl_ms")):
            x, y = _series(levels, _stat(key, "p50"))
            ax.plot(x, y, "o-", color=color, label=f"{server['name']} p50")
            x, y = _series(levels, _stat(key, "p99"))
            ax.plot(x, y, "s--", color=color, label=f"{server['name']} p99")

    baselines = report.get("baselines") or {}
    vision = {} if baselines.get("generate") else report.get("vision_baselines") or {}
    for kind, key, label, style in (
        ("forward", "decode_tokens_per_s", "bare forward (decode, in process)", "^:"),
        ("generate", "tokens_per_s", "model.generate static batch" + (" (images)" if vision else ""), "v:"),
    ):
        rows = baselines.get(kind) or vision.get(kind) or []
        points = [(r["batch_size"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            throughput.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                color="tab:green" if kind == "forward" else "tab:red",
                label=label,
            )

    model = report.get("model", {}).get("name", "?")
    n = report.get("settings", {}).get("max_new_tokens", "?")
    _axis(throughput, "output throughput", "tokens/s", concurrencies)
    _axis(ttft, "time to first token", "ms", concurrencies)
    _axis(itl, "inter-token latency", "ms", concurrencies)
    for ax in (throughput, ttft, itl):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(
        f"lmiserve bench: {model} on {report.get('device', '?')} ({report.get('dtype', '?')}), "
        f"{n} new tokens per request"
    )
    fig.savefig(path, format="png")
    return path
