"""Issue #39: the bundled SmolLM2's penalized requests give the same tokens and logprobs from the penalty book as
from the lists (engine/runner/penalties.py), through the whole engine: greedy with TGI's repetition penalty,
sampled (seeded) with it, and with OpenAI's presence and frequency penalties, 8 requests at once.

    PYTHONPATH=. python benchmarks/results/issue39-penalty-book-2026-12-01/same_tokens.py MODEL_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tests"))
sys.path.insert(0, str(HERE.parents[2]))

from helpers.engines import running_engine  # noqa: E402
from lmiserve.core.request import GenerationRequest, SamplingParams  # noqa: E402
from lmiserve.engine.runner import eager_sampling  # noqa: E402
from lmiserve.models.load import load_causal_lm  # noqa: E402

PROMPTS = [
    "Write a short poem about the sea, the sea, the sea.",
    "List the planets of the solar system in order.",
    "Explain what a hash table is in two sentences.",
    "The capital of France is",
]
PARAMS = [
    SamplingParams(max_new_tokens=40, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=40, do_sample=True, temperature=0.7, seed=5, repetition_penalty=1.2),
    SamplingParams(
        max_new_tokens=40, do_sample=True, temperature=0.7, seed=9, presence_penalty=0.8, frequency_penalty=0.4
    ),
    SamplingParams(max_new_tokens=40, frequency_penalty=1.0),
]


async def outputs(loaded) -> list[dict]:  # noqa: ANN001
    async with running_engine(loaded, max_running=8) as engine:

        async def one(i: int) -> dict:
            params = PARAMS[i % len(PARAMS)]
            events = [e async for e in engine.generate(GenerationRequest(PROMPTS[i % len(PROMPTS)], params))]
            tokens = [e.token for e in events if e.token is not None]
            return {
                "ids": [t.id for t in tokens],
                "logprobs": [t.logprob for t in tokens],
                "text": events[-1].finish.generated_text,
            }

        return list(await asyncio.gather(*(one(i) for i in range(8))))


def main() -> None:
    loaded = load_causal_lm(sys.argv[1])
    booked = asyncio.run(outputs(loaded))
    eager_sampling.penalized = lambda params: False  # type: ignore[assignment]  # no book: the lists
    lists = asyncio.run(outputs(loaded))
    same_ids = [b["ids"] == a["ids"] for b, a in zip(booked, lists)]
    worst = max(abs(x - y) for b, a in zip(booked, lists) for x, y in zip(b["logprobs"], a["logprobs"]))
    print(
        json.dumps(
            {"same_tokens": same_ids, "largest_logprob_difference": worst, "texts": [b["text"] for b in booked]},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
