"""A request's life in the block scheduler: admission, chunked prefill, the first token, abort in every
state, errors, static batching, the queue timeout and a step's prompt budget while others decode.

Driven by hand with block_harness.py's runner (no torch), which checks every scheduled sequence's KV
contents through its block table before each step, and its executor mirror of the plain-data batches.
"""

from __future__ import annotations

import random

import pytest
from block_harness import BlockRunner, drive, expected_tokens, next_token, prompt, start_decoding, step
from fakes import EOS, FakeTokenizer, make_seq

from lmiserve.core.events import FinishReason
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.kv_blocks import BlockPool
from lmiserve.engine.core.sequence import SeqStatus


def scheduler(max_running: int = 32, max_prefill_tokens: int = 2048, blocks: int = 256, **options) -> BlockScheduler:
    return BlockScheduler(BlockPool(blocks, 4), max_running, max_prefill_tokens, **options)


def finishes(events):
    return {seq.seq_id: ev.finish for seq, ev in events if ev.finish is not None}


def holds_no_blocks(seq) -> bool:
    return seq.block_table is None or not seq.block_table.blocks


# --- admission -----------------------------------------------------------------------------------


def test_admission_is_fifo_up_to_max_running_and_a_finished_sequence_frees_room():
    sched = scheduler(max_running=2)
    runner = BlockRunner(sched)
    seqs = [make_seq(prompt(3, 10 + 10 * i), max_new_tokens=n) for i, n in enumerate((2, 5, 3, 3))]
    for s in seqs:
        sched.add(s)
    assert all(s.status is SeqStatus.WAITING for s in seqs)

    plan, events = step(sched, runner)  # prefill both admitted prompts, first token each
    assert events and not finishes(events)
    assert [c.seq for c in plan.prefill] == seqs[:2]
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    assert [s.status for s in seqs] == [SeqStatus.RUNNING, SeqStatus.RUNNING, SeqStatus.WAITING, SeqStatus.WAITING]

    plan, events = step(sched, runner)  # second token: seqs[0] reaches max_new_tokens=2
    assert plan.decode == seqs[:2]
    assert finishes(events)[seqs[0].seq_id].reason is FinishReason.LENGTH
    assert sched.running == [seqs[1]] and holds_no_blocks(seqs[0])
    assert list(sched.waiting) == seqs[2:]  # admission happens at the next schedule, not in update

    plan, _ = step(sched, runner)
    assert plan.released == [seqs[0]]
    assert [c.seq for c in plan.prefill] == [seqs[2]] and plan.decode == [seqs[1]]
    assert sched.running == [seqs[1], seqs[2]] and list(sched.waiting) == [seqs[3]]

    events = drive(sched, runner)
    assert set(finishes(events)) == {seqs[1].seq_id, seqs[2].seq_id, seqs[3].seq_id}
    assert all(s.finished and holds_no_blocks(s) for s in seqs)
    assert not sched.running and not sched.waiting and not sched.has_work()
    assert sched.pool.num_used_blocks == 0


