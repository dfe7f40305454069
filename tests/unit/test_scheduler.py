"""The scheduler as a pure state machine, driven by hand with a fake runner (no torch).

Every step goes through `fakes.run_step`, which checks the slot layout (RUNNING sequences in slots
0..R-1, PREFILL ones after, ``seq.slot`` == index) and replays the plan's moves on a simulated slot
array, checking that each running sequence finds exactly its own tokens in its slot.
"""

from __future__ import annotations

import random

import pytest
from fakes import EOS, FakeRunner, FakeTokenizer, check_running_layout, drive, make_seq, run_step

from lmiserve.core.events import FinishReason
from lmiserve.engine.prefix_cache import PrefixIndex
from lmiserve.engine.scheduler import Scheduler
from lmiserve.engine.sequence import SeqStatus


def prompt(n: int, base: int = 10) -> list[int]:
    return [base + i % 80 for i in range(n)]


def finishes(events):
    return {seq.seq_id: ev.finish for seq, ev in events if ev.finish is not None}


# --- admission -----------------------------------------------------------------------------------


def test_admission_is_fifo_up_to_max_running_and_a_finished_sequence_frees_its_slot():
    sched = Scheduler(max_running=2)
    runner = FakeRunner(sched)
    seqs = [make_seq(prompt(3), max_new_tokens=n) for n in (2, 5, 3, 3)]
    for s in seqs:
        sched.add(s)
    assert all(s.status is SeqStatus.WAITING for s in seqs)

    plan, events = run_step(sched, runner)  # prefill both admitted prompts, first token each
    assert events and not finishes(events)
    assert [c.seq for c in plan.prefill] == seqs[:2]
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    assert [s.status for s in seqs] == [SeqStatus.RUNNING, SeqStatus.RUNNING, SeqStatus.WAITING, SeqStatus.WAITING]

    plan, events = run_step(sched, runner)  # second token: seqs[0] reaches max_new_tokens=2
    assert plan.decode == seqs[:2]
    assert finishes(events)[seqs[0].seq_id].reason is FinishReason.LENGTH
    assert sched.running == [seqs[1]] and seqs[1].slot == 0 and seqs[0].slot is None
    assert list(sched.waiting) == seqs[2:]  # admission happens at the next schedule, not in update

    plan, _ = run_step(sched, runner)
    assert plan.released == [seqs[0]]
    assert plan.moves == [(1, 0, seqs[1].kv_len - 1)]  # seqs[1] moved down before this step's write
    assert [c.seq for c in plan.prefill] == [seqs[2]] and plan.decode == [seqs[1]]
    assert sched.running == [seqs[1], seqs[2]] and list(sched.waiting) == [seqs[3]]

    events = drive(sched, runner)
    assert set(finishes(events)) == {seqs[1].seq_id, seqs[2].seq_id, seqs[3].seq_id}
    assert all(s.finished and s.slot is None for s in seqs)
    assert not sched.running and not sched.waiting and not sched.has_work()


