"""The settings ``lmiserve serve`` takes as flags of their own (``--dtype bf16``) besides ``-o KEY=VALUE``.

A flag is one more spelling of the command-line source: its value is handed to ``load_settings``
as text, exactly like ``-o``, so it goes through the same validation and the same error messages, and
``Settings.sources`` names the flag (``command line --port``). Only common settings get a flag;
``lmiserve options`` lists every key. vLLM's spellings are aliases: ``--max-num-seqs`` for
``--max-rolling-batch-size`` and ``--max-model-len`` for ``max_total_tokens`` (vLLM's context length
of prompt + output tokens: here the limit of the TGI and OpenAI routes, at most the model's own context;
the LMI routes check prompt + new tokens against the model's context).
"""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lmiserve.config.messages import default_text, plain_text, unwrap_optional
from lmiserve.config.settings import Settings
from lmiserve.config.sources import ENV_SHORTCUTS

_SENTENCE_END = re.compile(r"\.\s+(?=[A-Z])")
_GIVEN = "setting_flags"  # namespace attribute: {key: the flag that set it}


@dataclass(frozen=True)
class Flag:
    """A setting's flag(s); ``names[0]`` is the main spelling, the rest are aliases."""

    names: tuple[str, ...]
    key: str
    metavar: str | None = None
    note: str = ""  # put before the setting's description in --help
    many: bool = False  # takes one or more values (vLLM's `--served-model-name a b`), joined by commas


SETTING_FLAGS: tuple[Flag, ...] = (
    Flag(("--model-id", "--model"), "model_id", "MODEL"),
    Flag(("--revision",), "revision", "REV"),
    Flag(("--load-format",), "load_format"),
    Flag(("--served-model-name",), "served_model_name", "NAME", many=True),
    Flag(("--grpc-port",), "grpc_port", "PORT"),
    Flag(("--otlp-traces-endpoint", "--otlp-endpoint"), "otlp_traces_endpoint", "URL"),
    Flag(("--dtype",), "dtype"),
    Flag(("--device",), "device", "DEVICE"),
    Flag(("--tensor-parallel-size", "--tensor-parallel-degree", "--num-shard"), "tensor_parallel_degree", "N"),
    Flag(("--nnodes",), "nnodes", "N"),
    Flag(("--node-rank",), "node_rank", "N"),
    Flag(("--master-addr",), "master_addr", "HOST"),
    Flag(("--master-port",), "master_port", "PORT"),
    Flag(("--step-timeout",), "step_timeout", "SECONDS"),
    Flag(("--trust-remote-code",), "trust_remote_code"),
    Flag(("--max-rolling-batch-size", "--max-num-seqs"), "max_rolling_batch_size", "N"),
    Flag(("--max-num-batched-tokens",), "max_num_batched_tokens", "N"),
    Flag(("--enable-prefix-caching",), "enable_prefix_caching"),
    Flag(("--enforce-eager",), "enforce_eager"),
    Flag(("--cuda-graph-prompt-tokens",), "cuda_graph_prompt_tokens", "N"),
    Flag(("--async-scheduling",), "async_scheduling"),
    Flag(("--stream-interval",), "stream_interval", "N"),
    Flag(("--engine-process",), "engine_process"),
    Flag(("--kv-cache-dtype",), "kv_cache_dtype"),
    Flag(("--gpu-memory-utilization",), "gpu_memory_utilization", "SHARE"),
    Flag(("--kv-cache-memory-bytes",), "kv_cache_memory_bytes", "BYTES"),
    Flag(("--block-size",), "block_size", "N"),
    Flag(("--speculative-config",), "speculative_config", "JSON"),
    Flag(("--quantize", "--quantization"), "quantize", note="TGI's and vLLM's flags:"),
    Flag(("--max-new-tokens",), "max_new_tokens", "N"),
    Flag(("--max-input-tokens",), "max_input_tokens", "N"),
    Flag(("--max-logprobs",), "max_logprobs", "N"),
    Flag(
        ("--max-model-len", "--max-total-tokens"),
        "max_total_tokens",
        "N",
        "vLLM's name for max_total_tokens:",
    ),
    Flag(("--output-formatter",), "output_formatter"),
    Flag(("--tool-call-parser",), "tool_call_parser"),
    Flag(("--enable-auto-tool-choice",), "enable_auto_tool_choice"),
    Flag(("--chat-template",), "chat_template", "FILE"),
    Flag(("--reasoning-parser",), "reasoning_parser"),
    Flag(("--enable-lora",), "enable_lora"),
    Flag(("--lora-modules",), "lora_modules", "NAME=PATH"),
    Flag(("--lora-adapters",), "lora_adapters", "NAME=PATH"),
    Flag(("--max-loras",), "max_loras", "N"),
    Flag(("--max-lora-rank",), "max_lora_rank", "N"),
    Flag(("--limit-mm-per-prompt",), "limit_mm_per_prompt", "N"),
    Flag(("--allowed-media-domains",), "allowed_media_domains", "HOSTS"),
    Flag(("--model-store",), "model_store", "DIR"),
    Flag(("--api-key",), "api_key", "KEY"),
    Flag(("--host",), "host", "HOST"),
    Flag(("--port",), "port", "PORT"),
    Flag(("--metrics-port",), "metrics_port", "PORT"),
    Flag(("--log-level",), "log_level"),
    Flag(("--log-format",), "log_format"),
)