def test_admission_order_follows_arrival_when_room_frees_up_one_by_one():
    sched = scheduler(max_running=1)
    runner = BlockRunner(sched)
    seqs = [make_seq(prompt(2 + i, 10 + 10 * i), max_new_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    admitted = []
    for _ in range(50):
        if not sched.has_work():
            break
        step(sched, runner)
        for s in sched.running:
            if s not in admitted:
                admitted.append(s)
    assert admitted == seqs
    assert all(len(s.output_ids) == 2 for s in seqs)


def test_idle_scheduler_plans_nothing():
    sched = scheduler()
    plan, events = sched.schedule(0.0)
    assert not plan.has_model_work and not events and not sched.has_work()
    assert sched.next_wakeup(0.0) is None


# --- randomized lifecycle ------------------------------------------------------------------------


def eos_rule(seq_id: int, generated: int) -> int:
    """`next_token`, but now and then EOS."""
    return EOS if (seq_id * 31 + generated * 17) % 23 == 0 else next_token(seq_id, generated)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("chunked", [True, False])
def test_random_lifecycle_every_sequence_ends_once_with_its_stream_in_order(seed: int, chunked: bool):
    """Random arrivals, aborts in any state (waiting, preempted, prefilling, decoding), per-sequence errors,
    failed decode forwards, EOS and length limits over a pool small enough to preempt: sequences are first
    admitted in arrival order, every one gets exactly one final event, last, whose text and token count
    are its streamed tokens', and every block comes back (KV contents: the random traffic test of
    test_block_scheduler.py)."""
    rng = random.Random(seed)
    budget = 24
    pool = BlockPool(40, 4, enable_prefix_caching=seed % 2 == 0)
    sched = BlockScheduler(pool, max_running=5, max_prefill_tokens=budget, chunked_prefill=chunked)
    runner = BlockRunner(sched, eos_rule)
    tokenizer = FakeTokenizer()
    all_seqs = []
    events_of: dict[int, list] = {}
    admitted_order: list[int] = []
    never_admitted_aborts: set[int] = set()
    now = 0.0

    for tick in range(400):
        now += 0.01
        if tick < 320:
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3])):
                ids = prompt(rng.randint(1, 60), base=rng.choice([10, 11]) if seed % 2 == 0 else rng.randrange(10, 90))
                new = rng.randint(1, 25)
                if sched.never_fits(len(ids) + new):
                    continue
                s = make_seq(ids, tokenizer=tokenizer, max_new_tokens=new, arrival=now)
                sched.add(s)
                all_seqs.append(s)
                events_of[s.seq_id] = []
        live = [s for s in all_seqs if not s.finished and not s.abort_requested]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            if victim.seq_id not in admitted_order:
                never_admitted_aborts.add(victim.seq_id)
            sched.abort(victim)
        if sched.running and rng.random() < 0.03:
            runner.errors[rng.choice(sched.running).seq_id] = "boom"
        if sched.running and rng.random() < 0.01:
            runner.fail_decode = "decode failed"

        plan, step_events = step(sched, runner, now)
        if chunked:
            assert sum(c.length for c in plan.prefill) <= budget
        else:  # a prompt is computed in one chunk (from its cached head), which samples
            assert all(row.sample for row in plan.batch.rows[len(plan.decode) :])
        for s in [*plan.decode, *(c.seq for c in plan.prefill)]:  # admitted ones last, in admission order
            if s.seq_id not in admitted_order:
                admitted_order.append(s.seq_id)
        for seq, ev in step_events:
            events_of[seq.seq_id].append(ev)
        if tick >= 320 and not sched.has_work():
            break

    for seq, ev in drive(sched, runner, now=now):  # drain anything left
        events_of[seq.seq_id].append(ev)
    assert not sched.has_work()
    expected = [s.seq_id for s in all_seqs if s.seq_id not in never_admitted_aborts]
    assert admitted_order == expected[: len(admitted_order)]
    reasons = set()
    for s in all_seqs:
        evs = events_of[s.seq_id]
        assert s.finished and holds_no_blocks(s)
        assert evs, f"seq {s.seq_id} got no event"
        assert [e.finish is not None for e in evs] == [False] * (len(evs) - 1) + [True], "one final event, last"
        fin = evs[-1].finish
        reasons.add(fin.reason)
        tokens = [e.token for e in evs if e.token is not None]
        assert [t.id for t in tokens] == s.output_ids
        assert "".join(t.text for t in tokens) == fin.generated_text
        assert fin.generated_tokens == len(s.output_ids)
        if fin.reason is FinishReason.LENGTH:
            assert len(s.output_ids) == s.params.max_new_tokens
        if fin.reason is FinishReason.EOS_TOKEN:
            assert s.output_ids[-1] == EOS
        if fin.reason is FinishReason.ERROR:
            assert fin.error in ("boom", "decode failed")
    assert {FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.ABORT, FinishReason.ERROR} <= reasons
    assert sched.num_preemptions > 0
    assert pool.num_used_blocks == 0
    assert len(all_seqs) > 100


# --- chunked prefill ------------------------------------------------------------------------------