def test_admission_order_follows_arrival_when_slots_free_up_one_by_one():
    sched = Scheduler(max_running=1)
    runner = FakeRunner(sched)
    seqs = [make_seq(prompt(2 + i), max_new_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    admitted = []
    for _ in range(50):
        if not sched.has_work():
            break
        run_step(sched, runner)
        for s in sched.running:
            if s not in admitted:
                admitted.append(s)
    assert admitted == seqs
    assert all(len(s.output_ids) == 2 for s in seqs)


def test_idle_scheduler_plans_nothing():
    sched = Scheduler()
    plan, events = sched.schedule(0.0)
    assert not plan.has_model_work and not events and not sched.has_work()
    assert sched.next_wakeup(0.0) is None


# --- randomized invariants -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("cached", [False, True], ids=["", "prefix_cache"])
def test_random_traffic_keeps_slots_contiguous_and_kv_contents_right(seed: int, chunked: bool, cached: bool):
    """With a prefix cache (a small one: blocks are evicted all the time) prompts share heads, and every
    sequence that starts from cached blocks must find its own tokens in its slot (FakeRunner checks)."""
    rng = random.Random(seed)
    max_running, budget = 5, 24
    prefix = PrefixIndex(num_blocks=12, block_size=4) if cached else None
    sched = Scheduler(max_running=max_running, max_prefill_tokens=budget, chunked_prefill=chunked, prefix=prefix)

    def rule(seq, step):
        return EOS if rng.random() < 0.04 else 100 + rng.randrange(50)

    runner = FakeRunner(sched, rule)
    tokenizer = FakeTokenizer()
    all_seqs = []
    events_of: dict[int, list] = {}
    admitted_order: list[int] = []
    aborted_while_waiting: set[int] = set()
    now = 0.0

    for step in range(400):
        now += 0.01
        if step < 320:
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3])):
                s = make_seq(
                    prompt(rng.randint(1, 60), base=rng.choice([10, 11]) if cached else rng.randrange(10, 90)),
                    tokenizer=tokenizer,
                    max_new_tokens=rng.randint(1, 25),
                    arrival=now,
                )
                sched.add(s)
                all_seqs.append(s)
                events_of[s.seq_id] = []
        live = [s for s in all_seqs if not s.finished and not s.abort_requested]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            if victim.status is SeqStatus.WAITING:
                aborted_while_waiting.add(victim.seq_id)
            sched.abort(victim)
        running_now = [s for s in sched.running]
        if running_now and rng.random() < 0.03:
            runner.errors[rng.choice(running_now).seq_id] = "boom"
        if running_now and rng.random() < 0.01:
            runner.fail_decode = "decode failed"

        plan, step_events = sched.schedule(now)
        check_running_layout(sched)
        decoding_before = [s for s in sched.running if s.status is SeqStatus.RUNNING]
        # every decoding sequence decodes in every step, in slot order
        assert plan.decode == decoding_before
        # prompts are prefilled in slot (= arrival) order; only the last chunk may stop mid-prompt
        slots = [c.seq.slot for c in plan.prefill]
        assert slots == sorted(slots)
        assert all(c.completes_prompt for c in plan.prefill[:-1])
        if plan.prefill:
            first_prefill = next(s for s in sched.running if s.status is SeqStatus.PREFILL)
            assert plan.prefill[0].seq is first_prefill
        if chunked:
            assert sum(c.length for c in plan.prefill) <= budget
        else:
            assert all(c.start == c.seq.cached_tokens and c.completes_prompt for c in plan.prefill)
        for s in sched.running:
            if s.seq_id not in admitted_order:
                admitted_order.append(s.seq_id)
        if plan.has_model_work:
            out = runner.execute(plan)
            step_events += sched.update(plan, out)
        else:
            runner.prepare_slots(plan)
        check_running_layout(sched)
        for seq, ev in step_events:
            events_of[seq.seq_id].append(ev)
        if step >= 320 and not sched.has_work():
            break

    for seq, ev in drive(sched, runner):  # drain anything left
        events_of[seq.seq_id].append(ev)
    assert not sched.has_work()
    # admission in arrival order (sequences aborted while still waiting never run)
    expected = [s.seq_id for s in all_seqs if s.seq_id not in aborted_while_waiting]
    assert admitted_order == expected[: len(admitted_order)]
    reasons = set()
    for s in all_seqs:
        evs = events_of[s.seq_id]
        assert s.finished and s.slot is None
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
    assert sum(len(p.moves) for p in runner.log) > 20  # compaction was exercised
    if cached:
        hits = sum(p.prefix_hits for p in runner.log)
        assert hits > 200 and sum(s.cached_tokens for s in all_seqs) == hits
        assert sum(len(p.saves) for p in runner.log) > 50 and prefix is not None and prefix.used_blocks == 12
    assert len(all_seqs) > 100


# --- chunked prefill ------------------------------------------------------------------------------


