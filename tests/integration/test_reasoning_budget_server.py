"""Thinking budgets on a real server: the tiny random thinking model (its template opens `<think>`; here a
copy whose template does not read `reasoning_effort`), `reasoning_parser=qwen3`, driven by the real
`anthropic` client (`thinking={"type": "enabled", "budget_tokens": N}`) and `openai` client
(`reasoning_effort` mapped by `reasoning_effort_budgets`): the random model never closes its block by
itself within the first tokens, so the thinking is exactly the first N tokens of the unbounded run, then
`</think>` is forced and the answer follows. The engine's own tests: tests/unit/test_thinking_budget.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from helpers.server import run_server
from helpers.tiny_model import THINK_END, THINKING_CHAT_TEMPLATE

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 20
GREEDY = {"temperature": 0}  # the `anthropic` client has no `temperature` argument any more


@pytest.fixture(scope="module")
def model_dir(thinking_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The thinking model with a template that leaves `reasoning_effort` to the server (as Qwen3's)."""
    out = tmp_path_factory.mktemp("budget") / "tiny-think"
    shutil.copytree(thinking_model_dir, out)
    template = THINKING_CHAT_TEMPLATE.split("{% endif %}", 1)[1]
    assert "reasoning_effort" not in template
    (out / "chat_template.jinja").write_text(template)
    return out


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Iterator[str]:
    env = {"OPTION_REASONING_PARSER": "qwen3", "OPTION_REASONING_EFFORT_BUDGETS": "minimal:3,low:6,medium:none"}
    with run_server(["--model-id", str(model_dir)], env=env) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def unbounded(oai: openai.OpenAI) -> list[str]:
    """The tokens of the unbounded answer (the random model does not write `</think>` early)."""
    completion = oai.chat.completions.create(
        model="tiny-think", messages=MESSAGES, max_tokens=TOKENS, temperature=0, logprobs=True
    )
    tokens = [t.token for t in completion.choices[0].logprobs.content]
    assert THINK_END not in tokens[:8]
    return tokens


def thinking_of(oai: openai.OpenAI, tokens: int) -> str:
    """The text of the first `tokens` tokens of the unbounded thinking (the block cut by `max_tokens`)."""
    cut = oai.chat.completions.create(model="tiny-think", messages=MESSAGES, max_tokens=tokens, temperature=0)
    return cut.choices[0].message.model_extra["reasoning_content"]


@pytest.mark.parametrize(("effort", "budget"), [("minimal", 3), ("low", 6)])
def test_reasoning_effort_ends_the_thinking_after_its_budget(oai, unbounded, effort, budget):
    completion = oai.chat.completions.create(
        model="tiny-think", messages=MESSAGES, max_tokens=TOKENS, temperature=0, logprobs=True, reasoning_effort=effort
    )
    tokens = [t.token for t in completion.choices[0].logprobs.content]
    assert tokens[:budget] == unbounded[:budget] and tokens[budget] == THINK_END
    message = completion.choices[0].message
    assert message.model_extra["reasoning_content"] == thinking_of(oai, budget)
    assert message.content  # the answer follows
    assert completion.usage.completion_tokens_details.reasoning_tokens == budget + 1  # with the end marker
    stream = oai.chat.completions.create(
        model="tiny-think",
        messages=MESSAGES,
        max_tokens=TOKENS,
        temperature=0,
        reasoning_effort=effort,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thinking_of(oai, budget)
    assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == budget + 1


def test_medium_effort_is_unbounded_and_none_turns_thinking_off(oai, unbounded):
    medium = oai.chat.completions.create(
        model="tiny-think",
        messages=MESSAGES,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=True,
        reasoning_effort="medium",
    )
    assert [t.token for t in medium.choices[0].logprobs.content] == unbounded
    off = oai.chat.completions.create(
        model="tiny-think", messages=MESSAGES, max_tokens=8, temperature=0, reasoning_effort="none"
    )
    assert off.choices[0].message.model_extra["reasoning_content"] is None and off.choices[0].message.content
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_reasoning_effort(oai, unbounded):
    response = oai.responses.create(
        model="tiny-think",
        input=MESSAGES[0]["content"],
        max_output_tokens=TOKENS,
        temperature=0,
        reasoning={"effort": "minimal"},
    )
    reasoning = next(item for item in response.output if item.type == "reasoning")
    assert reasoning.content[0].text == thinking_of(oai, 3)
    assert response.output_text and response.usage.output_tokens_details.reasoning_tokens == 4


@pytest.mark.parametrize("budget", [1, 5])
def test_anthropic_budget_tokens_ends_the_thinking(base, oai, budget):
    with anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, timeout=60) as client:
        message = client.messages.create(
            model="tiny-think",
            messages=MESSAGES,
            max_tokens=TOKENS,
            thinking={"type": "enabled", "budget_tokens": budget},
            extra_body=GREEDY,
        )
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == thinking_of(oai, budget)
        assert message.content[1].text and message.usage.output_tokens <= TOKENS
        with client.messages.stream(
            model="tiny-think",
            messages=MESSAGES,
            max_tokens=TOKENS,
            thinking={"type": "enabled", "budget_tokens": budget},
            extra_body=GREEDY,
        ) as stream:
            streamed = stream.get_final_message()
        assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in message.content]
        # disabled: the template closes the block in the prompt; nothing is thinking
        off = client.messages.create(
            model="tiny-think", messages=MESSAGES, max_tokens=8, thinking={"type": "disabled"}, extra_body=GREEDY
        )
        assert [block.type for block in off.content] == ["text"]
