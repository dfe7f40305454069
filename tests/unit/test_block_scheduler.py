"""The block scheduler as a pure state machine (no torch), driven with a fake runner over a simulated
block pool: each block is a list of token ids. Before every step the runner checks that every scheduled
sequence finds its own tokens ``all_ids[:kv_len]`` through its block table, so sharing, eviction and
preemption are checked against the KV contents, not only the bookkeeping (the runner and the step
helpers are in block_harness.py; the request lifecycle is in test_block_scheduler_lifecycle.py)."""

from __future__ import annotations

import random

import pytest
from block_harness import BlockRunner, drive, expected_tokens, prompt, start_decoding, step, step_tokens
from fakes import make_seq

from lmiserve.core.events import FinishReason
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.kv_blocks import BlockPool
from lmiserve.engine.core.sequence import Sequence


def test_sequences_finish_and_every_block_comes_back():
    sched = BlockScheduler(BlockPool(64, 4), max_running=3, max_prefill_tokens=8)
    runner = BlockRunner(sched)
    seqs = [make_seq(prompt(n), max_new_tokens=m, ignore_eos_token=True) for n, m in ((5, 3), (9, 6), (2, 1), (13, 4))]
    for seq in seqs:
        sched.add(seq)
    drive(sched, runner)
    for seq in seqs:
        assert seq.finished and seq.output_ids == expected_tokens(seq, seq.params.max_new_tokens)
    assert sched.pool.num_used_blocks == 0 and not sched.running and not sched.waiting


def test_a_long_prompt_shares_steps_with_a_short_one_arriving_after_it():
    """The slot scheduler prefilled prompts strictly one after another; here a short prompt behind a
    long one gets its first token in the next step, its chunk beside the long prompt's."""
    sched = BlockScheduler(BlockPool(256, 16), max_running=8, max_prefill_tokens=64)
    runner = BlockRunner(sched)
    long, short = make_seq(prompt(600), max_new_tokens=2), make_seq(prompt(6, 20), max_new_tokens=2)
    sched.add(long)
    step(sched, runner)
    sched.add(short)
    _, events = step(sched, runner)
    assert any(seq is short and ev.token is not None for seq, ev in events)
    assert long.kv_len < long.prompt_len  # still prefilling
    drive(sched, runner)
    assert long.finished and short.finished


def test_decoding_rows_come_first_and_prompt_chunks_fill_the_rest_of_the_budget():
    sched = BlockScheduler(BlockPool(256, 16), max_running=8, max_prefill_tokens=20, prefill_floor=None)
    runner = BlockRunner(sched)
    first = make_seq(prompt(4), max_new_tokens=50, ignore_eos_token=True)
    sched.add(first)
    step(sched, runner)
    waiting = [make_seq(prompt(15, 30 + i), max_new_tokens=2) for i in range(3)]
    for seq in waiting:
        sched.add(seq)
    plan, _ = step(sched, runner)
    assert plan.decode == [first]
    assert [(c.seq, c.start, c.length) for c in plan.prefill] == [(waiting[0], 0, 15), (waiting[1], 0, 5)]
    plan, _ = step(sched, runner)
    assert [(c.seq, c.start, c.length) for c in plan.prefill] == [(waiting[1], 5, 10), (waiting[2], 0, 10)]


@pytest.mark.parametrize(("budget", "prefill", "chunk"), [(10, 64, 6), (40, 64, 36), (40, 5, 5), (None, 20, 20)])
def test_a_step_budget_counts_every_decode_row_and_prompt_chunks_take_the_rest(budget, prefill, chunk):
    """vLLM's max_num_batched_tokens: a step of N decode rows and a long prompt takes at most budget - N
    prompt tokens; max_prefill_tokens still bounds the prompt side (the stricter wins); without a step
    budget the prompt side is max_prefill_tokens, as before."""
    sched = BlockScheduler(
        BlockPool(512, 16), max_running=8, max_prefill_tokens=prefill, prefill_floor=None, max_step_tokens=budget
    )
    runner = BlockRunner(sched)
    decoding = start_decoding(sched, runner, 4)
    long = make_seq(prompt(600, 40), max_new_tokens=2, ignore_eos_token=True)
    sched.add(long)
    for _ in range(3):  # admitted, then prefilled chunk by chunk beside the four decode rows
        plan, _ = step(sched, runner)
        assert plan.decode == decoding
        assert [(c.seq, c.length) for c in plan.prefill] == [(long, chunk)]
    drive(sched, runner)
    assert long.output_ids == expected_tokens(long, 2)
    for seq in decoding:
        assert seq.output_ids == expected_tokens(seq, 50)


