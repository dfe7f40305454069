"""An engine of the tests' models, running for the length of a `with` block."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.sequence import Sequence
from lmiserve.engine.factory import create_engine
from lmiserve.engine.loaded import LoadedModel

Proposer = Callable[[Sequence], list[int]]


@contextlib.asynccontextmanager
async def running_engine(
    loaded: LoadedModel, proposer: Proposer | None = None, **config: Any
) -> AsyncIterator[AsyncEngine]:
    """`create_engine(loaded, EngineConfig(**config))`, started, stopped on leaving; `proposer`: the drafts
    its scheduler verifies (a test's own proposer, as speculative decoding's engine-core proposer)."""
    engine = create_engine(loaded, EngineConfig(**config))
    if proposer is not None:
        assert isinstance(engine.scheduler, BlockScheduler)
        engine.scheduler.proposer = proposer
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def scratch_blocks(loaded: LoadedModel, fast_path: bool = True) -> int:
    """The blocks a pool's budget (`kv_cache_memory_bytes`) pays beyond the pool on `loaded`'s device: with decode
    graphs (CUDA, the fast path) one, where their padding rows write (engine/pool_plan.py); none elsewhere."""
    from lmiserve.engine.attention import cuda_graphs

    return int(fast_path and cuda_graphs.wanted(loaded.device, enforce_eager=False))
