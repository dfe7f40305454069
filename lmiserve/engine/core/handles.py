"""A submitted request as the engine keeps it (`RequestHandle`: its sequences and the queue their events
arrive on), and the figures and rankings made of its sequences."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request import GenerationRequest
from lmiserve.core.stats import RequestStats, SequenceStats
from lmiserve.engine.core.scheduler import StepPlan
from lmiserve.engine.core.sequence import Sequence
from lmiserve.engine.core.step import StepOutput
from lmiserve.engine.lora.adapters import LoraAdapter


class RequestHandle:
    """One submitted request: its sequences and the queue their events (or its error) arrive on."""

    def __init__(self, request: GenerationRequest, seqs: list[Sequence], arrival: float) -> None:
        self.request = request
        self.seqs = seqs
        self.queue: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
        self.open = len(seqs)  # sequences whose end the consumer has not read yet
        self.arrival = arrival
        self.unfinished = len(seqs)  # sequences whose end the engine has not delivered yet
        self.reported = False  # told the observers it ended
        self.stats: RequestStats | None = None  # its figures, once it ended
        self.adapter: LoraAdapter | None = None  # its LoRA adapter, held until it ended
        self.held: dict[int, list[StepEvent]] = {}  # per sequence, events kept for its next write (stream_interval)

    def offer(self, seq_id: int, event: StepEvent, interval: int, more: bool = False) -> None:
        """A sequence's unfinished `event`: delivered with the ones held before it, or (`interval` > 1) held
        to go with its next ones, unless it is the sequence's first token (at once: the time to first token
        is not the interval's) or it completes a group of `interval` tokens."""
        if interval <= 1 and not more:  # (held events come only with an interval)
            self.queue.put_nowait(event)
            return
        if interval > 1:
            held = self.held.get(seq_id)
            if held is None:
                self.held[seq_id] = []
            elif len(held) + 1 < interval:
                held.append(event)
                return
            more = False  # the sequence's next event is held: it goes with a later one
        self.deliver(seq_id, event, more)

    def deliver(self, seq_id: int, event: StepEvent, more: bool = False) -> None:
        """Put `event` on the queue after the sequence's held events; every event but the last of them says
        `burst` (with `more`, `event` too: the caller delivers more of the sequence's at once)."""
        self._release(self.held.get(seq_id))
        self.queue.put_nowait(replace(event, burst=True) if more else event)

    def fail(self, error: BaseException) -> None:
        """End the request with `error`, after the events it held (the tokens a client gets before it)."""
        for held in self.held.values():
            self._release(held)
        self.queue.put_nowait(error)

    def _release(self, held: list[StepEvent] | None) -> None:
        """Queue a sequence's held events, each saying `burst` (what the caller queues next ends the write)."""
        if held:
            for kept in held:
                self.queue.put_nowait(replace(kept, burst=True))
            held.clear()


def prompt_tokens_computed(plan: StepPlan, output: StepOutput) -> int:
    """Prompt tokens the step computed for the first time (a preempted sequence's recompute, and the
    generated tokens a recompute includes, are not prompt tokens processed again)."""
    total = 0
    for chunk in plan.prefill:
        seq = chunk.seq
        if seq.seq_id in output.errors:
            continue
        start, end = max(chunk.start, seq.prompt_counted), min(chunk.start + chunk.length, seq.prompt_len)
        if end > start:
            total += end - start
            seq.prompt_counted = end
    return total


def request_stats(handle: RequestHandle, now: float, error: BaseException | None) -> RequestStats:
    """`handle`'s request as the observers see it when it ends (a sequence not ended yet ends `now`)."""
    fallback = FinishReason.ABORT if error is None else FinishReason.ERROR
    sequences = tuple(
        SequenceStats(
            arrival=handle.arrival,
            scheduled=seq.scheduled_at,
            first_token=seq.first_token_at,
            finished=seq.finished_at if seq.finished_at is not None else now,
            prompt_tokens=seq.prompt_len,
            generated_tokens=len(seq.output_ids),
            max_new_tokens=seq.params.max_new_tokens,
            reason=seq.finish_reason if seq.finish_reason is not None else fallback,
            cached_tokens=seq.cached_tokens,
        )
        for seq in handle.seqs
    )
    prompt_tokens = handle.seqs[0].prompt_len if handle.seqs else 0
    return RequestStats(handle.arrival, now, prompt_tokens, sequences, error)


def random_seed() -> int:
    """A random non-negative signed 32-bit seed, drawn per request when the client gives none."""
    return random.SystemRandom().randrange(0, 2**31)


def mean_logprob(seq: Sequence) -> float:
    """The one best-of rule, every protocol's: the highest log probability per generated token (OpenAI's
    `best_of` and TGI's); a sequence without a token ranks last."""
    return seq.cumulative_logprob / len(seq.output_ids) if seq.output_ids else float("-inf")


def reindex(event: StepEvent, index: int) -> StepEvent:
    return StepEvent(token=event.token, top_tokens=event.top_tokens, finish=event.finish, index=index)


def adapter_names(seqs: Iterable[Any]) -> tuple[str, ...]:
    """The adapters of `seqs` by name, sorted, each once (vLLM's lora_requests_info)."""
    return tuple(sorted({s.adapter.name for s in list(seqs) if s.adapter is not None}))


def stamp_events(events: list[tuple[Sequence, StepEvent]], now: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Record when each sequence got a token or ended; this step's times to first token and
    inter-token latencies."""
    firsts, gaps = [], []
    for seq, event in events:
        if event.token is not None:
            if seq.last_token_at is None:
                seq.first_token_at = now
                firsts.append(now - seq.arrival)
            else:
                gaps.append(now - seq.last_token_at)
            seq.last_token_at = now
        if event.finish is not None:
            seq.finished_at = now
    return tuple(firsts), tuple(gaps)
