"""An engine of the tests' models, running for the length of a `with` block, and what tests ask of it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from lmiserve.core.request import GenerationRequest, SamplingParams
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


async def greedy_ids(engine: AsyncEngine, prompt: str, tokens: int = 16) -> list[int]:
    """The token ids `engine` generates for `prompt`, greedily."""
    request = GenerationRequest(prompt, SamplingParams(max_new_tokens=tokens))
    return [e.token.id for e in [e async for e in engine.generate(request)] if e.token is not None]


async def text_scores(engine: AsyncEngine, ids: list[int]) -> tuple[float, list[int]]:
    """The perplexity of `ids` (prompt logprobs) and the most likely token at each position."""
    params = SamplingParams(max_new_tokens=1, decoder_input_details=True, prompt_top_n=1)
    events = [e async for e in engine.generate(GenerationRequest("", params, prompt_ids=ids))]
    finish = events[-1].finish
    assert finish is not None and finish.prefill is not None and finish.prefill_top is not None
    logprobs = [float(t.logprob or 0.0) for t in finish.prefill[1:]]
    return math.exp(-sum(logprobs) / len(logprobs)), [tops[0].id for tops in finish.prefill_top[1:] if tops]