def test_long_prompts_are_chunked_while_running_sequences_keep_decoding():
    sched = scheduler(max_running=4, max_prefill_tokens=16)
    runner = BlockRunner(sched)
    short = make_seq(prompt(4), max_new_tokens=100)
    sched.add(short)
    step(sched, runner)
    assert short.status is SeqStatus.RUNNING

    long_a = make_seq(prompt(40, 30), max_new_tokens=3)
    long_b = make_seq(prompt(20, 50), max_new_tokens=3)
    sched.add(long_a)
    sched.add(long_b)
    chunks = []
    for _ in range(7):
        plan, _ = step(sched, runner)
        assert plan.decode[0] is short  # decoding never pauses for a prefill
        assert sum(c.length for c in plan.prefill) <= 16
        chunks.append([(c.seq, c.start, c.length) for c in plan.prefill])
    assert chunks[:5] == [
        [(long_a, 0, 16)],  # alone: the whole budget
        [(long_a, 16, 8), (long_b, 0, 8)],  # while another prompt waits, a running one takes half
        [(long_a, 24, 8), (long_b, 8, 4)],  # while several run, each half of what is left
        [(long_a, 32, 8), (long_b, 12, 4)],  # long_a completes
        [(long_b, 16, 4)],  # long_b completes
    ]
    assert chunks[5] == chunks[6] == []
    assert len(long_a.output_ids) == 3 and long_a.finished  # tokens from its last chunk onwards
    assert len(long_b.output_ids) == 3 and long_b.finished


def test_first_token_is_sampled_only_when_the_prompt_completes():
    sched = scheduler(max_prefill_tokens=5)
    runner = BlockRunner(sched)
    seq = make_seq(prompt(12), max_new_tokens=2)
    sched.add(seq)
    for expected_kv in (5, 10):
        _, events = step(sched, runner)
        assert events == [] and seq.kv_len == expected_kv and seq.status is SeqStatus.PREFILL
    _, events = step(sched, runner)
    assert [e.token.id for _, e in events] == seq.output_ids and seq.kv_len == 12
    assert seq.status is SeqStatus.RUNNING


def test_without_chunking_whole_prompts_are_prefilled_even_beyond_the_budget():
    sched = scheduler(max_running=4, max_prefill_tokens=16, chunked_prefill=False)
    runner = BlockRunner(sched)
    a, b, c = (make_seq(prompt(n, base), max_new_tokens=2) for n, base in ((10, 10), (30, 30), (5, 70)))
    for s in (a, b, c):
        sched.add(s)
    plan, _ = step(sched, runner)
    # a (10) fits; b is whole although it overshoots the budget; c waits for the next step
    assert [(ch.seq, ch.start, ch.length) for ch in plan.prefill] == [(a, 0, 10), (b, 0, 30)]
    plan, _ = step(sched, runner)
    assert [(ch.seq, ch.start, ch.length) for ch in plan.prefill] == [(c, 0, 5)]
    assert plan.decode == [a, b]


# --- abort ------------------------------------------------------------------------------------------


def _abort_event(events, seq):
    evs = [ev for s, ev in events if s is seq]
    assert len(evs) == 1
    ev = evs[0]
    assert ev.token is None and ev.finish is not None and ev.finish.reason is FinishReason.ABORT
    return ev


@pytest.mark.parametrize("state", ["waiting", "prefill", "decoding"])
def test_abort_removes_sequence_at_next_schedule(state: str):
    sched = scheduler(max_running=2, max_prefill_tokens=8)
    runner = BlockRunner(sched)
    first = make_seq(prompt(3, 10), max_new_tokens=50)
    victim = make_seq(prompt(20, 30), max_new_tokens=50)
    other = make_seq(prompt(3, 60), max_new_tokens=50)
    for s in (first, victim, other):
        sched.add(s)
    if state == "waiting":
        sched.max_running = 1  # victim cannot be admitted yet
        step(sched, runner)
        assert victim.status is SeqStatus.WAITING
    elif state == "prefill":
        step(sched, runner)  # first complete (3), victim 5 of 20
        assert victim.status is SeqStatus.PREFILL and 0 < victim.kv_len < 20
    else:
        for _ in range(5):
            step(sched, runner)
        assert victim.status is SeqStatus.RUNNING and first.status is SeqStatus.RUNNING
    sched.abort(victim)
    assert victim in sched.running or victim in sched.waiting  # nothing happens before schedule
    plan, events = step(sched, runner)
    _abort_event(events, victim)
    assert victim.finished and holds_no_blocks(victim)
    assert victim not in sched.running and victim not in sched.waiting
    assert victim not in plan.decode and victim not in [c.seq for c in plan.prefill]
    if state != "waiting":
        assert victim in plan.released
    # the room it leaves is taken by the waiting sequence
    sched.max_running = 2
    for _ in range(4):
        step(sched, runner)
    assert sched.running == [first, other] or sched.running == [other, first]
    assert other.status is SeqStatus.RUNNING


