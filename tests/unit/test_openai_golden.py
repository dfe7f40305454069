"""OpenAI-compatible wire formats, byte for byte (floats to 3 decimals): the tiny model generates greedily
in process, the OpenAI adapter and formatters render with a fixed `created`, and the bytes must equal
tests/golden/openai/<case>. The random part of each ``id`` (``chatcmpl-<32 hex>``, ``cmpl-<32 hex>``)
reads as 32 zeros on both sides (the golden files hold that form); one id per response, the same in
every chunk of a stream, is checked here too. `UPDATE_GOLDEN=1 pytest tests/unit/test_openai_golden.py`
rewrites them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lmiserve.core.errors import InvalidRequest, LmiServeError
from lmiserve.core.limits import TextGenLimits as TgiLimits
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.protocols.openai import encoders as fmt
from lmiserve.protocols.openai import parse as adapter
from lmiserve.protocols.openai.chat_encoders import ChatEncoder, ChatStreamEncoder
from lmiserve.protocols.openai.completion_encoders import CompletionEncoder, CompletionStreamEncoder
from lmiserve.protocols.openai.errors import RENDERER
from lmiserve.protocols.openai.schema import ChatRequest, CompletionRequest

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "openai"
CREATED = 1700000000
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is deep learning?"}]

CASES: dict[str, dict] = {
    "chat.json": {"messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    "chat_logprobs.json": {
        "messages": MESSAGES,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    },
    "chat_model_echoed.json": {"model": "my-model", "messages": MESSAGES, "max_completion_tokens": 2, "temperature": 0},
    "chat_stream.sse": {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True},
    "chat_stream_usage.sse": {
        "messages": MESSAGES,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "completion.json": {"prompt": "Deep learning is", "max_tokens": 4, "temperature": 0},
    "completion_two_prompts.json": {"prompt": ["Deep learning is", "Hello"], "max_tokens": 3, "temperature": 0},
    "completion_echo_logprobs.json": {
        "prompt": "Deep learning is",
        "max_tokens": 2,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    },
    "completion_stream.sse": {"prompt": "Deep learning is", "max_tokens": 3, "temperature": 0, "stream": True},
    "completion_stream_usage.sse": {
        "prompt": ["Deep learning is", "Hello"],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "error_suffix.json": {"prompt": "Deep learning is", "suffix": "!"},
}


async def render(tiny_model, payload: dict) -> bytes:
    tokenizer = tiny_model.tokenizer
    limits = TgiLimits(max_input_tokens=255, max_total_tokens=256)
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    chat = "messages" in payload
    try:
        if chat:
            render_chat = lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)  # noqa: E731
            call = adapter.chat(ChatRequest.model_validate(payload), limits, count, render_chat, "tiny")
        else:
            call = adapter.completion(CompletionRequest.model_validate(payload), limits, count, "tiny")
    except LmiServeError as exc:
        return RENDERER.body(exc)
    env = fmt.Envelope(call.model, "0.1.0-native", CREATED, fmt.completion_id(chat))
    engine = create_engine(tiny_model, EngineConfig(max_running=4))
    engine.start()
    try:
        per_call = [[e async for e in engine.generate(c.request)] for c in call.calls]
    finally:
        await engine.stop()
    if call.stream:
        stream: ChatStreamEncoder | CompletionStreamEncoder
        if chat:
            stream = ChatStreamEncoder(env, logprobs=call.logprobs, include_usage=call.include_usage)
        else:
            stream = CompletionStreamEncoder(
                env, logprobs=call.logprobs, top_n=call.top_logprobs, include_usage=call.include_usage
            )
    elif chat:
        stream = ChatEncoder(env, call.prompts[0], logprobs=call.logprobs)
    else:
        stream = CompletionEncoder(
            env,
            call.prompts,
            logprobs=call.logprobs,
            echo=call.echo,
            top_n=call.top_logprobs,
            score_only=call.score_only,
            prompt_logprobs=call.prompt_logprobs,
        )
    return b"".join(stream.on_event(i, e) for i, events in enumerate(per_call) for e in events) + stream.close()


@pytest.mark.parametrize("name", sorted(CASES))
async def test_golden(name, tiny_model):
    actual = await render(tiny_model, CASES[name])
    path = GOLDEN_DIR / name
    ids = set(_ID.findall(actual))
    assert len(ids) <= 1, ids  # one id per response, in every chunk
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_same_id(actual))
    assert path.exists(), f"missing golden {path}: run with UPDATE_GOLDEN=1 and review it"
    assert same_bytes(actual, path.read_bytes())


def test_stream_error_tail_is_an_error_event_then_done():
    assert RENDERER.in_band(InvalidRequest("x")) == (
        b'data: {"error":{"message":"x","type":"invalid_request_error","param":null,"code":null}}\n\ndata: [DONE]\n\n'
    )


def test_every_golden_file_has_a_case():
    assert sorted(p.name for p in GOLDEN_DIR.iterdir()) == sorted(CASES)


_FLOAT = re.compile(rb"-?\d+\.\d+(?:e-?\d+)?")
_ID = re.compile(rb'"id":"((?:chatcmpl|cmpl)-[0-9a-f]{32})"')


def _same_id(raw: bytes) -> bytes:
    """Each ``chatcmpl-``/``cmpl-`` id with its random part as 32 zeros."""
    return _ID.sub(lambda m: b'"id":"' + m.group(1).split(b"-")[0] + b"-" + b"0" * 32 + b'"', raw)


def same_bytes(actual: bytes, expected: bytes) -> bool:
    norm = lambda raw: _FLOAT.sub(lambda m: b"%.3f" % float(m.group()), _same_id(raw))  # noqa: E731
    return norm(actual) == norm(expected)
