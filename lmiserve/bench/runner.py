"""One `lmiserve bench` run: start (or reach) the servers, drive every concurrency level, the soak,
then the in-process baselines while the server idles; build the report, JSON and chart. What it is
asked: bench/config.py; the servers: bench/targets.py; the measurements: bench/measure.py."""

from __future__ import annotations

import asyncio
import datetime as dt
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmiserve.bench.chart import draw_chart
from lmiserve.bench.clients import LmiDialect, served_model
from lmiserve.bench.config import HIDDEN, BenchConfig, hidden_options, redacted
from lmiserve.bench.lora import adapter_load_times
from lmiserve.bench.machine import load_average, machine_info, versions
from lmiserve.bench.measure import measure_servers, soak
from lmiserve.bench.report import build_report, write_json
from lmiserve.bench.server import ManagedServer, RssSampler
from lmiserve.bench.targets import ab_name, compare_targets, lmiserve_target, lora_name
from lmiserve.bench.vision import IMAGE_SIZE

Json = dict[str, Any]
Log = Callable[[str], None]


def _lora_adapters(config: BenchConfig, log: Log) -> dict[str, Path]:
    """Make `config.lora` random adapters of the benchmarked model in the output folder."""
    from lmiserve.models.bundled import bundled_model_path
    from lmiserve.models.lora_demo import LORA_TARGETS, make_adapters  # torch: only with --lora
    from lmiserve.models.resolve import resolve_model_path

    model_path = resolve_model_path(config.model_id, None, None) if config.model_id else bundled_model_path()
    folder = Path(tempfile.mkdtemp(prefix="lmiserve-bench-lora-"))  # removed at the end of the run
    log(f"making {config.lora} LoRA adapters of rank {config.lora_rank} on {config.lora_targets} linears in {folder}")
    return make_adapters(model_path, folder, config.lora, config.lora_rank, LORA_TARGETS[config.lora_targets])


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
    vision_baselines: Json | None = None
    grammar: Json | None = None
    lora_report: Json | None = None
    adapters: dict[str, Path] = {}
    served: str | None = None  # --url without --model-id: the model the server says it serves
    shared: list[tuple[str, str]] = []  # a second server on the same GPU: each gets part of it
    try:
        if config.url:
            lmi = LmiDialect(url=config.url.rstrip("/"), api_key=config.client_api_key)
            if config.model_id is None:
                served = asyncio.run(served_model(lmi.url, lmi.api_key))
        else:
            shared = config.shared_gpu()
            if shared:
                log(f"two servers on one GPU: each starts with -o {shared[0][0]}={shared[0][1]}")
            managed = ManagedServer(config.serve_args(shared), config.output_dir / "server.log", config.startup_timeout)
            log(f"starting {shlex.join(redacted(managed.command))} (log: {managed.log_path})")
            managed.start()
            sampler = RssSampler(managed.pid).start()
            lmi = LmiDialect(url=managed.url, api_key=config.client_api_key)
        targets = [lmiserve_target(lmi.url, lmi.name, started_by_bench=managed is not None, api_key=lmi.api_key)]
        adapters = _lora_adapters(config, log) if config.lora else {}
        if config.ab_options or adapters:
            extra = [*shared, *config.ab_options]
            if adapters:
                extra.append(("lora_modules", " ".join(f"{name}={path}" for name, path in adapters.items())))
            second = ManagedServer(config.serve_args(extra), config.output_dir / "server-b.log", config.startup_timeout)
            log(f"starting {shlex.join(redacted(second.command))} (log: {second.log_path})")
            second.start()
            name = ab_name(config.ab_options) if not adapters else lora_name(config)
            key = dict(config.ab_options).get("api_key") or lmi.api_key  # --ab-option api_key=... is B's own
            target = lmiserve_target(second.url, name, started_by_bench=True, ab=True, api_key=key)
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
            if {"completion", "chat"} & set(config.scenarios):
                from lmiserve.bench.baselines import run_baselines  # torch: only when needed

                baselines = run_baselines(config.overrides(), config.concurrency, config.max_new_tokens, log)
            if "vision" in config.scenarios:
                from lmiserve.bench.baselines_vision import run_vision_baselines  # torch: only when needed

                vision_baselines = run_vision_baselines(
                    config.overrides(), config.concurrency, config.max_new_tokens, log
                )
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
    loaded_info = baselines or vision_baselines or {}  # what the baselines loaded: device, dtype, path
    meta = {
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t0, 1),
        "command": shlex.join(redacted(config.command)),
        "machine": {**machine_info(), "load_average_start": load_at_start, "load_average_end": load_average()},
        "versions": versions(),
        "device": loaded_info.get("device") or config.device or "auto",
        "dtype": loaded_info.get("dtype") or config.dtype or "auto",
        "dtype_setting": config.dtype or "auto",  # as asked (int8 computes in bfloat16)
        "model": {
            "id": config.model_id,
            "name": (served or "?") if config.url and config.model_id is None else default_model_name(config.model_id),
            "path": loaded_info.get("model_path"),
        },
        "settings": {
            "concurrency": config.concurrency,
            "max_new_tokens": config.max_new_tokens,
            "requests_per_client": None if config.duration else config.requests_per_client,
            "duration_s": config.duration,
            "warmup_requests_per_client": config.warmup,
            "client_processes": config.client_processes,
            "server_options": hidden_options(config.options),
            "url": config.url,
            "api_key": HIDDEN if config.api_key else None,
            "soak_requests": config.soak_requests,
            "skip_baselines": config.skip_baselines,
            "json_schema": config.json_schema_source,
            "scenario": config.scenario,
            "prompt_set": config.prompt_set,
            "chat_turns": config.chat_turns if "chat" in config.scenarios else None,
            "chat_conversations_per_client": (
                config.chat_conversations if "chat" in config.scenarios and not config.duration else None
            ),
            "vision_image_size": list(IMAGE_SIZE) if "vision" in config.scenarios else None,
            "ab_options": hidden_options(config.ab_options),
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
    report = build_report(
        meta, servers, baselines, memory, structured, list(hidden_options(config.ab_options).items()), vision_baselines
    )
    write_json(report, json_path)
    draw_chart(report, png_path)
    return report, json_path, png_path


def all_requests_ok(report: Json) -> bool:
    levels = [
        lv
        for s in report["servers"]
        for key in ("levels", "constrained_levels", "chat_levels", "vision_levels")
        for lv in s.get(key, [])
    ]
    soak_result = (report.get("memory") or {}).get("soak") or {}
    return all(lv["failed_requests"] == 0 and lv["token_count_errors"] == 0 for lv in levels) and not (
        soak_result.get("failed_requests") or soak_result.get("token_count_errors")
    )


__all__ = ["all_requests_ok", "run"]