def test_abort_of_the_first_decoding_sequence_leaves_the_others_streams_and_a_prefilling_prompt_unchanged():
    sched = scheduler(max_running=4, max_prefill_tokens=100)
    runner = BlockRunner(sched)
    a, b, c = (make_seq(prompt(4, base), max_new_tokens=50, ignore_eos_token=True) for base in (10, 30, 50))
    for s in (a, b, c):
        sched.add(s)
    step(sched, runner)
    step(sched, runner)
    sched.max_prefill_tokens = 3
    d = make_seq(prompt(10, 70), max_new_tokens=5, ignore_eos_token=True)
    sched.add(d)
    step(sched, runner)
    assert [s.status for s in sched.running] == [SeqStatus.RUNNING] * 3 + [SeqStatus.PREFILL]
    sched.abort(a)
    plan, events = step(sched, runner)
    _abort_event(events, a)
    assert set(plan.decode) == {b, c} and [ch.seq for ch in plan.prefill] == [d]
    drive(sched, runner)
    for seq in (b, c, d):  # the runner checked their KV contents at every step
        assert seq.output_ids == expected_tokens(seq, seq.params.max_new_tokens)
    assert sched.pool.num_used_blocks == 0


def test_abort_after_finish_in_the_same_step_gives_one_final_event():
    sched = scheduler()
    runner = BlockRunner(sched)
    seq = make_seq(prompt(3), max_new_tokens=1)
    sched.add(seq)
    plan, events = sched.schedule(0.0)
    sched.abort(seq)  # the client goes away while the step runs
    events += sched.update(plan, runner.execute(plan))
    plan, more = sched.schedule(0.0)
    assert [e.finish.reason for _, e in events + more if e.finish] == [FinishReason.LENGTH]


# --- errors -----------------------------------------------------------------------------------------


def test_error_for_one_sequence_ends_only_that_sequence():
    sched = scheduler()
    runner = BlockRunner(sched)
    a, b, c = (make_seq(prompt(3, base), max_new_tokens=6) for base in (10, 30, 50))
    for s in (a, b, c):
        sched.add(s)
    step(sched, runner)
    runner.errors[a.seq_id] = "exception occurred during sampling: nope"
    _, events = step(sched, runner)
    fin = finishes(events)
    assert list(fin) == [a.seq_id]
    assert fin[a.seq_id].reason is FinishReason.ERROR
    assert fin[a.seq_id].error == "exception occurred during sampling: nope"
    assert [ev.token for s, ev in events if s is a] == [None]
    assert a.finished and holds_no_blocks(a) and a not in sched.running
    events = drive(sched, runner)
    assert {s.seq_id for s, ev in events if ev.finish and ev.finish.reason is FinishReason.LENGTH} == {
        b.seq_id,
        c.seq_id,
    }


def test_error_wins_over_a_sample_for_the_same_sequence():
    sched = scheduler()
    runner = BlockRunner(sched)
    a = make_seq(prompt(3))
    sched.add(a)
    plan, _ = sched.schedule(0.0)
    out = runner.execute(plan)
    assert a.seq_id in out.samples
    out.errors[a.seq_id] = "late failure"
    events = sched.update(plan, out)
    assert [(ev.token, ev.finish and ev.finish.reason) for _, ev in events] == [(None, FinishReason.ERROR)]
    assert a.output_ids == []


