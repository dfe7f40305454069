"""`priority` (vLLM's meaning: lower first, ties in arrival order) orders the scheduler's waiting queue."""

from __future__ import annotations

import asyncio

from block_harness import BlockRunner, drive, step
from fakes import make_seq

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.kv_blocks import BlockPool
from lmiserve.engine.factory import create_engine


def with_priority(priority: int, arrival: float):
    seq = make_seq(max_new_tokens=2, arrival=arrival)
    seq.priority = priority
    return seq


def test_waiting_queue_admits_lower_priority_values_first_and_equal_ones_in_arrival_order():
    sched = BlockScheduler(BlockPool(64, 4), max_running=1)
    runner = BlockRunner(sched)
    a, b, c, d, e = (with_priority(p, t) for p, t in ((0, 1.0), (5, 2.0), (-1, 3.0), (0, 4.0), (5, 5.0)))
    for seq in (a, b, c, d, e):
        sched.add(seq)
    assert list(sched.waiting) == [c, a, d, b, e]
    admitted = []
    while sched.has_work():
        plan, _ = step(sched, runner)
        admitted += [chunk.seq for chunk in plan.prefill]
    assert admitted == [c, a, d, b, e]


def test_without_priorities_the_queue_stays_first_come_first_served():
    sched = BlockScheduler(BlockPool(64, 4), max_running=2)
    seqs = [make_seq(max_new_tokens=2, arrival=float(i)) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    assert list(sched.waiting) == seqs
    drive(sched, BlockRunner(sched))
    assert all(s.finished for s in seqs)


def test_queue_timeout_and_batch_delay_count_from_the_earliest_arrival_not_the_head():
    sched = BlockScheduler(
        BlockPool(64, 4), max_running=1, static_batching=True, batch_size=4, max_batch_delay=0.5, queue_timeout=10.0
    )
    sched.add(with_priority(0, arrival=100.0))
    sched.add(with_priority(-3, arrival=101.0))  # goes to the head, arrived later
    assert abs(sched.next_wakeup(100.2) - 0.3) < 1e-9  # the batch delay of the earliest arrival


def test_engine_admits_the_urgent_request_before_earlier_ones(tiny_model):
    """Through the engine: with one running slot busy, of three queued requests the one with the
    lowest priority value gets its first token first."""

    async def scenario() -> list[str]:
        engine = create_engine(tiny_model, EngineConfig(max_running=1))
        engine.start()
        order: list[str] = []

        async def one(name: str, priority: int, tokens: int) -> None:
            params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)
            async for event in engine.generate(GenerationRequest("Hello", params, priority=priority)):
                if event.token is not None and name not in order:
                    order.append(name)

        try:
            busy = asyncio.create_task(one("busy", 0, 30))
            while not order:
                await asyncio.sleep(0.001)
            queued = [asyncio.create_task(one(n, p, 2)) for n, p in (("late", 0), ("later", 3), ("urgent", -5))]
            await asyncio.gather(busy, *queued)
        finally:
            await engine.stop()
        return order

    assert asyncio.run(scenario()) == ["busy", "urgent", "late", "later"]
