"""One `lmiserve bench` run: start (or reach) the servers, drive every concurrency level, the soak,
then the in-process baselines while the server idles; build the report, JSON and chart."""

from __future__ import annotations

import asyncio
import datetime as dt
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lmiserve.bench.chart import draw_chart
from lmiserve.bench.chat import ChatDialect, probe_chat, run_chat_level
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
from lmiserve.bench.conversations import chat_level_summary
from lmiserve.bench.lora import adapter_load_times
from lmiserve.bench.machine import load_average, machine_info, versions
from lmiserve.bench.report import build_report, write_json
from lmiserve.bench.server import ManagedServer, RssSampler
from lmiserve.bench.stats import level_summary
from lmiserve.bench.structured import compare_levels

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
    scenario: str = "completion"  # completion, chat or both
    prompt_set: str = "general"  # the completion scenario's prompts (bench/prompts.py, PROMPT_SETS)
    chat_turns: int = 4
    chat_conversations: int = 2  # per client and level (without --duration)
    ab_options: list[tuple[str, str]] = field(default_factory=list)  # --ab-option: a second lmiserve
    # --lora N: a second lmiserve serving N random adapters (models/lora_demo.py), each request naming one in turn
    lora: int = 0
    lora_rank: int = 16
    lora_targets: str = "all"
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    def overrides(self) -> dict[str, object]:
        """Settings overrides the server gets, and the baselines load the model with."""
        out: dict[str, object] = dict(self.options)
        for key in ("model_id", "device", "dtype"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def serve_args(self, extra: list[tuple[str, str]] | None = None) -> list[str]:
        args = ["--model-id", self.model_id] if self.model_id else []
        for key in ("device", "dtype"):
            if getattr(self, key) is not None:
                args += ["-o", f"{key}={getattr(self, key)}"]
        for key, value in [*self.options, *(extra or [])]:
            args += ["-o", f"{key}={value}"]
        return args

    @property
    def scenarios(self) -> list[str]:
        return ["completion", "chat"] if self.scenario == "both" else [self.scenario]


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


@dataclass
class Target:
    """One server under test: its completion dialect (LMI or OpenAI completions) and its chat dialect."""

    name: str
    completion: Dialect
    chat: ChatDialect
    started_by_bench: bool = False
    ab: bool = False  # the second lmiserve of --ab-option


def _measure_chat_level(dialect: ChatDialect, concurrency: int, config: BenchConfig, log: Log, label: str) -> Json:
    records, elapsed = asyncio.run(
        run_chat_level(
            dialect,
            concurrency,
            config.max_new_tokens,
            turns=config.chat_turns,
            conversations_per_client=config.chat_conversations,
            duration=config.duration,
            warmup=config.warmup,
            request_timeout=config.request_timeout,
        )
    )
    level = chat_level_summary(concurrency, records, elapsed)
    log(
        f"  concurrency {concurrency:>3}{label} (chat): {level['output_tokens_per_s']} tokens/s, TTFT p50 turn 1 "
        f"{level['ttft_p50_turn1_ms']} ms, turns >= 3 {level['ttft_p50_late_turns_ms']} ms, "
        f"{level['requests']} requests ({level['failed_requests']} failed, {level['token_count_errors']} wrong "
        f"token counts) in {elapsed:.1f} s"
    )
    for error in level["errors"]:
        log(f"    error: {error}")
    return level


def measure_servers(targets: list[Target], config: BenchConfig, log: Log) -> list[Json]:
    """Probe every server, then every scenario and concurrency level, the servers in turn at each level
    (so that they see the same machine load as closely as a shared machine allows); with a JSON schema
    each completion level runs twice in a row on a server, unconstrained then constrained."""
    servers: list[Json] = []
    schema_dialects: list[Dialect | None] = []
    for target in targets:
        if "completion" in config.scenarios:
            dialect = target.completion
            log(f"{target.name} ({dialect.kind}) at {dialect.url}: probe request")
            asyncio.run(probe(dialect))
        if "chat" in config.scenarios:
            log(f"{target.name} (chat) at {target.chat.url}: probe request")
            asyncio.run(probe_chat(target.chat))
        schema = None
        if config.json_schema is not None and "completion" in config.scenarios:
            schema = constrained(target.completion, config.json_schema)
            asyncio.run(probe(schema))  # a schema the server refuses fails here, before the levels
        schema_dialects.append(schema)
        server: Json = {
            "name": target.name,
            "url": target.completion.url,
            "kind": target.completion.kind,
            "started_by_bench": target.started_by_bench,
            "levels": [],
        }
        if target.ab:
            server["ab"] = True
        if schema is not None:
            server["constrained_levels"] = []
        if "chat" in config.scenarios:
            server["chat_levels"] = []
        servers.append(server)
    for scenario in config.scenarios:
        for c in config.concurrency:
            for target, server, schema in zip(targets, servers, schema_dialects):
                label = f" [{target.name}]"
                if scenario == "chat":
                    server["chat_levels"].append(_measure_chat_level(target.chat, c, config, log, label))
                    continue
                server["levels"].append(_measure_level(target.completion, c, config, log, label))
                if schema is not None:
                    constrained_level = _measure_level(schema, c, config, log, label + " (JSON schema)")
                    server["constrained_levels"].append(constrained_level)
    for target, server in zip(targets, servers):
        if "constrained_levels" in server:
            server["constrained_over_unconstrained"] = compare_levels(server["levels"], server["constrained_levels"])
        if isinstance(target.completion, OpenAIDialect):
            server["model"] = target.completion.model or target.chat.model
    return servers


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


def compare_targets(config: BenchConfig) -> list[Target]:
    out = []
    for name, url in config.compare:
        base = url.rstrip("/").removesuffix("/v1")
        name = name or urlsplit(base).netloc or base
        out.append(
            Target(
                name=name,
                completion=OpenAIDialect(url=base, name=name, model=config.compare_model),
                chat=ChatDialect(url=base, name=name, model=config.compare_model),
            )
        )
    return out


def lmiserve_target(url: str, name: str, started_by_bench: bool, ab: bool = False) -> Target:
    return Target(
        name=name,
        completion=LmiDialect(url=url, name=name),
        chat=ChatDialect(url=url, name=name),
        started_by_bench=started_by_bench,
        ab=ab,
    )


def lora_name(config: BenchConfig) -> str:
    return f"lmiserve[{config.lora} LoRA adapters, rank {config.lora_rank}, {config.lora_targets}]"


def _lora_adapters(config: BenchConfig, log: Log) -> dict[str, Path]:
    """Make `config.lora` random adapters of the benchmarked model in the output folder."""
    from lmiserve.models.bundled import bundled_model_path
    from lmiserve.models.lora_demo import LORA_TARGETS, make_adapters  # torch: only with --lora
    from lmiserve.models.resolve import resolve_model_path

    model_path = resolve_model_path(config.model_id, None, None) if config.model_id else bundled_model_path()
    folder = Path(tempfile.mkdtemp(prefix="lmiserve-bench-lora-"))  # removed at the end of the run
    log(f"making {config.lora} LoRA adapters of rank {config.lora_rank} on {config.lora_targets} linears in {folder}")
    return make_adapters(model_path, folder, config.lora, config.lora_rank, LORA_TARGETS[config.lora_targets])


def ab_name(options: list[tuple[str, str]]) -> str:
    return "lmiserve[" + ",".join(f"{k}={v}" for k, v in options) + "]"


def run(config: BenchConfig, log: Log) -> tuple[Json, Path, Path]:
    """Run the whole benchmark; returns the report and the paths of the JSON and PNG files."""
    started, t0 = dt.datetime.now(dt.timezone.utc), time.monotonic()
    load_at_start = load_average()
    config.output_dir.mkdir(parents=True, exist_ok=True)
    managed: ManagedServer | None = None
    second: ManagedServer | None = None
    sampler: RssSampler | None = None
    servers: list[Json] = []
    memory: Json | None = None
    baselines: Json | None = None
    grammar: Json | None = None
    lora_report: Json | None = None
    adapters: dict[str, Path] = {}
    try:
        if config.url:
            lmi = LmiDialect(url=config.url.rstrip("/"))
        else:
            managed = ManagedServer(config.serve_args(), config.output_dir / "server.log", config.startup_timeout)
            log(f"starting {shlex.join(managed.command)} (log: {managed.log_path})")
            managed.start()
            sampler = RssSampler(managed.pid).start()
            lmi = LmiDialect(url=managed.url)
        targets = [lmiserve_target(lmi.url, lmi.name, started_by_bench=managed is not None)]
        adapters = _lora_adapters(config, log) if config.lora else {}
        if config.ab_options or adapters:
            extra = list(config.ab_options)
            if adapters:
                extra.append(("lora_modules", " ".join(f"{name}={path}" for name, path in adapters.items())))
            second = ManagedServer(config.serve_args(extra), config.output_dir / "server-b.log", config.startup_timeout)
            log(f"starting {shlex.join(second.command)} (log: {second.log_path})")
            second.start()
            name = ab_name(config.ab_options) if not adapters else lora_name(config)
            target = lmiserve_target(second.url, name, started_by_bench=True, ab=True)
            if adapters:
                assert isinstance(target.completion, LmiDialect)
                target.completion.adapters = list(adapters)
                lora_report = {
                    "adapters": config.lora,
                    "rank": config.lora_rank,
                    "targets": config.lora_targets,
                    "load": adapter_load_times(second.log_path),
                }
            targets.append(target)
        targets += compare_targets(config)
        servers = measure_servers(targets, config, log)
        if second is not None:
            second.stop()
        soak_result = soak(lmi, sampler, config, log) if config.soak_requests > 0 else None
        if sampler is not None:
            sampler.stop()
            memory = {**sampler.summary(), "soak": soak_result}
        elif soak_result is not None:
            memory = {"soak": soak_result}
        if not config.skip_baselines:
            if managed is not None and (config.device or "").startswith("cuda"):
                # on a GPU the started server's KV pool holds the memory the baselines' model needs
                managed.stop()
                log("baselines in process (the started server is stopped: its KV pool holds the GPU):")
            else:
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
        if adapters:
            shutil.rmtree(next(iter(adapters.values())).parent, ignore_errors=True)
        if sampler is not None:
            sampler.stop()
        if managed is not None:
            managed.stop()
        if second is not None:
            second.stop()

    from lmiserve.models.resolve import default_model_name

    json_path, png_path = config.output_dir / "bench.json", config.output_dir / "bench.png"
    meta = {
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t0, 1),
        "command": shlex.join(config.command),
        "machine": {**machine_info(), "load_average_start": load_at_start, "load_average_end": load_average()},
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
            "scenario": config.scenario,
            "prompt_set": config.prompt_set,
            "chat_turns": config.chat_turns if "chat" in config.scenarios else None,
            "chat_conversations_per_client": (
                config.chat_conversations if "chat" in config.scenarios and not config.duration else None
            ),
            "ab_options": dict(config.ab_options),
            "lora": lora_report,
        },
        "files": {
            "json": json_path.name,
            "chart": png_path.name,
            "server_log": "server.log" if managed is not None else None,
            "server_b_log": "server-b.log" if second is not None else None,
        },
    }
    structured = None
    if config.json_schema is not None:
        structured = {"source": config.json_schema_source, "schema": config.json_schema, **(grammar or {})}
    report = build_report(meta, servers, baselines, memory, structured, config.ab_options)
    write_json(report, json_path)
    draw_chart(report, png_path)
    return report, json_path, png_path


def all_requests_ok(report: Json) -> bool:
    levels = [
        lv for s in report["servers"] for lv in s["levels"] + s.get("constrained_levels", []) + s.get("chat_levels", [])
    ]
    soak_result = (report.get("memory") or {}).get("soak") or {}
    return all(lv["failed_requests"] == 0 and lv["token_count_errors"] == 0 for lv in levels) and not (
        soak_result.get("failed_requests") or soak_result.get("token_count_errors")
    )


__all__ = ["BenchConfig", "BenchError", "all_requests_ok", "run"]