def test_error_in_a_prefill_chunk_while_the_next_prompt_completes():
    # the errored prompt sits before a prompt that turns RUNNING in the same step
    sched = scheduler(max_running=4, max_prefill_tokens=100)
    runner = BlockRunner(sched)
    d0, d1 = (make_seq(prompt(3, base), max_new_tokens=2) for base in (10, 30))
    sched.add(d0)
    sched.add(d1)
    step(sched, runner)
    a, b = (make_seq(prompt(5, base), max_new_tokens=5) for base in (50, 70))
    sched.add(a)
    sched.add(b)
    runner.errors[a.seq_id] = "prefill failed"
    plan, events = step(sched, runner)  # d0 and d1 finish (LENGTH) in the same step
    assert [c.seq for c in plan.prefill] == [a, b]
    fin = finishes(events)
    assert fin[a.seq_id].reason is FinishReason.ERROR
    assert fin[d0.seq_id].reason is FinishReason.LENGTH and fin[d1.seq_id].reason is FinishReason.LENGTH
    assert sched.running == [b] and b.status is SeqStatus.RUNNING
    events = drive(sched, runner)
    assert finishes(events)[b.seq_id].reason is FinishReason.LENGTH
    assert b.output_ids == expected_tokens(b, 5)


def test_failed_decode_forward_ends_the_decoders_but_not_the_prefilling_prompt():
    sched = scheduler(max_prefill_tokens=4)
    runner = BlockRunner(sched)
    a, b = (make_seq(prompt(3, base), max_new_tokens=5) for base in (10, 30))
    sched.add(a)
    sched.add(b)
    step(sched, runner)
    step(sched, runner)
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.RUNNING
    c = make_seq(prompt(10, 50), max_new_tokens=2)
    sched.add(c)
    runner.fail_decode = "exception occurred during generation: oom"
    plan, events = step(sched, runner)
    assert set(plan.decode) == {a, b} and [ch.seq for ch in plan.prefill] == [c]
    fin = finishes(events)
    assert {k: v.reason for k, v in fin.items()} == {a.seq_id: FinishReason.ERROR, b.seq_id: FinishReason.ERROR}
    assert sched.running == [c] and c.kv_len == 4
    events = drive(sched, runner)
    assert finishes(events)[c.seq_id].reason is FinishReason.LENGTH


# --- static batching --------------------------------------------------------------------------------


def test_static_batching_waits_for_a_full_batch_or_the_delay():
    sched = scheduler(max_running=8, static_batching=True, batch_size=3, max_batch_delay=0.1)
    runner = BlockRunner(sched)
    a = make_seq(prompt(3, 10), max_new_tokens=2, arrival=1.0)
    b = make_seq(prompt(3, 20), max_new_tokens=4, arrival=1.02)
    sched.add(a)
    sched.add(b)
    assert sched.next_wakeup(1.03) == pytest.approx(0.07)
    plan, _ = step(sched, runner, now=1.05)
    assert not plan.has_model_work and not sched.running
    assert sched.next_wakeup(1.05) == pytest.approx(0.05)
    assert sched.next_wakeup(1.5) == 0.0  # overdue: wake at once

    plan, _ = step(sched, runner, now=1.1)  # the delay of the oldest request has passed
    assert [c.seq for c in plan.prefill] == [a, b]
    # a batch runs to completion: no admission while it runs, even of a full batch
    late = [make_seq(prompt(3, 30 + 10 * i), max_new_tokens=1, arrival=1.11) for i in range(4)]
    for s in late:
        sched.add(s)
    assert sched.next_wakeup(1.2) is None
    while a in sched.running or b in sched.running:
        plan, _ = step(sched, runner, now=1.2)
        assert not any(s in sched.running for s in late)
    # the next batch takes batch_size requests at once (it is full) and leaves the rest waiting
    plan, _ = step(sched, runner, now=1.2)
    assert [c.seq for c in plan.prefill] == late[:3]
    assert list(sched.waiting) == late[3:]


def test_static_batching_admits_a_full_batch_without_delay():
    sched = scheduler(max_running=8, static_batching=True, batch_size=2, max_batch_delay=10.0)
    runner = BlockRunner(sched)
    a = make_seq(prompt(3, 10), arrival=0.0)
    sched.add(a)
    plan, _ = step(sched, runner, now=0.0)
    assert not plan.has_model_work
    assert sched.next_wakeup(0.0) == pytest.approx(10.0)
    b = make_seq(prompt(3, 20), arrival=0.0)
    sched.add(b)
    plan, _ = step(sched, runner, now=0.0)
    assert [c.seq for c in plan.prefill] == [a, b]


