"""A reasoning model on a real server: the tiny random model whose chat template opens `<think>`
(`thinking_model_dir`), `reasoning_parser=qwen3`, driven by the real `openai` client: the reasoning
split from the answer, `chat_template_kwargs` turning thinking off, and a JSON grammar that the real
engine applies only after the block ends (a `logit_bias` on `</think>` makes the random model close it
at once). The fake-engine tests of the same: tests/unit/test_openai_reasoning.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from helpers.server import run_server
from helpers.tiny_model import THINK_END

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(thinking_model_dir) -> Iterator[openai.OpenAI]:
    with run_server(["--model-id", str(thinking_model_dir)], env={"OPTION_REASONING_PARSER": "qwen3"}) as base:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=30) as c:
            yield c


def test_reasoning_with_the_openai_client(client, thinking_model_dir):
    # the template opened the block and the random model never closes it: all reasoning
    completion = client.chat.completions.create(model="tiny-think", messages=MESSAGES, max_tokens=8, temperature=0)
    message = completion.choices[0].message
    assert message.content is None and message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    assert completion.usage.completion_tokens_details.reasoning_tokens == completion.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny-think",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert reasoning == message.model_extra["reasoning_content"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 8

    # thinking off: the template closes the block in the prompt, everything generated is the answer
    off = client.chat.completions.create(
        model="tiny-think",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.content and off.choices[0].message.model_extra["reasoning_content"] is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0

    # a JSON grammar after the block: `</think>` pushed first, then the constrained answer
    from transformers import AutoTokenizer

    end_id = AutoTokenizer.from_pretrained(thinking_model_dir).convert_tokens_to_ids(THINK_END)
    constrained = client.chat.completions.create(
        model="tiny-think",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        logit_bias={str(end_id): 100},
        response_format={"type": "json_object"},
    )
    message = constrained.choices[0].message
    assert message.model_extra["reasoning_content"] == ""
    assert constrained.usage.completion_tokens_details.reasoning_tokens == 1
    if constrained.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert message.content.startswith("{")
