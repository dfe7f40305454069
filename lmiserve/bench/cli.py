"""`lmiserve bench`: the argument parser and the command (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import sys
from pathlib import Path

# What only `lmiserve bench` imports (the `bench` extra); `lmiserve serve` never needs them.
BENCH_MODULES = ("httpx", "psutil", "matplotlib")
INSTALL_HINT = "pip install 'lmiserve[bench]'"

DESCRIPTION = """\
Benchmark a server with closed-loop streaming clients at several concurrencies, forcing exactly
--max-new-tokens tokens per request (LMI /invocations, ignore_eos_token), and compare it in the
same run with the bare model forward and model.generate (in this process, while the server idles)
and with any OpenAI-compatible /v1/completions server (--compare-url). Writes bench.json and
bench.png to --output-dir and prints a table. The defaults take about 5 minutes on 2 CPU cores
with the bundled SmolLM2-135M (fp32).

--scenario chat (or both) runs multi-turn conversations over /v1/chat/completions instead (or as
well): a shared system prompt, every turn resending the whole history, figures per turn index.
--ab-option KEY=VALUE starts a second lmiserve with that server option added (for instance
enable_prefix_caching=false) and runs every level on both, reporting B / A throughput and the chat
TTFT of turns >= 3, A / B.

--scenario vision (a vision-language model) sends one 640x480 image and a question a request over
/v1/chat/completions, at concurrency 1 and 8 unless --concurrency says otherwise, and compares with
model.generate on the same images (pixel inputs from the model's processor) in the same run."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="benchmark a server against the bare model forward and model.generate",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-id", help="model for the started server and the baselines (default: the bundled model)")
    p.add_argument("--url", help="benchmark this running lmiserve (LMI /invocations) instead of starting one")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or None,
        metavar="KEY",
        help="the servers' API key, sent as 'Authorization: Bearer KEY' to --url and every --compare-url "
        "(default: the OPENAI_API_KEY environment variable; a server the bench starts with -o api_key=KEY "
        "gets it without this); never written to bench.json or the log",
    )
    p.add_argument(
        "--compare-url",
        action="append",
        default=[],
        metavar="URL",
        help="also benchmark this OpenAI-compatible server (/v1/completions); repeatable",
    )
    p.add_argument(
        "--compare-name",
        action="append",
        default=[],
        metavar="NAME",
        help="name of the --compare-url at the same position (default: its host:port)",
    )
    p.add_argument("--compare-model", help="model sent to compare servers (default: first id of their /v1/models)")
    p.add_argument(
        "--concurrency",
        type=_int_list,
        metavar="C1,C2,...",
        help="closed-loop client counts, also the baselines' batch sizes (default 1,8,32; 1,8 with --scenario vision)",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens forced per request (default 128)")
    amount = p.add_mutually_exclusive_group()
    amount.add_argument(
        "--requests-per-client", type=_positive_int, help="measured requests per client and level (default 2)"
    )
    amount.add_argument("--duration", type=float, help="seconds of measured load per level instead")
    p.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=1,
        help="warm-up requests per client and level, not measured; the first is staggered (default 1)",
    )
    p.add_argument(
        "--client-processes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="split each level's clients over N processes (at most one a client): one process reads at most a "
        "few thousand tokens/s, a GPU server at 128 streams streams more; each level reports its busiest client "
        "process's share of a core (client_busy) (default 1)",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        help="where bench.json, bench.png and server.log go (default bench-results/<UTC time>)",
    )
    p.add_argument("--device", help="device of the server and the baselines: auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", help="dtype of the server and the baselines: auto, fp32, fp16, bf16, int8, int4")
    p.add_argument("--skip-baselines", action="store_true", help="do not run the in-process baselines")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="server option (as `lmiserve serve -o`), also used to load the baselines' model; repeatable",
    )
    p.add_argument(
        "--soak-requests",
        type=_non_negative_int,
        default=0,
        help="after the levels, send this many short requests and report the server's RSS drift "
        "(the issue's target: 1000)",
    )
    p.add_argument("--soak-max-new-tokens", type=_positive_int, default=16, help="tokens per soak request (default 16)")
    p.add_argument(
        "--json-schema",
        metavar="FILE|builtin",
        help="also run every level with this JSON schema on every request (a file holding the schema, or "
        "`builtin`: one that cannot complete within --max-new-tokens) and report constrained vs "
        "unconstrained throughput, compile times and the per-step mask cost",
    )
    p.add_argument(
        "--scenario",
        choices=("completion", "chat", "both", "vision"),
        default="completion",
        help="completion: one prompt a request (LMI /invocations; peers /v1/completions); chat: "
        "multi-turn conversations over /v1/chat/completions; both: one after the other; vision: one image "
        "and a question a request over /v1/chat/completions (a vision-language model) (default completion)",
    )
    p.add_argument(
        "--prompt-set",
        choices=("general", "repeat"),
        default="general",
        help="the completion scenario's prompts: general (questions, stories, explanations) or repeat "
        "(answers that repeat or edit a passage of the prompt: what speculative decoding's prompt lookup "
        "speeds up) (default general)",
    )
    p.add_argument("--chat-turns", type=_positive_int, default=4, help="turns of each conversation (default 4)")
    p.add_argument(
        "--chat-conversations",
        type=_positive_int,
        default=2,
        help="measured conversations per client and level, without --duration (default 2)",
    )
    p.add_argument(
        "--ab-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also start a second lmiserve with this server option added (B) and run every level on both, "
        "e.g. enable_prefix_caching=false; repeatable; not with --url",
    )
    p.add_argument(
        "--lora",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="also start a second lmiserve serving N random LoRA adapters of the model (lora_modules) and run "
        "every level on both, each request of the second naming the adapters in turn (completion scenario); "
        "the report gives the ratio to the base model and each adapter's load time",
    )
    p.add_argument("--lora-rank", type=_positive_int, default=16, help="rank of the --lora adapters (default 16)")
    p.add_argument(
        "--lora-targets",
        choices=("all", "attention", "qv"),
        default="all",
        help="linears the --lora adapters adapt: all seven, attention (q/k/v/o) or qv (default all)",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server (default 600)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    return p


def missing_bench_modules() -> list[str]:
    """The modules of BENCH_MODULES that are not installed."""
    return [name for name in BENCH_MODULES if importlib.util.find_spec(name) is None]


def run_bench_command(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    missing = missing_bench_modules()
    if missing:
        print(
            f"lmiserve bench: {', '.join(missing)} not installed; install the bench extra: {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 1

    from lmiserve.config import ConfigError, load_settings, parse_override

    if len(args.compare_name) > len(args.compare_url):
        print("lmiserve bench: more --compare-name than --compare-url", file=sys.stderr)
        return 2
    if (args.ab_option or args.lora) and args.url:
        print("lmiserve bench: --ab-option and --lora need a server started by the bench (not --url)", file=sys.stderr)
        return 2
    if args.lora and args.ab_option:
        print("lmiserve bench: --lora compares with the base model: not with --ab-option", file=sys.stderr)
        return 2
    if args.lora and args.scenario != "completion":
        print("lmiserve bench: --lora runs the completion scenario", file=sys.stderr)
        return 2
    if args.duration is not None and args.duration <= 0:
        print("lmiserve bench: --duration must be > 0", file=sys.stderr)
        return 2
    if args.client_processes > 1 and args.scenario == "vision":
        print(
            "lmiserve bench: --client-processes: the vision scenario runs its clients in one process", file=sys.stderr
        )
        return 2
    from lmiserve.bench.structured import SchemaError, load_schema

    try:
        schema = load_schema(args.json_schema, args.max_new_tokens) if args.json_schema else None
    except SchemaError as exc:
        print(f"lmiserve bench: {exc}", file=sys.stderr)
        return 2
    try:
        options = [parse_override(o) for o in args.option]
        ab_options = [parse_override(o) for o in args.ab_option]
        from lmiserve.bench.prompts import select_prompt_set

        select_prompt_set(args.prompt_set)  # the servers' requests and the in-process baselines
        from lmiserve.bench.config import BenchConfig

        config = BenchConfig(
            model_id=args.model_id,
            url=args.url,
            api_key=args.api_key,
            compare=[
                (args.compare_name[i] if i < len(args.compare_name) else "", url)
                for i, url in enumerate(args.compare_url)
            ],
            compare_model=args.compare_model,
            concurrency=args.concurrency or ([1, 8] if args.scenario == "vision" else [1, 8, 32]),
            max_new_tokens=args.max_new_tokens,
            requests_per_client=args.requests_per_client or 2,
            duration=args.duration,
            warmup=args.warmup,
            client_processes=args.client_processes,
            output_dir=args.output_dir
            or Path("bench-results") / dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S"),
            device=args.device,
            dtype=args.dtype,
            skip_baselines=args.skip_baselines,
            options=options,
            soak_requests=args.soak_requests,
            soak_max_new_tokens=args.soak_max_new_tokens,
            startup_timeout=args.startup_timeout,
            request_timeout=args.request_timeout,
            json_schema=schema,
            json_schema_source=args.json_schema,
            scenario=args.scenario,
            prompt_set=args.prompt_set,
            chat_turns=args.chat_turns,
            chat_conversations=args.chat_conversations,
            ab_options=ab_options,
            lora=args.lora,
            lora_rank=args.lora_rank,
            lora_targets=args.lora_targets,
            command=["lmiserve", *(argv if argv is not None else sys.argv[1:])],
        )
        load_settings(config.overrides())  # bad options fail here, before anything starts
        if ab_options:
            load_settings({**config.overrides(), **dict(ab_options)})
    except ConfigError as exc:
        print(f"lmiserve bench: configuration error: {exc}", file=sys.stderr)
        return 2

    from lmiserve.bench.clients import BenchError
    from lmiserve.bench.report import format_table
    from lmiserve.bench.runner import all_requests_ok, run

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        report, json_path, png_path = run(config, log)
    except BenchError as exc:
        print(f"lmiserve bench: {exc}", file=sys.stderr)
        return 1
    print(format_table(report))
    print(f"\nwrote {json_path} and {png_path}")
    if not all_requests_ok(report):
        print("lmiserve bench: some requests failed or did not stream the forced number of tokens", file=sys.stderr)
        return 1
    return 0
