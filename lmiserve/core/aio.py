"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")


class _End:
    """A source ended: normally (`error` None) or by raising `error`."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


async def merge_tagged(streams: Sequence[AsyncGenerator[_T, None]]) -> AsyncGenerator[tuple[int, _T], None]:
    """Interleave several async iterators as they produce, tagging each item with its stream's index.
    Closing the merged iterator closes every source."""
    queue: asyncio.Queue[tuple[int, _T | _End]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[_T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, _End()))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, _End(exc)))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # A pump may be suspended inside its stream: wait until every pump has ended before closing the
        # streams (closing a generator that is still running raises RuntimeError).
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (if any) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