def test_with_a_step_budget_a_prompt_alone_takes_the_whole_budget():
    sched = BlockScheduler(BlockPool(512, 16), max_running=8, max_prefill_tokens=2048, max_step_tokens=100)
    runner = BlockRunner(sched)
    long = make_seq(prompt(300), max_new_tokens=1)
    sched.add(long)
    plan, _ = step(sched, runner)
    assert not plan.decode and [c.length for c in plan.prefill] == [100]


def test_drafts_count_in_the_step_budget():
    """A decode row verifying drafts computes its token and its drafts: they count in the budget, cut
    to what it leaves (every row keeps its own token); a prompt then gets only what remains."""
    sched = BlockScheduler(BlockPool(512, 16), max_running=8, max_prefill_tokens=64, max_step_tokens=7)
    runner = BlockRunner(sched)
    decoding = start_decoding(sched, runner, 4)
    sched.add(make_seq(prompt(100, 40), max_new_tokens=2))
    sched.proposer = lambda seq: [1, 2, 3, 4, 5]
    plan, _ = sched.schedule(0.0)
    assert plan.decode and set(plan.decode) == set(decoding)
    assert sum(len(d) for d in plan.drafts.values()) == 3  # 7 - 4 rows
    assert not plan.prefill  # the decode rows and their drafts fill the step
    assert step_tokens(plan) == 7


