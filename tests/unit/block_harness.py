"""A harness for driving `BlockScheduler` by hand (no torch), shared by the block scheduler's tests.

- `BlockRunner` executes plans over a simulated block pool (each block a list of token ids): before every
  step it checks that each scheduled sequence finds its own tokens ``all_ids[:kv_len]`` through its block
  table, so sharing, eviction and preemption are checked against the KV contents, not only the
  bookkeeping. It samples `next_token` (or its `rule`), reports scripted per-sequence errors (`errors`)
  and can fail a whole decode forward (`fail_decode`).
- `BatchMirror` runs the same steps from the plans' plain-data batches alone, as an executor across a
  process boundary would, and must sample what `BlockRunner` samples.
- `step` runs one schedule/execute/update step with both and checks the pool; `drive` steps until the
  scheduler has no work.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable

from fakes import make_seq

from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.kv_blocks import BlockPool
from lmiserve.engine.core.scheduler import StepPlan
from lmiserve.engine.core.sequence import SeqStatus, Sequence
from lmiserve.engine.core.step import PENDING_TOKEN, SampleResult, StepBatch, StepOutput

# A sampling rule: (seq_id, tokens generated so far) -> the next token id.
TokenRule = Callable[[int, int], int]


def next_token(seq_id: int, generated: int) -> int:
    """The default rule: depends only on the sequence and its length (batching cannot change it), never
    EOS."""
    return 100 + (seq_id * 7 + generated * 3) % 50


def token_rule(seq: Sequence) -> int:
    """`next_token` for `seq` as it is now."""
    return next_token(seq.seq_id, len(seq.output_ids))


class BlockRunner:
    def __init__(self, sched: BlockScheduler, rule: TokenRule = next_token) -> None:
        self.sched = sched
        self.rule = rule
        pool = sched.pool
        self.store: list[list[int | None]] = [[None] * pool.block_size for _ in range(pool.num_blocks)]
        self.steps: list[StepPlan] = []
        self.errors: dict[int, str] = {}  # seq_id -> error to report instead of its next sample
        self.fail_decode: str | None = None  # the next step's decode forward fails for all its rows

    def _check(self, seq: Sequence, upto: int) -> None:
        bs, table = self.sched.pool.block_size, seq.block_table
        assert table is not None
        tokens = seq.all_ids
        for pos in range(upto):
            got = self.store[table.blocks[pos // bs]][pos % bs]
            assert got == tokens[pos], f"seq {seq.seq_id} position {pos}: {got} != {tokens[pos]}"

    def _write(self, seq: Sequence, pos: int) -> None:
        bs, table = self.sched.pool.block_size, seq.block_table
        assert table is not None and pos < table.num_tokens
        self.store[table.blocks[pos // bs]][pos % bs] = seq.all_ids[pos]

    def execute(self, plan: StepPlan) -> StepOutput:
        self.steps.append(plan)
        out = StepOutput()
        seen = set()
        failed, self.fail_decode = self.fail_decode, None
        for seq in plan.decode:
            assert seq.status is SeqStatus.RUNNING and seq.kv_len == len(seq.all_ids) - 1
            self._check(seq, seq.kv_len)
            seen.add(seq.seq_id)
            if failed is not None:
                out.errors[seq.seq_id] = failed
                continue
            self._write(seq, seq.kv_len)
            self._sample(seq, out)
        for chunk in plan.prefill:
            seq = chunk.seq
            assert seq.seq_id not in seen, "a sequence twice in one step"
            seen.add(seq.seq_id)
            assert chunk.start == seq.kv_len and chunk.length > 0
            assert chunk.start + chunk.length <= len(seq.all_ids)
            self._check(seq, chunk.start)
            for pos in range(chunk.start, chunk.start + chunk.length):
                self._write(seq, pos)
            if chunk.completes_prompt:
                self._sample(seq, out)
        return out

    def _sample(self, seq: Sequence, out: StepOutput) -> None:
        if seq.seq_id in self.errors:
            out.errors[seq.seq_id] = self.errors.pop(seq.seq_id)
        else:
            out.samples[seq.seq_id] = [SampleResult(self.rule(seq.seq_id, len(seq.output_ids)), -0.25)]


class BatchMirror:
    """An executor that sees only the plans' plain-data batches (after a pickle round trip, as across a
    process boundary) and keeps its own persistent batch: each request's prompt, sampled tokens and
    block table, learnt by difference. It checks that every position a row reads or writes holds what its
    own view says, and samples the rule from that view, so its samples must equal the plan runner's."""

    def __init__(self, pool: BlockPool, rule: TokenRule = next_token) -> None:
        self.block_size = pool.block_size
        self.rule = rule
        self.store: list[list[int | None]] = [[None] * pool.block_size for _ in range(pool.num_blocks)]
        self.requests: dict[int, tuple[list[int], list[int], list[int]]] = {}  # id -> prompt, output, blocks

    def execute(self, batch: StepBatch) -> dict[int, int]:
        batch = pickle.loads(pickle.dumps(batch))
        for seq_id in batch.finished:
            del self.requests[seq_id]
        for seq_id in batch.preempted:
            self.requests[seq_id][2].clear()
        for new in batch.new:
            assert new.seq_id not in self.requests
            self.requests[new.seq_id] = (list(new.prompt_ids), [], [])
        sampled = {}
        for number, row in enumerate(batch.rows):
            prompt_ids, output, blocks = self.requests[row.seq_id]
            blocks.extend(row.new_blocks)
            tokens = prompt_ids + output
            if row.token_ids == [PENDING_TOKEN]:  # planned ahead of its token's sampling: the last one
                assert number < batch.num_decode and output
                row = dataclasses.replace(row, token_ids=[output[-1]])
            assert row.token_ids == tokens[row.start : row.start + len(row.token_ids)]
            assert number >= batch.num_decode or (len(row.token_ids) == 1 and row.start == len(tokens) - 1)
            bs = self.block_size
            for pos in range(row.start):
                assert self.store[blocks[pos // bs]][pos % bs] == tokens[pos], f"request {row.seq_id} at {pos}"
            for pos in range(row.start, row.start + len(row.token_ids)):
                self.store[blocks[pos // bs]][pos % bs] = tokens[pos]
            assert row.sample == (row.start + len(row.token_ids) == len(tokens))
            if row.sample:
                token = self.rule(row.seq_id, len(output))  # the rule over its own view
                output.append(token)
                sampled[row.seq_id] = token
        return sampled


def step(sched: BlockScheduler, runner: BlockRunner, now: float = 0.0):
    plan, events = sched.schedule(now)
    if not hasattr(runner, "mirror"):
        runner.mirror = BatchMirror(sched.pool, runner.rule)
    assert plan.batch is not None
    mirrored = runner.mirror.execute(plan.batch)
    if plan.has_model_work:
        out = runner.execute(plan)
        assert {i: r[0].token_id for i, r in out.samples.items()} == {i: mirrored[i] for i in out.samples}
        events = events + sched.update(plan, out)
    tables = [s.block_table for s in sched.running if s.block_table is not None]
    sched.pool.check(tables)
    assert len(sched.running) <= sched.max_running
    if sched.max_step_tokens is not None:  # the step's budget holds, decode rows included
        assert step_tokens(plan) <= sched.max_step_tokens, plan
    return plan, events


def step_tokens(plan: StepPlan) -> int:
    """Tokens the step computes: a decode row's token and its drafts, the prompt chunks."""
    drafts = sum(len(d) for d in plan.drafts.values())
    return len(plan.decode) + drafts + sum(c.length for c in plan.prefill)


def drive(sched: BlockScheduler, runner: BlockRunner, limit: int = 10_000, now: float = 0.0):
    events = []
    for _ in range(limit):
        if not sched.has_work():
            mirror = getattr(runner, "mirror", None)
            assert mirror is None or not mirror.requests, "the executor was not told every request finished"
            return events
        events += step(sched, runner, now)[1]
    raise AssertionError("the scheduler did not finish")


def expected_tokens(seq: Sequence, count: int) -> list[int]:
    """What `token_rule` yields for `seq` over `count` tokens, whatever the batch."""
    probe = make_seq(list(seq.prompt_ids), max_new_tokens=count, ignore_eos_token=True, seq_id=seq.seq_id)
    out = []
    for _ in range(count):
        out.append(token_rule(probe))
        probe.output_ids.append(out[-1])
    return out


def prompt(n: int, base: int = 10) -> list[int]:
    return [base + i % 80 for i in range(n)]


def start_decoding(sched: BlockScheduler, runner: BlockRunner, count: int) -> list[Sequence]:
    """`count` short sequences, decoding (their prompts computed, a token sampled)."""
    seqs = [make_seq(prompt(4, 20 + i), max_new_tokens=50, ignore_eos_token=True) for i in range(count)]
    for seq in seqs:
        sched.add(seq)
    while any(seq.status is not SeqStatus.RUNNING for seq in seqs):
        step(sched, runner)
    return seqs
