"""Scoring prompts with the real `openai` client against `lmiserve serve` (the shared `server`): what
lm-eval's loglikelihood tasks send -- echo with logprobs, `max_tokens: 0`, token-id prompts, vLLM's
`prompt_logprobs` -- and the `max_logprobs` limit. The scores must equal a direct forward of the tiny
model (to 1e-4)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

PROMPT = "Deep learning is a branch of machine learning"
MESSAGES = [{"role": "user", "content": "What is deep learning?"}]


@pytest.fixture
def client(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The tiny model and its tokenizer as transformers loads them (fp32, CPU): the direct forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def direct_logprobs(reference, ids: list[int]) -> list[float]:
    """log P(token i | tokens before it) for i >= 1, from a direct forward."""
    model, _ = reference
    with torch.inference_mode():
        scores = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [float(scores[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_echo_with_logprobs_scores_every_prompt_token(client, reference):
    ids = reference[1](PROMPT)["input_ids"]
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    choice = completion.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the 2 most likely and the token itself
    assert choice.text.startswith(PROMPT)
    want = direct_logprobs(reference, ids)
    assert sum(lp.token_logprobs[1 : len(ids)]) == pytest.approx(sum(want), abs=1e-4)


def test_max_tokens_zero_scores_the_prompt_only(client, reference):
    ids = reference[1](PROMPT)["input_ids"]
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = completion.choices[0]
    assert choice.text == PROMPT and len(choice.logprobs.tokens) == len(ids)
    assert completion.usage.completion_tokens == 0 and completion.usage.prompt_tokens == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(direct_logprobs(reference, ids), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)


def test_token_id_prompts(client, reference):
    ids = reference[1](PROMPT)["input_ids"]
    one = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert one.choices[0].text == PROMPT and one.usage.prompt_tokens == len(ids)
    assert one.choices[0].logprobs.token_logprobs[1:] == pytest.approx(direct_logprobs(reference, ids), abs=1e-4)
    two = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(two.choices) == 2 and two.usage.prompt_tokens == len(ids) + 3
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model="tiny", prompt=[ids[0], 10**6], max_tokens=1)


def test_prompt_logprobs_as_vllm_renders_them(client, reference):
    ids = reference[1](PROMPT)["input_ids"]
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    rendered = completion.choices[0].model_extra["prompt_logprobs"]
    assert rendered[0] is None and len(rendered) == len(ids)
    want = direct_logprobs(reference, ids)
    for position, entry in enumerate(rendered[1:]):
        own = entry[str(ids[position + 1])]
        assert own["logprob"] == pytest.approx(want[position], abs=1e-4) and own["rank"] >= 1
        assert set(own) == {"logprob", "rank", "decoded_token"} and 1 <= len(entry) <= 2


def test_max_logprobs_limits_chat_and_completions_alike(client):
    ok = client.completions.create(model="tiny", prompt="Hi", max_tokens=1, logprobs=20)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) > 5  # 20 tokens, keyed by text: byte tokens read alike
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=20)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 20
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=1, extra_body={"prompt_logprobs": 21})
