"""lmiserve.core.aio: merging several async streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from lmiserve.core.aio import merge_tagged


async def test_closing_the_merge_while_a_source_waits_closes_every_source_cleanly():
    closed: list[int] = []
    waiting = asyncio.Event()

    async def source(index: int) -> AsyncGenerator[int, None]:
        try:
            yield index
            waiting.set()
            await asyncio.Event().wait()  # suspended inside the source when the merge is closed
            yield -1
        finally:
            closed.append(index)

    merged = merge_tagged([source(0), source(1)])
    first = await merged.__anext__()
    await waiting.wait()
    await merged.aclose()  # raised "aclose(): asynchronous generator is already running" before
    assert first[0] in (0, 1)
    assert sorted(closed) == [0, 1]


async def test_items_are_tagged_with_their_stream_and_an_error_ends_the_merge():
    async def numbers() -> AsyncGenerator[int, None]:
        for i in range(3):
            yield i
            await asyncio.sleep(0)

    async def failing() -> AsyncGenerator[int, None]:
        yield 10
        raise ValueError("boom")

    got = [item async for item in merge_tagged([numbers(), numbers()])]
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    seen = []
    try:
        async for item in merge_tagged([numbers(), failing()]):
            seen.append(item)
    except ValueError as exc:
        assert str(exc) == "boom"
    else:
        raise AssertionError("the source's error did not reach the consumer")
    assert (1, 10) in seen
