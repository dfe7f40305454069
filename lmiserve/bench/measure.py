"""The measurements of one `lmiserve bench` run against its servers: every scenario and concurrency level
on every server in turn (`measure_servers`), and the soak with the started server's memory (`soak`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from lmiserve.bench.chat import ChatDialect, probe_chat, run_chat_level
from lmiserve.bench.client_processes import ClientRun, run_clients
from lmiserve.bench.clients import Dialect, OpenAIDialect, constrained, probe, run_level, run_soak
from lmiserve.bench.config import BenchConfig
from lmiserve.bench.conversations import chat_level_summary
from lmiserve.bench.server import RssSampler
from lmiserve.bench.stats import level_summary
from lmiserve.bench.steps import level_steps, read_steps
from lmiserve.bench.structured import compare_levels
from lmiserve.bench.targets import Target
from lmiserve.bench.vision import PROBE_NUMBER, VisionRequest, level_numbers, prepare_images

Json = dict[str, Any]
Log = Callable[[str], None]
CLIENT_BOUND = 0.9  # of one core: a level whose busiest client process was this busy may have measured it


def client_cost(level: Json, run: ClientRun, processes: int) -> str:
    """The clients' CPU in the level's figures (`client_processes`, `client_cpu_s`, and `client_busy`: the
    busiest client process's share of one core while it ran its clients; near 1, the level measured the client); a
    note for the log line when it is."""
    level["client_processes"] = processes
    level["client_cpu_s"], level["client_busy"] = round(run.cpu, 3), round(run.busy, 3)
    if run.busy < CLIENT_BOUND:
        return ""
    return f"; a client process used {run.busy:.0%} of a core: this level may measure the client (--client-processes)"


def _processes(config: BenchConfig, concurrency: int) -> int:
    return max(1, min(config.client_processes, concurrency))


def _timing(config: BenchConfig) -> Json:
    """How long every scenario's level runs its clients: the measured time, the warm-up, a request's limit."""
    return {"duration": config.duration, "warmup": config.warmup, "request_timeout": config.request_timeout}


def _report(log: Log, level: Json, run: ClientRun, processes: int, head: str) -> None:
    """A level's log line (`head`, then what every scenario says: requests, failures, time, the clients'
    cost) and its errors; the clients' cost goes into `level` (`client_cost`)."""
    note = client_cost(level, run, processes)
    log(
        f"{head}{level['requests']} requests ({level['failed_requests']} failed, {level['token_count_errors']} "
        f"wrong token counts) in {run.elapsed:.1f} s{note}"
    )
    for error in level["errors"]:
        log(f"    error: {error}")


def _measure_level(dialect: Dialect, concurrency: int, config: BenchConfig, log: Log, label: str) -> Json:
    processes = _processes(config, concurrency)
    limits = {"requests_per_client": config.requests_per_client, **_timing(config)}
    before = read_steps(dialect)
    run = run_clients(run_level, processes, dialect, concurrency, config.max_new_tokens, **limits)
    level = level_summary(concurrency, run.records, run.elapsed)
    level["engine_steps"] = steps = level_steps(before, read_steps(dialect))
    head = (
        f"  concurrency {concurrency:>3}{label}: {level['output_tokens_per_s']} tokens/s, "
        f"TTFT p50 {level['ttft_ms']['p50']} ms, ITL p50/p99 {level['itl_ms']['p50']}/{level['itl_ms']['p99']} ms, "
    )
    if steps is not None:  # the server's steps that carried prompt tokens (eager on a GPU: bench/steps.py)
        head += (
            f"steps with prompts {steps['prefill_share']:.0%} ({steps['prefill_step_ms']} ms, decode-only "
            f"{steps['decode_step_ms']} ms), "
        )
    _report(log, level, run, processes, head)
    return level


def _measure_chat_level(dialect: ChatDialect, concurrency: int, config: BenchConfig, log: Log, label: str) -> Json:
    processes = _processes(config, concurrency)
    limits = {"turns": config.chat_turns, "conversations_per_client": config.chat_conversations, **_timing(config)}
    run = run_clients(run_chat_level, processes, dialect, concurrency, config.max_new_tokens, **limits)
    level = chat_level_summary(concurrency, run.records, run.elapsed)
    head = (
        f"  concurrency {concurrency:>3}{label} (chat): {level['output_tokens_per_s']} tokens/s, TTFT p50 turn 1 "
        f"{level['ttft_p50_turn1_ms']} ms, turns >= 3 {level['ttft_p50_late_turns_ms']} ms, "
    )
    _report(log, level, run, processes, head)
    return level


def _measure_vision_level(dialect: ChatDialect, concurrency: int, config: BenchConfig, log: Log, label: str) -> Json:
    """A level of one-image chat requests (bench/vision.py): the completion scenario's figures, plus the
    mean prompt tokens the server reported (the image's tokens among them)."""
    if config.duration is None:
        prepare_images(level_numbers(concurrency, config.requests_per_client, config.warmup))
    limits = {"turns": 1, "conversations_per_client": config.requests_per_client, "conversation": VisionRequest}
    # in this process, where the images were encoded (the CLI refuses --client-processes)
    run = run_clients(run_chat_level, 1, dialect, concurrency, config.max_new_tokens, **limits, **_timing(config))
    level = level_summary(concurrency, run.records, run.elapsed)
    prompt = [r.prompt_tokens for r in run.records if not r.warmup and r.prompt_tokens is not None]
    level["prompt_tokens_mean"] = round(sum(prompt) / len(prompt), 1) if prompt else None
    head = (
        f"  concurrency {concurrency:>3}{label} (vision): {level['output_tokens_per_s']} tokens/s, "
        f"TTFT p50 {level['ttft_ms']['p50']} ms, prompt {level['prompt_tokens_mean']} tokens, "
    )
    _report(log, level, run, 1, head)
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
        if "vision" in config.scenarios:
            log(f"{target.name} (vision) at {target.chat.url}: probe request")
            prepare_images([PROBE_NUMBER])
            asyncio.run(probe_chat(target.chat, conversation=VisionRequest))
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
        if "vision" in config.scenarios:
            server["vision_levels"] = []
        servers.append(server)
    for scenario in config.scenarios:
        for c in config.concurrency:
            for target, server, schema in zip(targets, servers, schema_dialects):
                label = f" [{target.name}]"
                if scenario == "chat":
                    server["chat_levels"].append(_measure_chat_level(target.chat, c, config, log, label))
                    continue
                if scenario == "vision":
                    server["vision_levels"].append(_measure_vision_level(target.chat, c, config, log, label))
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