def test_preemption_when_the_pool_runs_out_keeps_every_stream_unchanged():
    """Four sequences whose KV together is twice the pool: all finish, each with the tokens it makes
    alone; the latest arrivals are preempted and recompute their tokens."""
    sched = BlockScheduler(BlockPool(8, 4), max_running=4, max_prefill_tokens=64)
    runner = BlockRunner(sched)
    seqs = [make_seq(prompt(6, 10 + i), max_new_tokens=10, ignore_eos_token=True, arrival=i) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    events = drive(sched, runner)
    assert sched.num_preemptions > 0
    assert seqs[0].preemptions == 0  # the earliest arrival is never the victim
    for seq in seqs:
        streamed = [ev.token.id for s, ev in events if s is seq and ev.token is not None]
        assert streamed == seq.output_ids == expected_tokens(seq, 10)
    assert sched.pool.num_used_blocks == 0


def test_preemption_victim_is_the_highest_priority_value_then_the_latest_arrival():
    sched = BlockScheduler(BlockPool(6, 4), max_running=3, max_prefill_tokens=64)
    runner = BlockRunner(sched)
    urgent = make_seq(prompt(7), max_new_tokens=9, ignore_eos_token=True, arrival=3.0)
    urgent.priority = -1
    normal = make_seq(prompt(7, 40), max_new_tokens=9, ignore_eos_token=True, arrival=1.0)
    late = make_seq(prompt(7, 60), max_new_tokens=9, ignore_eos_token=True, arrival=2.0)
    for seq in (normal, late, urgent):
        sched.add(seq)
    drive(sched, runner)
    assert urgent.preemptions == 0 and late.preemptions >= 1
    assert late.preemptions >= normal.preemptions
    for seq in (urgent, normal, late):
        assert seq.output_ids == expected_tokens(seq, 9)


def test_a_request_larger_than_the_pool_never_fits():
    sched = BlockScheduler(BlockPool(4, 16))
    assert sched.never_fits(65) and not sched.never_fits(64)


def test_a_prompt_starts_from_the_cached_blocks_of_an_earlier_one_without_copying():
    sched = BlockScheduler(BlockPool(32, 4), max_running=4)
    runner = BlockRunner(sched)
    shared = prompt(14)
    first = make_seq([*shared, 90], max_new_tokens=2)
    sched.add(first)
    drive(sched, runner)
    second = make_seq([*shared, 91, 92], max_new_tokens=2)
    sched.add(second)
    plan, _ = step(sched, runner)
    assert second.cached_tokens == 12  # three full blocks of four
    assert [(c.start, c.length) for c in plan.prefill] == [(12, 4)]
    assert plan.prefix_queried == 16 and plan.prefix_hits == 12
    drive(sched, runner)
    assert second.output_ids == expected_tokens(second, 2)


def test_requests_with_another_cache_salt_share_nothing():
    sched = BlockScheduler(BlockPool(32, 4), max_running=4)
    runner = BlockRunner(sched)
    first = make_seq(prompt(13), max_new_tokens=1)
    first.cache_salt = "tenant-a"
    sched.add(first)
    drive(sched, runner)
    other = make_seq(prompt(13), max_new_tokens=1)
    other.cache_salt = "tenant-b"
    same = make_seq(prompt(13), max_new_tokens=1)
    same.cache_salt = "tenant-a"
    sched.add(other)
    sched.add(same)
    drive(sched, runner)
    assert other.cached_tokens == 0 and same.cached_tokens == 12


def test_siblings_start_from_the_first_ones_prompt():
    sched = BlockScheduler(BlockPool(64, 4), max_running=4, max_prefill_tokens=64)
    runner = BlockRunner(sched)
    siblings = [make_seq(prompt(18), max_new_tokens=3, request_id="r", index=i) for i in range(3)]
    for seq in siblings:
        sched.add(seq)
    plan, _ = step(sched, runner)
    assert [c.seq for c in plan.prefill] == [siblings[0]]
    plan, _ = step(sched, runner)
    assert [(c.seq, c.start, c.length) for c in plan.prefill] == [(siblings[1], 16, 2), (siblings[2], 16, 2)]
    drive(sched, runner)
    assert all(s.finished for s in siblings)


def test_abort_and_errors_give_the_blocks_back():
    sched = BlockScheduler(BlockPool(32, 4), max_running=4)
    runner = BlockRunner(sched)
    a, b, c = (make_seq(prompt(9, 10 * i), max_new_tokens=20, ignore_eos_token=True) for i in range(1, 4))
    for seq in (a, b, c):
        sched.add(seq)
    step(sched, runner)
    sched.abort(a)
    runner.errors[b.seq_id] = "boom"
    _, events = step(sched, runner)
    reasons = {s.seq_id: ev.finish.reason for s, ev in events if ev.finish is not None}
    assert reasons == {a.seq_id: FinishReason.ABORT, b.seq_id: FinishReason.ERROR}
    assert sched.running == [c]
    assert sched.pool.num_used_blocks == len(c.block_table.blocks)


def test_waiting_queue_follows_priority_then_arrival():
    sched = BlockScheduler(BlockPool(64, 4), max_running=1)
    runner = BlockRunner(sched)
    seqs = [make_seq(prompt(3), max_new_tokens=1, arrival=float(i)) for i in range(4)]
    for seq, priority in zip(seqs, (2, 0, -1, 0), strict=True):
        seq.priority = priority
        sched.add(seq)
    order = []
    while sched.has_work():
        plan, _ = step(sched, runner)
        order += [c.seq for c in plan.prefill]
    assert order == [seqs[2], seqs[1], seqs[3], seqs[0]]


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_with_a_small_pool_keeps_contents_and_streams_right(seed: int):
    rng = random.Random(seed)
    pool = BlockPool(rng.choice([12, 20, 40]), rng.choice([2, 4, 8]), enable_prefix_caching=rng.random() < 0.7)
    sched = BlockScheduler(pool, max_running=rng.choice([2, 4, 6]), max_prefill_tokens=rng.choice([4, 9, 32]))
    # a step budget (max_num_batched_tokens) on half the seeds, drawn apart so the traffic stays the same
    sched.max_step_tokens = random.Random(-seed).choice([None, sched.max_running + 1, 2 * sched.max_running, 20])
    runner = BlockRunner(sched)
    heads = [prompt(rng.randint(1, 12), rng.randint(10, 30)) for _ in range(3)]
    seqs: list[Sequence] = []
    events = []
    for tick in range(400):
        if len(seqs) < 30 and rng.random() < 0.3:
            ids = rng.choice(heads) + prompt(rng.randint(1, 6), rng.randint(40, 60))
            new = rng.randint(1, 8)
            if not sched.never_fits(len(ids) + new):
                seq = make_seq(ids, max_new_tokens=new, ignore_eos_token=True, arrival=float(tick))
                seq.priority = rng.choice([0, 0, 1, -1])
                seqs.append(seq)
                sched.add(seq)
        if sched.running and rng.random() < 0.03:
            sched.abort(rng.choice(sched.running))
        if sched.has_work():
            events += step(sched, runner, float(tick))[1]
    events += drive(sched, runner)
    for seq in seqs:
        assert seq.finished
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.output_ids == expected_tokens(seq, seq.params.max_new_tokens)
        streamed = [ev.token.id for s, ev in events if s is seq and ev.token is not None]
        assert streamed == seq.output_ids
    assert pool.num_used_blocks == 0
