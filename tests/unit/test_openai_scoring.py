"""Scoring prompts on /v1/completions with the real tiny model, in process (openai.scoring): the echoed
prompt's logprobs, top logprobs and vLLM's `prompt_logprobs` equal a direct forward of the model (to
1e-4) on every runner strategy, token-id prompts score the same as their text, and asking for them leaves
the greedy output unchanged. The same over HTTP with the `openai` client: tests/integration/test_openai_scoring.py."""

from __future__ import annotations

import json

import pytest
import torch

from lmiserve.core.limits import TextGenLimits
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.protocols.openai import encoders as fmt
from lmiserve.protocols.openai import parse as adapter
from lmiserve.protocols.openai.completion_encoders import CompletionEncoder
from lmiserve.protocols.openai.schema import CompletionRequest

PROMPT = "Deep learning is a branch of machine learning"
LIMITS = TextGenLimits(max_input_tokens=255, max_total_tokens=256)
STRATEGIES = {
    "fast": EngineConfig(max_running=4),
    "generic": EngineConfig(max_running=4, fast_path=False),
    "batch-invariant": EngineConfig(max_running=4, batch_invariant=True),
    "chunked": EngineConfig(max_running=4, max_prefill_tokens=3, prefill_floor=None),  # prompts in chunks
}


async def complete(tiny_model, payload: dict, config: EngineConfig) -> dict:
    """The /v1/completions answer of `payload` (parsed as the route parses it), as JSON."""
    tokenizer = tiny_model.tokenizer
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    call = adapter.completion(CompletionRequest.model_validate(payload), LIMITS, count, "tiny", decode)
    engine = create_engine(tiny_model, config)
    engine.start()
    try:
        per_call = [[e async for e in engine.generate(c.request)] for c in call.calls]
    finally:
        await engine.stop()
    encoder = CompletionEncoder(
        fmt.Envelope("tiny", "x"),
        call.prompts,
        logprobs=call.logprobs,
        echo=call.echo,
        top_n=call.top_logprobs,
        score_only=call.score_only,
        prompt_logprobs=call.prompt_logprobs,
    )
    for index, events in enumerate(per_call):
        for event in events:
            encoder.on_event(index, event)
    return json.loads(encoder.close())


def direct(tiny_model, ids: list[int]) -> torch.Tensor:
    """log-softmax of a direct forward over `ids`: row i scores token i + 1."""
    with torch.inference_mode():
        logits = tiny_model.model(torch.tensor([ids], device=tiny_model.model.device)).logits[0]
    return logits.float().log_softmax(-1).cpu()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
async def test_echoed_prompt_scores_equal_a_direct_forward(tiny_model, strategy):
    ids = tiny_model.tokenizer(PROMPT)["input_ids"]
    expected = direct(tiny_model, ids)
    payload = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3, "prompt_logprobs": 2}
    body = await complete(tiny_model, payload, STRATEGIES[strategy])
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and body["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [float(expected[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert sum(lp["token_logprobs"][1:]) == pytest.approx(sum(want), abs=1e-4)
    for position, top in enumerate(lp["top_logprobs"][1:]):
        best = expected[position].topk(3)
        by_text: dict[str, float] = {}  # keyed by text: two tokens may read the same ("�"), the likelier kept
        for token, value in zip(best.indices.tolist(), best.values.tolist()):
            by_text.setdefault(tiny_model.tokenizer.decode([token]), value)
        assert set(by_text) <= set(top) and len(top) <= 4
        assert [top[t] for t in by_text] == pytest.approx(list(by_text.values()), abs=1e-4)
    rendered = choice["prompt_logprobs"]
    assert rendered[0] is None and len(rendered) == len(ids)
    for position, entry in enumerate(rendered[1:]):
        token = ids[position + 1]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(want[position], abs=1e-4)
        assert own["rank"] == int((expected[position] > expected[position, token]).sum()) + 1
        ranks = {int(k): v["rank"] for k, v in entry.items()}
        assert [ranks[i] for i in expected[position].topk(2).indices.tolist()] == [1, 2]


async def test_token_id_prompts_score_as_their_text(tiny_model):
    ids = tiny_model.tokenizer(PROMPT)["input_ids"]
    config = STRATEGIES["fast"]
    by_text = await complete(tiny_model, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}, config)
    by_ids = await complete(
        tiny_model, {"prompt": [ids, ids[1:]], "max_tokens": 0, "echo": True, "logprobs": 1}, config
    )
    assert by_ids["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        by_text["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert [c["text"] for c in by_ids["choices"]] == [PROMPT, PROMPT]  # special tokens left out of the echo
    assert by_ids["usage"]["prompt_tokens"] == 2 * len(ids) - 1  # as given: no BOS added to the second


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
async def test_scoring_leaves_the_greedy_output_unchanged(tiny_model, strategy):
    plain = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    scored = {**plain, "echo": True, "logprobs": 5, "prompt_logprobs": 5}
    first = (await complete(tiny_model, plain, STRATEGIES[strategy]))["choices"][0]
    second = (await complete(tiny_model, scored, STRATEGIES[strategy]))["choices"][0]
    assert second["text"] == PROMPT + first["text"]
    assert second["finish_reason"] == first["finish_reason"]