def test_long_prompt_is_chunked_while_running_sequences_keep_decoding():
    sched = Scheduler(max_running=4, max_prefill_tokens=16)
    runner = FakeRunner(sched)
    short = make_seq(prompt(4), max_new_tokens=100)
    sched.add(short)
    run_step(sched, runner)
    assert short.status is SeqStatus.RUNNING

    long_a = make_seq(prompt(40), max_new_tokens=3)
    long_b = make_seq(prompt(20), max_new_tokens=3)
    sched.add(long_a)
    sched.add(long_b)
    chunks = []
    for _ in range(6):
        plan, _ = run_step(sched, runner)
        assert plan.decode[0] is short  # decoding never pauses for a prefill
        assert sum(c.length for c in plan.prefill) <= 16
        chunks.append([(c.seq, c.start, c.length) for c in plan.prefill])
    assert chunks[:4] == [
        [(long_a, 0, 16)],
        [(long_a, 16, 16)],
        [(long_a, 32, 8), (long_b, 0, 8)],  # leftover budget goes to the next prompt in line
        [(long_b, 8, 12)],
    ]
    assert chunks[4] == chunks[5] == []
    assert len(long_a.output_ids) == 3 and long_a.finished  # tokens from chunk 3 onwards
    assert len(long_b.output_ids) == 3 and long_b.finished


def test_first_token_is_sampled_only_when_the_prompt_completes():
    sched = Scheduler(max_prefill_tokens=5)
    runner = FakeRunner(sched)
    seq = make_seq(prompt(12), max_new_tokens=2)
    sched.add(seq)
    for expected_kv in (5, 10):
        _, events = run_step(sched, runner)
        assert events == [] and seq.kv_len == expected_kv and seq.status is SeqStatus.PREFILL
    _, events = run_step(sched, runner)
    assert [e.token.id for _, e in events] == seq.output_ids and seq.kv_len == 12
    assert seq.status is SeqStatus.RUNNING


def test_without_chunking_whole_prompts_are_prefilled_even_beyond_the_budget():
    sched = Scheduler(max_running=4, max_prefill_tokens=16, chunked_prefill=False)
    runner = FakeRunner(sched)
    a, b, c = (make_seq(prompt(n), max_new_tokens=2) for n in (10, 30, 5))
    for s in (a, b, c):
        sched.add(s)
    plan, _ = run_step(sched, runner)
    # a (10) fits; b is whole although it overshoots the budget; c waits for the next step
    assert [(ch.seq, ch.start, ch.length) for ch in plan.prefill] == [(a, 0, 10), (b, 0, 30)]
    plan, _ = run_step(sched, runner)
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
    sched = Scheduler(max_running=2, max_prefill_tokens=8)
    runner = FakeRunner(sched)
    first = make_seq(prompt(3), max_new_tokens=50)
    victim = make_seq(prompt(20), max_new_tokens=50)
    other = make_seq(prompt(3), max_new_tokens=50)
    for s in (first, victim, other):
        sched.add(s)
    if state == "waiting":
        sched.max_running = 1  # victim cannot be admitted yet
        run_step(sched, runner)
        assert victim.status is SeqStatus.WAITING
    elif state == "prefill":
        run_step(sched, runner)  # first complete (3), victim 5 of 20
        assert victim.status is SeqStatus.PREFILL and 0 < victim.kv_len < 20
    else:
        for _ in range(5):
            run_step(sched, runner)
        assert victim.status is SeqStatus.RUNNING and victim.slot == 1 and first.slot == 0
    sched.abort(victim)
    assert victim in sched.running or victim in sched.waiting  # nothing happens before schedule
    plan, events = run_step(sched, runner)
    _abort_event(events, victim)
    assert victim.finished and victim.slot is None
    assert victim not in sched.running and victim not in sched.waiting
    assert victim not in plan.decode and victim not in [c.seq for c in plan.prefill]
    if state != "waiting":
        assert victim in plan.released
    # the freed slot is taken by the waiting sequence
    sched.max_running = 2
    for _ in range(4):
        run_step(sched, runner)
    assert sched.running == [first, other] or sched.running == [other, first]
    assert other.status is SeqStatus.RUNNING


