"""Speculative decoding: proposers of draft tokens, and when to ask them.

A decoding request computes, in one step, its last token and up to `num_speculative_tokens` drafts
(`ScheduledTokens.draft_token_ids`); the runner keeps each draft that equals the target's own sample at
its position (engine/runner/persistent_batch.py, `_verify`), so greedy output is token for token that of one
token a step and a sampled stream draws from the target's distribution (rejection sampling with drafts
that put all their mass on one token). The request gets the accepted drafts plus one token.

The drafts come from the executor's side, after a step's sampling (as vLLM v1's model runner proposes):

- `NgramProposer` (``method: ngram``, prompt lookup): the longest n-gram (``prompt_lookup_max`` down to
  ``prompt_lookup_min`` tokens) that ends the request's tokens and occurs earlier in them; the drafts are
  the tokens that followed its latest earlier occurrence. No model, no memory.
- `DraftModelProposer` (``method: draft_model``): a smaller model with the same tokenizer, or the target
  itself quantized to int4/int8 (the self-draft), run greedily over a KV pool of its own (its own block
  tables); each call catches up the tokens it has not computed (the accepted drafts and the new token,
  or the whole prompt of a new request) in one batched forward, then runs one forward a further draft.
  Its KV past what the target kept is written again next time (the rollback costs nothing).

The engine core decides which rows get drafts (`SpeculationPolicy`): the scheduler tells each sampling
row how many drafts to propose after its step (`ScheduledTokens.propose`), the proposer answers in
`StepOutput.drafts`, and the next step verifies them when the pool has the blocks. Speculation turns
itself down when it does not pay: for the whole batch while more than ``disable_by_batch_size`` rows
decode (a step of many rows is no longer bound by reading the weights, so verifying costs real compute),
and for a request whose drafts are rarely accepted (an exponential average below
``min_acceptance_rate``; it is asked again after a pause that doubles each time). The counters follow
vLLM's (`vllm:spec_decode_*`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from lmiserve.core.request import SamplingParams
from lmiserve.engine.core.kv_blocks import BlockPool, BlockTable
from lmiserve.engine.core.step import NewRequest, ScheduledTokens, StepBatch

if TYPE_CHECKING:
    from lmiserve.engine.core.sequence import Sequence
    from lmiserve.engine.core.step import BatchRunner

log = logging.getLogger(__name__)

EMA_WEIGHT = 0.3  # weight of a step's acceptance in a request's running average
MAX_PAUSE = 64  # steps a request with a low acceptance goes without drafts at most before it is tried again


@dataclass(frozen=True)
class SpeculationSettings:
    """The engine's speculative decoding (config/speculative.py validates what users write)."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None  # no drafts while more rows than this decode (None: by device)
    min_acceptance_rate: float = 0.3  # a request's drafts pause while its average acceptance is below it
    draft_name: str | None = None  # the draft model (path, or "<target> as int4"): for /info


class Proposer(Protocol):
    """Drafts for requests after a step: `wants` maps a request to its tokens (prompt and output) and
    the number of drafts wanted; the answer maps requests to their drafts (absent: none)."""

    def propose(self, wants: Mapping[int, tuple[list[int], int]]) -> dict[int, list[int]]: ...

    def forget(self, seq_id: int) -> None: ...


def ngram_drafts(tokens: list[int] | np.ndarray, k: int, nmin: int, nmax: int) -> list[int]:
    """Prompt lookup: for n from `nmax` down to `nmin`, the last n tokens are looked for earlier in
    `tokens`; at the latest earlier occurrence, the (up to) `k` tokens that followed it."""
    seq = np.asarray(tokens, dtype=np.int64)
    size = len(seq)
    for n in range(min(nmax, size - 1), nmin - 1, -1):
        suffix = seq[size - n :]
        # windows starting at 0 .. size-n-1 (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(seq[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return [int(t) for t in seq[start : start + k]]
    return []


