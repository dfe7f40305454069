"""One `lmiserve bench` run: start (or reach) the servers, drive every concurrency level, the soak,
then the in-process baselines while the server idles; build the report, JSON and chart."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from lmiserve.bench.chart import draw_chart
from lmiserve.bench.clients import (
    BenchError,
    Dialect,
    LmiDialect,
    OpenAIDialect,
    constrained,
    probe,
    run_level,
    run_soak,
)
from lmiserve.bench.report import build_report, write_json
from lmiserve.bench.server import ManagedServer, RssSampler
from lmiserve.bench.stats import level_summary
from lmiserve.bench.structured import compare_levels
from lmiserve.core.cpu_info import cpu_info

Json = dict[str, Any]
Log = Callable[[str], None]


@dataclass
class BenchConfig:
    model_id: str | None = None
    url: str | None = None
    compare: list[tuple[str, str]] = field(default_factory=list)  # (name, url)
    compare_model: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_new_tokens: int = 128
    requests_per_client: int = 2
    duration: float | None = None
    warmup: int = 1
    output_dir: Path = Path("bench-results")
    device: str | None = None
    dtype: str | None = None
    skip_baselines: bool = False
    options: list[tuple[str, str]] = field(default_factory=list)  # -o KEY=VALUE, parsed
    soak_requests: int = 0
    soak_max_new_tokens: int = 16
    startup_timeout: float = 600.0
    request_timeout: float = 600.0
    json_schema: dict[str, Any] | None = None  # --json-schema: every level also runs constrained
    json_schema_source: str | None = None  # "builtin" or the file it came from
    mask_steps: int = 64  # steps of the in-process mask measurement per batch size
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    def overrides(self) -> dict[str, object]:
        """Settings overrides the server gets, and the baselines load the model with."""
        out: dict[str, object] = dict(self.options)
        for key in ("model_id", "device", "dtype"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def serve_args(self) -> list[str]:
        args = ["--model-id", self.model_id] if self.model_id else []
        for key in ("device", "dtype"):
            if getattr(self, key) is not None:
                args += ["-o", f"{key}={getattr(self, key)}"]
        for key, value in self.options:
            args += ["-o", f"{key}={value}"]
        return args


def machine_info() -> Json:
    cpu = cpu_info()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu.model,
        "cpu_flags": list(cpu.flags),  # the kernel-relevant ones (core/cpu_info.py)
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
    }


def versions() -> Json:
    out: dict[str, str | None] = {}
    for package in ("lmiserve", "torch", "transformers", "tokenizers", "numba", "httpx", "uvicorn", "matplotlib"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def _measure_level(dialect: Dialect, concurrency: int, config: BenchConfig, log: Log, label: str) -> Json:
    records, elapsed = asyncio.run(
        run_level(
            dialect,
            concurrency,
            config.max_new_tokens,
            requests_per_client=config.requests_per_client,
            duration=config.duration,
            warmup=config.warmup,
            request_timeout=config.request_timeout,
        )
    )
    level = level_summary(concurrency, records, elapsed)
    log(
        f"  concurrency {concurrency:>3}{label}: {level['output_tokens_per_s']} tokens/s, "
        f"TTFT p50 {level['ttft_ms']['p50']} ms, ITL p50/p99 {level['itl_ms']['p50']}/{level['itl_ms']['p99']} ms, "
        f"{level['requests']} requests ({level['failed_requests']} failed, {level['token_count_errors']} wrong "
        f"token counts) in {elapsed:.1f} s"
    )
    for error in level["errors"]:
        log(f"    error: {error}")
    return level


def measure_server(dialect: Dialect, config: BenchConfig, log: Log, started_by_bench: bool) -> Json:
    """Every concurrency level; with a JSON schema each level runs twice in a row, unconstrained then
    constrained (so both phases see the same machine load as closely as a shared machine allows)."""
    log(f"{dialect.name} ({dialect.kind}) at {dialect.url}: probe request")
    asyncio.run(probe(dialect))
    schema_dialect = constrained(dialect, config.json_schema) if config.json_schema is not None else None
    if schema_dialect is not None:
        asyncio.run(probe(schema_dialect))  # a schema the server refuses fails here, before the levels
    levels, constrained_levels = [], []
    for c in config.concurrency:
        levels.append(_measure_level(dialect, c, config, log, ""))
        if schema_dialect is not None:
            constrained_levels.append(_measure_level(schema_dialect, c, config, log, " (JSON schema)"))
    server: Json = {
        "name": dialect.name,
        "url": dialect.url,
        "kind": dialect.kind,
        "started_by_bench": started_by_bench,
        "levels": levels,
    }
    if schema_dialect is not None:
        server["constrained_levels"] = constrained_levels
        server["constrained_over_unconstrained"] = compare_levels(levels, constrained_levels)
    if isinstance(dialect, OpenAIDialect):
        server["model"] = dialect.model
    return server


def soak(dialect: Dialect, sampler: RssSampler | None, config: BenchConfig, log: Log) -> Json:
    concurrency = max(config.concurrency)
    log(f"soak: {config.soak_requests} requests x {config.soak_max_new_tokens} tokens at concurrency {concurrency}")
    before = sampler.read() if sampler else None
    first_sample = len(sampler.samples) if sampler else 0
    records, elapsed = asyncio.run(
        run_soak(dialect, concurrency, config.soak_requests, config.soak_max_new_tokens, config.request_timeout)
    )
    after = sampler.read() if sampler else None
    during = [rss for _, rss in sampler.samples[first_sample:]] if sampler else []

    def mib(size: int | None) -> float | None:
        return None if size is None else round(size / 2**20, 1)

    result = {
        "requests": len(records),
        "concurrency": concurrency,
        "max_new_tokens": config.soak_max_new_tokens,
        "elapsed_s": round(elapsed, 2),
        "failed_requests": sum(1 for r in records if r.error is not None),
        "token_count_errors": sum(1 for r in records if r.error is None and not r.count_ok),
        "rss_before_mib": mib(before),
        "rss_after_mib": mib(after),
        "rss_max_mib": mib(max(during)) if during else None,
        "drift_pct": round((after - before) / before * 100, 2) if before and after else None,
    }
    log(f"  RSS {result['rss_before_mib']} -> {result['rss_after_mib']} MiB (drift {result['drift_pct']} %)")
    return result


def compare_dialects(config: BenchConfig) -> list[OpenAIDialect]:
    out = []
    for name, url in config.compare:
        base = url.rstrip("/").removesuffix("/v1")
        out.append(OpenAIDialect(url=base, name=name or urlsplit(base).netloc or base, model=config.compare_model))
    return out


def run(config: BenchConfig, log: Log) -> tuple[Json, Path, Path]:
    """Run the whole benchmark; returns the report and the paths of the JSON and PNG files."""
    started, t0 = dt.datetime.now(dt.timezone.utc), time.monotonic()
    config.output_dir.mkdir(parents=True, exist_ok=True)
    managed: ManagedServer | None = None
    sampler: RssSampler | None = None
    servers: list[Json] = []
    memory: Json | None = None
    baselines: Json | None = None
    grammar: Json | None = None
    try:
        if config.url:
            lmi = LmiDialect(url=config.url.rstrip("/"))
        else:
            managed = ManagedServer(config.serve_args(), config.output_dir / "server.log", config.startup_timeout)
            log(f"starting {shlex.join(managed.command)} (log: {managed.log_path})")
            managed.start()
            sampler = RssSampler(managed.pid).start()
            lmi = LmiDialect(url=managed.url)
        dialects: list[Dialect] = [lmi, *compare_dialects(config)]
        for dialect in dialects:
            servers.append(
                measure_server(dialect, config, log, started_by_bench=dialect is lmi and managed is not None)
            )
        soak_result = soak(lmi, sampler, config, log) if config.soak_requests > 0 else None
        if sampler is not None:
            sampler.stop()
            memory = {**sampler.summary(), "soak": soak_result}
        elif soak_result is not None:
            memory = {"soak": soak_result}
        if not config.skip_baselines:
            log("baselines in process (the server idles):")
            from lmiserve.bench.baselines import run_baselines  # torch: only when needed

            baselines = run_baselines(config.overrides(), config.concurrency, config.max_new_tokens, log)
        if config.json_schema is not None:
            log("grammar figures in process (the server idles):")
            from lmiserve.bench.baselines import measure_grammar  # torch: only when needed

            grammar = measure_grammar(
                config.overrides(), config.json_schema, config.concurrency, config.mask_steps, log
            )
    finally:
        if sampler is not None:
            sampler.stop()
        if managed is not None:
            managed.stop()

    from lmiserve.models.resolve import default_model_name

    json_path, png_path = config.output_dir / "bench.json", config.output_dir / "bench.png"
    meta = {
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t0, 1),
        "command": shlex.join(config.command),
        "machine": machine_info(),
        "versions": versions(),
        "device": (baselines or {}).get("device") or config.device or "auto",
        "dtype": (baselines or {}).get("dtype") or config.dtype or "auto",
        "dtype_setting": config.dtype or "auto",  # as asked (int8 computes in bfloat16)
        "model": {
            "id": config.model_id,
            "name": default_model_name(config.model_id),
            "path": (baselines or {}).get("model_path"),
        },
        "settings": {
            "concurrency": config.concurrency,
            "max_new_tokens": config.max_new_tokens,
            "requests_per_client": None if config.duration else config.requests_per_client,
            "duration_s": config.duration,
            "warmup_requests_per_client": config.warmup,
            "server_options": dict(config.options),
            "url": config.url,
            "soak_requests": config.soak_requests,
            "skip_baselines": config.skip_baselines,
            "json_schema": config.json_schema_source,
        },
        "files": {
            "json": json_path.name,
            "chart": png_path.name,
            "server_log": "server.log" if managed is not None else None,
        },
    }
    structured = None
    if config.json_schema is not None:
        structured = {"source": config.json_schema_source, "schema": config.json_schema, **(grammar or {})}
    report = build_report(meta, servers, baselines, memory, structured)
    write_json(report, json_path)
    draw_chart(report, png_path)
    return report, json_path, png_path


def all_requests_ok(report: Json) -> bool:
    levels = [lv for s in report["servers"] for lv in s["levels"] + s.get("constrained_levels", [])]
    soak_result = (report.get("memory") or {}).get("soak") or {}
    return all(lv["failed_requests"] == 0 and lv["token_count_errors"] == 0 for lv in levels) and not (
        soak_result.get("failed_requests") or soak_result.get("token_count_errors")
    )


__all__ = ["BenchConfig", "BenchError", "all_requests_ok", "run"]
