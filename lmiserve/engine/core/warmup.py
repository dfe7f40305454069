"""The model warmed up before it serves (`EngineConfig.warmup`; on a GPU by default): no request pays for
a shape the model has not run yet.

On a GPU the first step of a new shape costs far more than the step: Triton compiles its kernels for the
arguments it specializes on (a count of 1, one divisible by 16, any other), cuBLAS picks its kernels, a
decode step of a new row count is captured as a CUDA graph (engine/attention/cuda_graphs.py), and with fp8
weights the first product of 1, 2-4 and 5-16 rows times the weight-only kernel's tiles against
``_scaled_mm`` (engine/model/fp8_gemv.py). The GPU
checks before this measured a time to first token of 0.4-0.8 s at one stream (the first level, after one
short probe request) against 50-100 ms at 32: most likely the first requests' new prompt shapes paying for
those (not yet confirmed on a GPU). So, once the engine runs and before the model is reported ready
(models/service.py), `warm_up` sends it:

1. one request a prompt length of `PROMPT_LENGTHS` (each below the context), alone: its prefill (in the
   prompt budget's chunks) and a decode step;
2. for each decode row count the runner distinguishes (`AsyncEngine.warmup_rows`: every CUDA graph size up
   to `max_rolling_batch_size`, set by engine/factory.py), that many requests at once, whose decode steps
   run that many rows (so each graph is captured now), and again sampled where the graphs sample
   (runner/graph_sampling.py: a size's sampled graphs are captured now too, with a repetition penalty too:
   the graphs that penalize);
3. with `cuda_graph_prompt_tokens` (steps with prompt rows replay the graphs too), the graph sizes past the
   batch limit, which only such steps reach, captured from padding rows (`DecodeGraphs.capture_all`).

The launches of a step keep the kinds the warm-up ran (engine/attention/triton_ops.py); a Triton
compilation after it is logged as a warning (engine/kernel_compiles.py).

The requests are the engine's own (token ids, greedy but the first, which samples so that a GPU's draw
kernel is built too (engine/runner/seeded_draw.py), a salt of their own, so no real prompt shares their
cached blocks); the observers (metrics, stats) do not see them and the engine's counters start from zero
after them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from lmiserve.core.errors import LmiServeError
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine import kernel_compiles
from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.core.async_engine import AsyncEngine
from lmiserve.engine.core.handles import RequestHandle
from lmiserve.engine.runner import graph_sampling

log = logging.getLogger(__name__)

# prompt lengths warmed: 1, either side of a multiple of 16, the prompt kernel's tiles (64) and longer
PROMPT_LENGTHS = (1, 15, 16, 17, 64, 100, 256, 1000)
NEW_TOKENS = 3  # a prefill's token, then two decode steps
_TEXT = "the quick brown fox jumps over the lazy dog while seven wise men count one hundred and twelve red apples"


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran."""

    prompt_lengths: tuple[int, ...]
    decode_rows: tuple[int, ...]
    seconds: float
    graph_sizes: tuple[int, ...] = ()  # graphs captured past the batch limit, for steps with prompt rows


async def warm_up(engine: AsyncEngine) -> WarmUp | None:
    """Warm `engine` up (running) if its config asks (`EngineConfig.warmup`); None if not."""
    if not engine.config.warmup:
        return None
    start = time.monotonic()
    codec = engine.codec
    # the ids of ordinary words (never a special token, a VLM's image token among them)
    words = [i for i in codec.tokenizer.encode(_TEXT) if i not in codec.special_token_ids] or [0]
    fits = [n for n in PROMPT_LENGTHS if n + NEW_TOKENS <= codec.max_context and n <= codec.max_input_len]
    lengths = tuple(n for n in fits if not engine.pool.never_fits(n + NEW_TOKENS))
    limit = engine.config.max_running
    rows = tuple(sorted({min(r, limit) for r in engine.warmup_rows if r > 0}))
    count = 0

    async def run(length: int, requests: int, sampled: bool = False, top_p: float = 1.0, penalty: float = 1.0) -> None:
        """`requests` requests of `length` prompt tokens, submitted at once (so that their steps run together)."""
        nonlocal count
        handles = []
        for _ in range(requests):
            count += 1
            ids = [words[(7 * i + count) % len(words)] for i in range(length)]
            params = SamplingParams(
                max_new_tokens=NEW_TOKENS,
                ignore_eos_token=True,
                do_sample=sampled,
                seed=count if sampled else None,
                top_p=top_p,
                repetition_penalty=penalty,
            )
            request = GenerationRequest("", params, cache_salt=f"lmiserve-warmup-{count}", prompt_ids=ids)
            handles.append(engine.submit(request))
        await asyncio.gather(*(_finish(engine, handle) for handle in handles))

    # a Triton compilation once no warm-up runs is a step waiting: logged (engine/kernel_compiles.py)
    with engine.unobserved(), kernel_compiles.warming():
        graphs = cuda_graphs.of_runner(engine.runner)
        try:
            for length in lengths:
                await run(length, 1, sampled=length == lengths[0])  # the first one sampled: its draw too
            for size in rows:
                await run(2, size)
                if graphs is not None and graphs.samples:  # its graphs that sample (runner/graph_sampling.py's kinds)
                    await run(2, size, sampled=True)
                    await run(2, size, sampled=True, top_p=0.9)
                    if graph_sampling.PENALTIES_IN_GRAPHS:  # (and those that penalize too)
                        await run(2, size, sampled=True, penalty=1.1)
                        await run(2, size, sampled=True, top_p=0.9, penalty=1.1)
        except LmiServeError as exc:  # a shape the engine refuses costs its first request time, not the model
            log.warning("warm-up stopped (%s); the model serves without the rest of it", exc)
        # the graph sizes past the batch limit (`cuda_graph_prompt_tokens`: decode rows and prompt rows
        # together), which no batch of requests reaches alone: captured from padding rows, on the model's thread
        extra: list[int] = []
        if graphs is not None and graphs.prompt_tokens:
            extra = await engine.thread.run(graphs.capture_all)
    engine.steps = engine.steps_ahead = engine.generated_tokens = 0
    done = WarmUp(lengths, rows, round(time.monotonic() - start, 3), tuple(extra))
    log.info(
        "warmed up in %.1f s: prompts of %s tokens, decode steps of %s rows%s",
        done.seconds,
        ", ".join(map(str, lengths)),
        ", ".join(map(str, rows)),
        f", graphs of {', '.join(map(str, extra))} rows for steps with prompt rows" if extra else "",
    )
    return done


async def _finish(engine: AsyncEngine, handle: RequestHandle) -> None:
    async for _ in engine.events(handle):
        pass