def test_abort_of_a_decoding_sequence_in_slot_zero_moves_the_last_decoder_and_prefills_down():
    sched = Scheduler(max_running=4, max_prefill_tokens=100)
    runner = FakeRunner(sched)
    a, b, c = (make_seq(prompt(4), max_new_tokens=50) for _ in range(3))
    for s in (a, b, c):
        sched.add(s)
    run_step(sched, runner)
    run_step(sched, runner)
    sched.max_prefill_tokens = 3
    d = make_seq(prompt(10), max_new_tokens=5)
    sched.add(d)
    run_step(sched, runner)
    assert [s.status for s in sched.running] == [SeqStatus.RUNNING] * 3 + [SeqStatus.PREFILL]
    sched.abort(a)
    plan, events = run_step(sched, runner)  # fake runner checks the moved KV contents
    _abort_event(events, a)
    assert sched.running[:3] == [c, b, d]
    assert (2, 0, c.kv_len - 1) in plan.moves and (3, 2, 3) in plan.moves


def test_abort_after_finish_in_the_same_step_gives_one_final_event():
    sched = Scheduler()
    runner = FakeRunner(sched)
    seq = make_seq(prompt(3), max_new_tokens=1)
    sched.add(seq)
    plan, events = sched.schedule(0.0)
    sched.abort(seq)  # the client goes away while the step runs
    events += sched.update(plan, runner.execute(plan))
    plan, more = sched.schedule(0.0)
    assert [e.finish.reason for _, e in events + more if e.finish] == [FinishReason.LENGTH]


# --- errors -----------------------------------------------------------------------------------------


def test_error_for_one_sequence_ends_only_that_sequence():
    sched = Scheduler()
    runner = FakeRunner(sched)
    a, b, c = (make_seq(prompt(3), max_new_tokens=6) for _ in range(3))
    for s in (a, b, c):
        sched.add(s)
    run_step(sched, runner)
    plan, _ = sched.schedule(0.0)
    out = runner.execute(plan)
    del out.samples[a.seq_id]
    out.errors[a.seq_id] = "exception occurred during sampling: nope"
    events = sched.update(plan, out)
    fin = finishes(events)
    assert list(fin) == [a.seq_id]
    assert fin[a.seq_id].reason is FinishReason.ERROR
    assert fin[a.seq_id].error == "exception occurred during sampling: nope"
    assert [ev.token for s, ev in events if s is a] == [None]
    assert a.finished and a.slot is None and a not in sched.running
    check_running_layout(sched)
    events = drive(sched, runner)
    assert {s.seq_id for s, ev in events if ev.finish and ev.finish.reason is FinishReason.LENGTH} == {
        b.seq_id,
        c.seq_id,
    }


def test_error_wins_over_a_sample_for_the_same_sequence():
    sched = Scheduler()
    runner = FakeRunner(sched)
    a = make_seq(prompt(3))
    sched.add(a)
    plan, _ = sched.schedule(0.0)
    out = runner.execute(plan)
    assert a.seq_id in out.samples
    out.errors[a.seq_id] = "late failure"
    events = sched.update(plan, out)
    assert len(events) == 1 and events[0][1].finish.reason is FinishReason.ERROR
    assert a.output_ids == []


def test_error_in_a_prefill_chunk_while_the_next_prompt_completes():
    # the errored prompt sits before a prompt that turns RUNNING in the same step
    sched = Scheduler(max_running=4, max_prefill_tokens=100)
    runner = FakeRunner(sched)
    d0, d1 = (make_seq(prompt(3), max_new_tokens=2) for _ in range(2))
    sched.add(d0)
    sched.add(d1)
    run_step(sched, runner)
    a, b = (make_seq(prompt(5), max_new_tokens=5) for _ in range(2))
    sched.add(a)
    sched.add(b)
    runner.errors[a.seq_id] = "prefill failed"
    _, events = run_step(sched, runner)  # d0 and d1 finish (LENGTH) in the same step
    fin = finishes(events)
    assert fin[a.seq_id].reason is FinishReason.ERROR
    assert fin[d0.seq_id].reason is FinishReason.LENGTH and fin[d1.seq_id].reason is FinishReason.LENGTH
    assert sched.running == [b] and b.slot == 0 and b.status is SeqStatus.RUNNING
    events = drive(sched, runner)
    assert finishes(events)[b.seq_id].reason is FinishReason.LENGTH


