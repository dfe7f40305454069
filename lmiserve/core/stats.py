"""What a generative engine tells about its work, for whoever watches it (metrics, logs).

The engine knows nothing of HTTP or of a metrics library: it calls an `EngineObserver` at four
moments (a request refused at submission, a request accepted, a step run, a request ended) with plain
values, and answers `snapshot()` with its live state. All times are ``time.monotonic()`` seconds.
Each request is reported once, whatever protocol carried it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from lmiserve.core.events import FinishReason

StepMethod = Literal["prefill", "decode"]


@dataclass(frozen=True)
class SequenceStats:
    """One sequence of a request, when the request ended."""

    arrival: float  # submitted to the engine
    scheduled: float | None  # admitted into the running batch (None: never left the queue)
    first_token: float | None  # its first generated token was produced
    finished: float  # ended (finished, failed or aborted)
    prompt_tokens: int
    generated_tokens: int
    max_new_tokens: int
    reason: FinishReason  # ABORT when the client went away, ERROR when it failed
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied

    @property
    def queue_time(self) -> float:
        return (self.scheduled if self.scheduled is not None else self.finished) - self.arrival


@dataclass(frozen=True)
class RequestStats:
    """One request, when its last sequence ended (or it failed before any could run)."""

    arrival: float
    finished: float
    prompt_tokens: int
    sequences: tuple[SequenceStats, ...]
    error: BaseException | None = None  # why it failed before its sequences could end (queue timeout, shutdown)

    @property
    def succeeded(self) -> bool:
        ok = (FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE)
        return self.error is None and all(s.reason in ok for s in self.sequences)


@dataclass(frozen=True)
class StepStats:
    """One model step: a forward pass over the running batch."""

    method: StepMethod  # "prefill" when the step carried prompt tokens, else "decode"
    duration: float  # seconds the forward pass (and sampling) took
    rows: int  # sequences in the step (decode rows + prefill chunks)
    prompt_tokens: int  # prompt tokens prefilled in this step
    generated_tokens: int  # tokens sampled in this step
    first_token_latencies: tuple[float, ...]  # per sequence whose first token came: time since submission
    inter_token_latencies: tuple[float, ...]  # per token that was not its sequence's first: time since the previous
    prefix_queried_tokens: int = 0  # prompt tokens of sequences admitted for this step, looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which the cache supplied (not in prompt_tokens: they were not computed)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's live state."""

    running: int  # sequences in the running batch
    waiting: int  # sequences queued for a place in it
    batch_max_tokens: int  # tokens the running batch may reach (prompt + max_new_tokens of each sequence)
    kv_tokens: int  # positions held in the KV cache by the running sequences
    kv_capacity: int  # positions the KV cache can hold (batch slots x context length)
    batch_slots: int  # sequences the running batch may hold
    generated_tokens: int  # tokens generated since the engine started (a rate is its change over time)
    prefix_cache_tokens: int = 0  # tokens whose KV the prefix cache holds
    prefix_cache_capacity: int = 0  # tokens it can hold (0: no prefix cache)
    prefix_cache_bytes: int = 0  # the memory its blocks take at most
    preemptions: int = 0  # running sequences preempted since the engine started (their KV freed, recomputed later)
    kv_blocks: int = 0  # the paged KV pool's blocks (0: the slot layout, no pool)
    kv_block_size: int = 0  # tokens a block
    # speculative decoding's settings, state and counters (engine/speculative/proposers.py, `describe`); None: off
    speculation: dict[str, Any] | None = None
    # LoRA (engine/lora/registry.py): the adapters of the running and of the waiting sequences, by name
    # (sorted, each once), and max_loras (0: the model serves no adapters)
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0
    model_steps: int = 0  # model steps run since the engine started (its warm-up not counted)
    steps_planned_ahead: int = 0  # of which planned while the step before them ran (overlap scheduling)

    @property
    def prefix_cache_usage(self) -> float:
        return self.prefix_cache_tokens / self.prefix_cache_capacity if self.prefix_cache_capacity else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_tokens / self.kv_capacity if self.kv_capacity else 0.0


class EngineObserver(Protocol):
    def on_rejected(self, error: BaseException) -> None:
        """A request was refused at submission (invalid, queue full); it never ran."""
        ...

    def on_submitted(self, prompt_tokens: int, sequences: int) -> None:
        """A request was accepted into the queue."""
        ...

    def on_step(self, step: StepStats) -> None:
        """A model step ran."""
        ...

    def on_finished(self, request: RequestStats) -> None:
        """A request accepted earlier ended: finished, failed or aborted."""
        ...


_log = logging.getLogger("lmiserve.engine")


def notify(observers: Iterable[EngineObserver], method: str, *args: object) -> None:
    """Call `method` of each observer; one that fails is logged and must not fail requests or the engine."""
    for observer in observers:
        try:
            getattr(observer, method)(*args)
        except Exception:  # noqa: BLE001 - a failing observer must not fail requests or the loop
            _log.exception("engine observer %s.%s failed", type(observer).__name__, method)


def tell_failure(listeners: Iterable[Callable[[str], None]], why: str) -> None:
    """Tell each `on_failure` listener why the engine failed; one that fails does not hide it from the others."""
    for listener in listeners:
        try:
            listener(why)
        except Exception:  # noqa: BLE001 - a listener must not hide the failure from the others
            _log.exception("engine failure listener failed")