def flags_of(key: str) -> list[str]:
    """Every flag that sets ``key`` (``--no-...`` of a boolean left out)."""
    return [name for flag in SETTING_FLAGS if flag.key == key for name in flag.names]


def add_setting_flags(
    parser: argparse.ArgumentParser, group_title: Callable[[str], str] = lambda key: "settings"
) -> None:
    """Add every ``SETTING_FLAGS`` entry to ``parser``, in argument groups titled ``group_title(key)``."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in SETTING_FLAGS:
        title = group_title(flag.key)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        field = Settings.model_fields[flag.key]
        base, _ = unwrap_optional(field.annotation)
        env = [f"OPTION_{flag.key.upper()}", *(var for var, key in reversed(ENV_SHORTCUTS) if key == flag.key)]
        text = " ".join(part for part in (flag.note, first_sentence(plain_text(field.description or ""))) if part)
        text += f" [default: {default_text(field)}; -o {flag.key}; env {', '.join(env)}]"
        help_text = text.replace("%", "%%")
        if base is bool:
            groups[title].add_argument(*flag.names, dest=flag.key, action=_Switch, help=help_text)
        else:
            choices = typing.get_args(base) if typing.get_origin(base) is Literal else ()
            metavar = "{" + ",".join(str(c) for c in choices) + "}" if choices else flag.metavar
            groups[title].add_argument(
                *flag.names,
                dest=flag.key,
                action=_Value,
                metavar=metavar,
                nargs="+" if flag.many else None,
                help=help_text,
            )


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence (a period before a capital letter)."""
    match = _SENTENCE_END.search(text)
    return text[: match.start() + 1] if match else text


def flag_values(args: argparse.Namespace) -> tuple[dict[str, object], dict[str, str]]:
    """The settings given as flags, as text, and where each came from (``command line --port``)."""
    given: dict[str, str] = getattr(args, _GIVEN, None) or {}
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for key, option in given.items():
        value = getattr(args, key, None)
        if value is not None:
            values[key], sources[key] = value, f"command line {option}"
    return values, sources


def _note(namespace: argparse.Namespace, key: str, option: str | None) -> None:
    given = getattr(namespace, _GIVEN, None)
    if given is None:
        given = {}
        setattr(namespace, _GIVEN, given)
    if option is not None:
        given[key] = option


class _Value(argparse.Action):
    """Keeps the text as given: ``load_settings`` validates it like an ``-o`` value."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        text = ",".join(values) if isinstance(values, list) else values  # a flag of `many` values
        setattr(namespace, self.dest, text)
        _note(namespace, self.dest, option_string)


class _Switch(argparse.Action):
    """``--name`` sets ``true``, ``--no-name`` sets ``false`` (as text, like ``-o name=true``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        names = [*option_strings, *(f"--no-{name[2:]}" for name in option_strings)]
        super().__init__(names, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, "false" if (option_string or "").startswith("--no-") else "true")
        _note(namespace, self.dest, option_string)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)