def test_failed_decode_forward_ends_the_decoders_but_not_the_prefilling_prompt():
    sched = Scheduler(max_prefill_tokens=4)
    runner = FakeRunner(sched)
    a, b = (make_seq(prompt(3), max_new_tokens=5) for _ in range(2))
    sched.add(a)
    sched.add(b)
    run_step(sched, runner)
    run_step(sched, runner)
    c = make_seq(prompt(10), max_new_tokens=2)
    sched.add(c)
    runner.fail_decode = "exception occurred during generation: oom"
    _, events = run_step(sched, runner)
    fin = finishes(events)
    assert {k: v.reason for k, v in fin.items()} == {a.seq_id: FinishReason.ERROR, b.seq_id: FinishReason.ERROR}
    assert sched.running == [c] and c.slot == 0 and c.kv_len == 4
    events = drive(sched, runner)
    assert finishes(events)[c.seq_id].reason is FinishReason.LENGTH


# --- static batching --------------------------------------------------------------------------------


def test_static_batching_waits_for_a_full_batch_or_the_delay():
    sched = Scheduler(max_running=8, static_batching=True, batch_size=3, max_batch_delay=0.1)
    runner = FakeRunner(sched)
    a = make_seq(prompt(3), max_new_tokens=2, arrival=1.0)
    b = make_seq(prompt(3), max_new_tokens=4, arrival=1.02)
    sched.add(a)
    sched.add(b)
    assert sched.next_wakeup(1.03) == pytest.approx(0.07)
    plan, _ = run_step(sched, runner, now=1.05)
    assert not plan.has_model_work and not sched.running
    assert sched.next_wakeup(1.05) == pytest.approx(0.05)
    assert sched.next_wakeup(1.5) == 0.0  # overdue: wake at once

    plan, _ = run_step(sched, runner, now=1.1)  # the delay of the oldest request has passed
    assert [c.seq for c in plan.prefill] == [a, b]
    # a batch runs to completion: no admission while it runs, even of a full batch
    late = [make_seq(prompt(3), max_new_tokens=1, arrival=1.11) for _ in range(4)]
    for s in late:
        sched.add(s)
    assert sched.next_wakeup(1.2) is None
    while a in sched.running or b in sched.running:
        plan, _ = run_step(sched, runner, now=1.2)
        assert not any(s in sched.running for s in late)
    # the next batch takes batch_size requests at once (it is full) and leaves the rest waiting
    plan, _ = run_step(sched, runner, now=1.2)
    assert [c.seq for c in plan.prefill] == late[:3]
    assert list(sched.waiting) == late[3:]


def test_static_batching_admits_a_full_batch_without_delay():
    sched = Scheduler(max_running=8, static_batching=True, batch_size=2, max_batch_delay=10.0)
    runner = FakeRunner(sched)
    a = make_seq(prompt(3), arrival=0.0)
    sched.add(a)
    plan, _ = run_step(sched, runner, now=0.0)
    assert not plan.has_model_work
    assert sched.next_wakeup(0.0) == pytest.approx(10.0)
    b = make_seq(prompt(3), arrival=0.0)
    sched.add(b)
    plan, _ = run_step(sched, runner, now=0.0)
    assert [c.seq for c in plan.prefill] == [a, b]