class NgramProposer:
    """Drafts by prompt lookup (`ngram_drafts`): no model, no state."""

    def __init__(self, nmin: int, nmax: int) -> None:
        self.nmin, self.nmax = nmin, nmax

    def propose(self, wants: Mapping[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        out = {}
        for seq_id, (tokens, k) in wants.items():
            drafts = ngram_drafts(tokens, k, self.nmin, self.nmax)
            if drafts:
                out[seq_id] = drafts
        return out

    def forget(self, seq_id: int) -> None:
        pass


@dataclass
class _DraftState:
    """One request's KV in the draft model's pool: its block table and the tokens it holds: the
    request's first `confirmed` tokens, then the drafts it was fed back (`fed`). A request's tokens only
    grow, so only the drafts fed back can differ from them."""

    table: BlockTable = field(default_factory=BlockTable)
    confirmed: int = 0
    fed: list[int] = field(default_factory=list)
    sent: int = 0  # blocks of the table the draft runner was told of

    def computed(self, tokens: list[int]) -> int:
        """How many of `tokens` (the request's now) its KV holds, never the last (whose forward gives
        the first draft): the confirmed ones, then the drafts fed back while the request kept them."""
        n, end = self.confirmed, len(tokens) - 1
        for draft in self.fed:
            if n >= end or tokens[n] != draft:
                break
            n += 1
        return min(n, end)


_GREEDY = SamplingParams(max_new_tokens=1 << 30)


class DraftModelProposer:
    """Greedy drafts from a second model (`runner`: a paged batch runner over its own KV pool)."""

    def __init__(self, runner: BatchRunner) -> None:
        if runner.num_blocks is None:
            raise ValueError("a draft model runs over a paged KV pool")
        self.runner = runner
        self.pool = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self._states: dict[int, _DraftState] = {}
        self._finished: list[int] = []  # requests the runner must forget at its next batch

    def forget(self, seq_id: int) -> None:
        if self._release(seq_id):
            self._finished.append(seq_id)  # told to the draft runner with its next batch

    def _release(self, seq_id: int) -> bool:
        """Give the request's blocks back; whether the draft runner knew it."""
        state = self._states.pop(seq_id, None)
        if state is not None:
            self.pool.free(state.table)
        return state is not None

    def propose(self, wants: Mapping[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        batch = StepBatch(finished=self._finished)
        self._finished = []
        chunks: list[ScheduledTokens] = []
        todo: dict[int, int] = {}  # seq_id -> drafts still wanted
        ends: dict[int, int] = {}  # seq_id -> its token count
        for seq_id, (tokens, k) in wants.items():
            state = self._states.get(seq_id)
            fresh = state is None
            if state is None:
                state = _DraftState()
            computed = state.computed(tokens)
            state.table.num_tokens = min(state.table.num_tokens, computed)
            # KV for the uncomputed tokens and the k - 1 drafts fed back; when the pool is full, the
            # requests that are not drafting now give theirs back first
            need = len(tokens) - computed + k - 1
            if not self.pool.allocate(state.table, need):
                idle = [i for i in self._states if i not in wants]
                batch.finished.extend(i for i in idle if self._release(i))
            if not self.pool.allocate(state.table, need):
                if not fresh and self._release(seq_id):  # no room: no drafts now, a new start later
                    batch.finished.append(seq_id)
                continue
            if fresh:
                self._states[seq_id] = state
                batch.new.append(NewRequest(seq_id, [], _GREEDY, None))
            blocks = state.table.blocks
            chunks.append(ScheduledTokens(seq_id, computed, tokens[computed:], blocks[state.sent :], True))
            state.sent = len(blocks)
            state.confirmed, state.fed = len(tokens), []
            todo[seq_id], ends[seq_id] = k, len(tokens)
        # one-token rows decode, longer ones go as chunks (the step contract's order)
        batch.rows = sorted(chunks, key=lambda r: len(r.token_ids) > 1)
        batch.num_decode = sum(1 for r in batch.rows if len(r.token_ids) == 1)
        drafts: dict[int, list[int]] = {seq_id: [] for seq_id in todo}
        while batch.rows or batch.new or batch.finished:
            out = self.runner.execute_batch(batch)
            rows = []
            for row in batch.rows:
                samples = out.samples.get(row.seq_id)
                if not samples:  # failed: the drafts so far; its KV is in doubt, so it starts afresh
                    todo.pop(row.seq_id, None)
                    self.forget(row.seq_id)
                    continue
                token = samples[0].token_id
                drafts[row.seq_id].append(token)
                done = len(drafts[row.seq_id])
                if done < todo[row.seq_id]:
                    rows.append(ScheduledTokens(row.seq_id, ends[row.seq_id] + done - 1, [token], [], True))
            batch = StepBatch(rows=rows, num_decode=len(rows))
        for seq_id, tokens in drafts.items():
            state = self._states.get(seq_id)
            if state is not None:
                state.fed = tokens[:-1]  # the KV now holds the drafts fed back (all but the last)
        return {seq_id: tokens for seq_id, tokens in drafts.items() if tokens}


@dataclass
class SpeculationStats:
    """Counters since start (vLLM's `vllm:spec_decode_*`): drafts verified (rows with drafts), draft
    tokens, accepted draft tokens, and accepted draft tokens by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class SpeculationPolicy:
    """The engine core's side: how many drafts each sampling row asks for, and the counters."""

    def __init__(self, settings: SpeculationSettings) -> None:
        self.settings = settings
        self.stats = SpeculationStats(accepted_per_position=[0] * settings.num_speculative_tokens)
        self.batch_too_large = False  # the last plan decoded more rows than disable_by_batch_size

    def plan(self, decoding: int) -> None:
        """Called once a step with the rows it decodes."""
        limit = self.settings.disable_by_batch_size
        self.batch_too_large = limit is not None and decoding > limit

    def wanted(self, seq: Sequence, decoding: bool = True) -> int:
        """Drafts to propose for `seq` after this step (0: none). A draft model proposes nothing right
        after a prompt (`decoding` False): its first call computes the whole prompt, which would delay
        the first token; it starts at the next step."""
        if self.batch_too_large or seq.grammar is not None:
            return 0
        if not decoding and self.settings.method != "ngram":
            return 0
        if seq.spec_pause > 0:
            seq.spec_pause -= 1
            return 0
        room = seq.params.max_new_tokens - len(seq.output_ids) - 2  # after this step's token, and one more
        limit = seq.draft_limit  # a thinking budget: this step's token may be the block's last free one
        if limit is not None:
            room = min(room, limit - 1)
        return max(0, min(self.settings.num_speculative_tokens, room))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verified row: `accepted` of its `proposed` drafts kept."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted
        for position in range(min(accepted, len(stats.accepted_per_position))):
            stats.accepted_per_position[position] += 1
        rate = accepted / proposed if proposed else 0.0
        seq.spec_acceptance = (
            rate if seq.spec_acceptance is None else (EMA_WEIGHT * rate + (1 - EMA_WEIGHT) * seq.spec_acceptance)
        )
        if seq.spec_acceptance < self.settings.min_acceptance_rate:
            seq.spec_backoff = min(MAX_PAUSE, max(1, 2 * seq.spec_backoff))
            seq.spec_pause = seq.spec_backoff
            seq.spec_acceptance = None  # judged afresh after the pause
        elif rate >= self.settings.min_acceptance_rate:
            seq.spec_backoff = 0

    def describe(self) -> dict[str, object]:
        """What /info and the playground show."""
        s, stats = self.settings, self.stats
        rate = stats.acceptance_rate
        info: dict[str, object] = {
            "method": s.method,
            "num_speculative_tokens": s.num_speculative_tokens,
            "disable_by_batch_size": s.disable_by_batch_size,
            "min_acceptance_rate": s.min_acceptance_rate,
            "active": not self.batch_too_large,
            "reason": (
                f"more than {s.disable_by_batch_size} rows decode (disable_by_batch_size)"
                if self.batch_too_large
                else None
            ),
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": None if rate is None else round(rate, 4),
            "mean_accepted_length": round(1 + stats.num_accepted_tokens / stats.num_drafts, 4)
            if stats.num_drafts
            else None,
            "accepted_per_position": list(stats.accepted_per_position),
        }
        if s.method == "ngram":
            info.update(prompt_lookup_min=s.prompt_lookup_min, prompt_lookup_max=s.prompt_lookup_max)
        else:
            info["model"] = s.draft_name
        return info