def test_static_batch_limited_by_max_running():
    sched = scheduler(max_running=2, static_batching=True, batch_size=4, max_batch_delay=0.0)
    runner = BlockRunner(sched)
    seqs = [make_seq(prompt(3, 10 + 10 * i), max_new_tokens=1) for i in range(4)]
    for s in seqs:
        sched.add(s)
    plan, _ = step(sched, runner, now=0.0)
    assert [c.seq for c in plan.prefill] == seqs[:2]


# --- queue timeout ----------------------------------------------------------------------------------


def test_expire_returns_sequences_that_waited_longer_than_queue_timeout():
    sched = scheduler(max_running=1, queue_timeout=1.0)
    runner = BlockRunner(sched)
    busy = make_seq(prompt(3, 10), max_new_tokens=100, arrival=0.0)
    old = make_seq(prompt(3, 20), arrival=0.0)
    new = make_seq(prompt(3, 30), arrival=0.5)
    for s in (busy, old, new):
        sched.add(s)
    step(sched, runner, now=0.0)
    assert sched.next_wakeup(0.2) == pytest.approx(0.8)
    assert sched.expire(1.0) == []  # exactly the timeout is still fine
    assert sched.expire(1.2) == [old]
    assert old.finished and list(sched.waiting) == [new]
    assert sched.next_wakeup(1.2) == pytest.approx(0.3)
    assert sched.expire(1.6) == [new]
    assert not sched.waiting and sched.running == [busy]  # running sequences never expire
    assert sched.expire(100.0) == []


def test_no_queue_timeout_means_nothing_expires():
    sched = scheduler(max_running=1)
    sched.add(make_seq(prompt(3, 10), arrival=0.0))
    sched.add(make_seq(prompt(3, 20), arrival=0.0))
    sched.schedule(0.0)
    assert sched.expire(1e9) == []
    assert sched.next_wakeup(1e9) is None


# --- prefill budget while decoding --------------------------------------------------------------------


def test_a_step_that_decodes_carries_at_most_a_full_batch_or_twice_its_decoding_rows():
    """prefill_floor: while N of max_running sequences decode, a step's prompt chunks take at most
    max(prefill_floor, N, max_running - N) tokens."""
    sched = scheduler(max_running=8, max_prefill_tokens=100, prefill_floor=4)
    runner = BlockRunner(sched)
    first = make_seq(prompt(40, 10), max_new_tokens=50, ignore_eos_token=True)
    sched.add(first)
    plan, _ = step(sched, runner)
    assert [c.length for c in plan.prefill] == [40]  # nothing decodes yet: the full budget
    second = make_seq(prompt(40, 60), max_new_tokens=50, ignore_eos_token=True)
    sched.add(second)
    plan, _ = step(sched, runner)
    assert plan.decode == [first] and [c.length for c in plan.prefill] == [7]  # a full batch is 8 rows

    sched = scheduler(max_running=8, max_prefill_tokens=100, prefill_floor=4)
    runner = BlockRunner(sched)
    start_decoding(sched, runner, 7)
    sched.add(make_seq(prompt(40, 60), max_new_tokens=2))
    plan, _ = step(sched, runner)
    assert len(plan.decode) == 7 and [c.length for c in plan.prefill] == [7]  # twice the 7 decoding rows

    small = scheduler(max_running=2, max_prefill_tokens=100, prefill_floor=4)
    runner = BlockRunner(small)
    decoding = start_decoding(small, runner, 2)
    small.add(make_seq(prompt(30, 60), max_new_tokens=2))
    plan, _ = step(small, runner)
    assert plan.prefill == []  # the batch is full: the newcomer waits
    small.abort(decoding[0])
    plan, _ = step(small, runner)
    assert plan.decode == decoding[1:] and [c.length for c in plan.prefill] == [4]  # the floor: max(4, 1, 2 - 1)
    assert scheduler(max_prefill_tokens=100).prefill_floor is None  # unbounded unless asked
