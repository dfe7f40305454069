"""What one `lmiserve bench` run is asked to do (`BenchConfig`, filled by bench/cli.py from the
command line): the servers, the levels, the scenarios and the options of the lmiserve it starts."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmiserve.config.settings import canonical_key


@dataclass
class BenchConfig:
    model_id: str | None = None
    url: str | None = None
    api_key: str | None = None  # --api-key: sent as a bearer token to every server the bench reaches
    compare: list[tuple[str, str]] = field(default_factory=list)  # (name, url)
    compare_model: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_new_tokens: int = 128
    requests_per_client: int = 2
    duration: float | None = None
    warmup: int = 1
    client_processes: int = 1  # processes the clients of a level are split over (bench/client_processes.py)
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

    def shared_gpu(self) -> list[tuple[str, str]]:
        """The option that lets the two servers of --ab-option or --lora share one GPU: each gets
        `SHARED_GPU_UTILIZATION` of it (the default 0.9 each does not fit two: the second runs out of memory
        at start); none on a CPU, or where an option of A's or B's already sizes the pools."""
        if not (self.ab_options or self.lora):
            return []
        if {canonical_key(k) for k, _ in [*self.options, *self.ab_options]} & POOL_SIZE_OPTIONS:
            return []
        device = str(self.overrides().get("device", "auto"))
        if device == "auto":
            from lmiserve.bench.baselines import cuda_available  # torch, imported only here

            device = "cuda" if cuda_available() else "cpu"
        return [("gpu_memory_utilization", str(SHARED_GPU_UTILIZATION))] if device.startswith("cuda") else []

    @property
    def client_api_key(self) -> str | None:
        """The key of the lmiserve under test: --api-key, else the `-o api_key=...` the bench starts it with."""
        return self.api_key or dict(self.options).get("api_key") or None

    @property
    def scenarios(self) -> list[str]:
        return ["completion", "chat"] if self.scenario == "both" else [self.scenario]


SHARED_GPU_UTILIZATION = 0.44  # of one GPU, each of two servers the bench starts (BenchConfig.shared_gpu)
POOL_SIZE_OPTIONS = frozenset({"gpu_memory_utilization", "kv_cache_memory_bytes"})

HIDDEN = "<hidden>"
_OPTION_FLAGS = ("-o", "--option", "--ab-option")  # the flags that take a server option KEY=VALUE
SECRET_OPTIONS = ("api_key",)  # server options (-o KEY=VALUE) whose values a report or a log never shows


def _secret_flag(flag: str) -> bool:
    """`--api-key`, or an abbreviation of it that argparse takes for it (`--api`)."""
    return flag.startswith("--ap") and "--api-key".startswith(flag)


def _secret_option(text: str) -> bool:
    key, eq, _ = text.partition("=")
    return bool(eq) and canonical_key(key) in SECRET_OPTIONS


def hidden_options(options: list[tuple[str, str]]) -> dict[str, str]:
    """`options` as a mapping for a report, each secret's value hidden."""
    return {key: HIDDEN if key in SECRET_OPTIONS else value for key, value in options}


def redacted(args: list[str]) -> list[str]:
    """A command line as a report or a log shows it: the values of `--api-key` and of `-o api_key=...`
    hidden, in each spelling argparse takes (`--api-key K`, `--api-key=K`, `-o api_key=K`,
    `--option=api_key=K`, `-oapi_key=K`; the same for `--ab-option`)."""
    out: list[str] = []
    for n, arg in enumerate(args):
        before = args[n - 1] if n else ""
        flag, eq, rest = arg.partition("=")
        whole_value = (
            (_secret_flag(flag) and bool(eq))  # --api-key=K
            or (before in _OPTION_FLAGS and _secret_option(arg))  # -o api_key=K
            or (arg.startswith("-o") and not arg.startswith("--") and _secret_option(arg[2:]))  # -oapi_key=K
        )
        if _secret_flag(before) and "=" not in before:  # --api-key K
            out.append(HIDDEN)
        elif whole_value:
            out.append(f"{flag}={HIDDEN}")
        elif flag in _OPTION_FLAGS and _secret_option(rest):  # --option=api_key=K
            out.append(f"{flag}={rest.partition('=')[0]}={HIDDEN}")
        else:
            out.append(arg)
    return out