def test_static_batch_limited_by_max_running():
    sched = Scheduler(max_running=2, static_batching=True, batch_size=4, max_batch_delay=0.0)
    runner = FakeRunner(sched)
    seqs = [make_seq(prompt(3), max_new_tokens=1) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    plan, _ = run_step(sched, runner, now=0.0)
    assert [c.seq for c in plan.prefill] == seqs[:2]


# --- queue timeout ----------------------------------------------------------------------------------


def test_expire_returns_sequences_that_waited_longer_than_queue_timeout():
    sched = Scheduler(max_running=1, queue_timeout=1.0)
    runner = FakeRunner(sched)
    busy = make_seq(prompt(3), max_new_tokens=100, arrival=0.0)
    old = make_seq(prompt(3), arrival=0.0)
    new = make_seq(prompt(3), arrival=0.5)
    for s in (busy, old, new):
        sched.add(s)
    run_step(sched, runner, now=0.0)
    assert sched.next_wakeup(0.2) == pytest.approx(0.8)
    assert sched.expire(1.0) == []  # exactly the timeout is still fine
    assert sched.expire(1.2) == [old]
    assert old.finished and list(sched.waiting) == [new]
    assert sched.next_wakeup(1.2) == pytest.approx(0.3)
    assert sched.expire(1.6) == [new]
    assert not sched.waiting and sched.running == [busy]  # running sequences never expire
    assert sched.expire(100.0) == []


def test_no_queue_timeout_means_nothing_expires():
    sched = Scheduler(max_running=1)
    sched.add(make_seq(prompt(3), arrival=0.0))
    sched.add(make_seq(prompt(3), arrival=0.0))
    sched.schedule(0.0)
    assert sched.expire(1e9) == []
    assert sched.next_wakeup(1e9) is None


# --- prefill budget while decoding --------------------------------------------------------------------


def test_a_step_that_decodes_carries_at_most_a_full_batch_or_twice_its_decoding_rows():
    from lmiserve.core.request import SamplingParams
    from lmiserve.engine.sequence import SeqStatus, Sequence

    class _Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    def seq(i: int, n: int) -> Sequence:
        return Sequence(
            i,
            f"r{i}",
            "p",
            list(range(n)),
            SamplingParams(max_new_tokens=50),
            tokenizer=_Tok(),
            eos_token_ids=set(),
            special_token_ids=set(),
            seed=0,
        )

    sched = Scheduler(max_running=8, max_prefill_tokens=100, prefill_floor=4)
    first = seq(1, 40)
    sched.add(first)
    plan, _ = sched.schedule(0.0)
    assert [c.length for c in plan.prefill] == [40]  # nothing decodes yet: the full budget
    first.kv_len, first.status = 40, SeqStatus.RUNNING
    first.output_ids.append(1)
    second = seq(2, 40)
    sched.add(second)
    plan, _ = sched.schedule(0.0)
    assert [c.length for c in plan.prefill] == [7]  # one stream decodes: a full batch is 8 rows
    second.kv_len = 7
    for i in range(3, 9):
        s = seq(i, 1)
        s.status, s.kv_len, s.slot = SeqStatus.RUNNING, 1, len(sched.running)
        s.output_ids.append(1)
        sched.running.insert(1, s)
    for slot, s in enumerate(sched.running):
        s.slot = slot
    plan, _ = sched.schedule(0.0)
    assert len(plan.decode) == 7 and [c.length for c in plan.prefill] == [7]  # twice the 7 decoding rows
    small = Scheduler(max_running=2, max_prefill_tokens=100, prefill_floor=4)
    small.running = [s for s in sched.running if s.status is SeqStatus.RUNNING][:2]
    small.waiting.append(seq(20, 30))
    for slot, s in enumerate(small.running):
        s.slot = slot
    plan, _ = small.schedule(0.0)
    assert plan.prefill == []  # the batch is full: the newcomer waits
    small.running = small.running[:1]
    plan, _ = small.schedule(0.0)
    assert [c.length for c in plan.prefill] == [4]  # the floor: max(4, 1, 2 - 1)
    assert Scheduler(max_prefill_tokens=100).prefill_floor is None  # unbounded unless asked


def test_the_slot_scheduler_counts_decode_rows_in_the_step_budget():
    """kv_cache=slots honours max_num_batched_tokens the same way: N decode rows leave budget - N prompt
    tokens, and the streams stay what they are alone."""
    sched = Scheduler(max_running=8, max_prefill_tokens=64, max_step_tokens=10)
    runner = FakeRunner(sched)
    decoding = [make_seq(prompt(3, 20 + i), max_new_tokens=30, ignore_eos_token=True) for i in range(4)]
    for seq in decoding:
        sched.add(seq)
    while any(seq.status is not SeqStatus.RUNNING for seq in decoding):
        run_step(sched, runner)
    long = make_seq(prompt(50), max_new_tokens=2, ignore_eos_token=True)
    sched.add(long)
    for _ in range(3):
        plan, _ = run_step(sched, runner)
        assert len(plan.decode) == 4 and [(c.seq, c.length) for c in plan.prefill] == [(long, 6)]
    drive(sched, runner)
    assert long.finished and all(seq.finished for seq in decoding)
