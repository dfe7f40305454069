"""The servers under test of one `lmiserve bench` run: the lmiserve it measures (started or reached),
its second lmiserve (--ab-option, --lora) and the OpenAI-compatible servers it compares (--compare-url),
each with its completion and chat dialect."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from lmiserve.bench.chat import ChatDialect
from lmiserve.bench.clients import Dialect, LmiDialect, OpenAIDialect
from lmiserve.bench.config import BenchConfig, hidden_options


@dataclass
class Target:
    """One server under test: its completion dialect (LMI or OpenAI completions) and its chat dialect."""

    name: str
    completion: Dialect
    chat: ChatDialect
    started_by_bench: bool = False
    ab: bool = False  # the second lmiserve of --ab-option


def compare_targets(config: BenchConfig) -> list[Target]:
    out = []
    for name, url in config.compare:
        base = url.rstrip("/").removesuffix("/v1")
        name = name or urlsplit(base).netloc or base
        out.append(
            Target(
                name=name,
                completion=OpenAIDialect(url=base, name=name, model=config.compare_model, api_key=config.api_key),
                chat=ChatDialect(url=base, name=name, model=config.compare_model, api_key=config.api_key),
            )
        )
    return out


def lmiserve_target(
    url: str, name: str, started_by_bench: bool, ab: bool = False, api_key: str | None = None
) -> Target:
    return Target(
        name=name,
        completion=LmiDialect(url=url, name=name, api_key=api_key),
        chat=ChatDialect(url=url, name=name, api_key=api_key),
        started_by_bench=started_by_bench,
        ab=ab,
    )


def lora_name(config: BenchConfig) -> str:
    return f"lmiserve[{config.lora} LoRA adapters, rank {config.lora_rank}, {config.lora_targets}]"


def ab_name(options: list[tuple[str, str]]) -> str:
    return "lmiserve[" + ",".join(f"{k}={v}" for k, v in hidden_options(options).items()) + "]"
