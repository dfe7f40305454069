"""Anthropic Messages wire formats, byte for byte: the tiny model generates greedily in process, the
Anthropic adapter and encoders render, and the bytes must equal tests/golden/anthropic/<case>. The random
part of each id (``msg_<24 hex>``, ``toolu_<24 hex>``) reads as 24 zeros on both sides (the golden files
hold that form); one message id per response, the same in a stream's ``message_start`` and nowhere else.
`UPDATE_GOLDEN=1 pytest tests/unit/test_anthropic_golden.py` rewrites them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lmiserve.core.errors import LmiServeError
from lmiserve.core.limits import TextGenLimits
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.protocols.anthropic import encoders as enc
from lmiserve.protocols.anthropic import parse as adapter
from lmiserve.protocols.anthropic.errors import RENDERER
from lmiserve.protocols.anthropic.routes import parse
from lmiserve.protocols.anthropic.schema import MessagesRequest

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "anthropic"
MESSAGES = [{"role": "user", "content": "What is deep learning?"}]
BASE = {"model": "tiny", "system": "Be brief.", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}

CASES: dict[str, dict] = {
    "message.json": BASE,
    "message_stream.sse": {**BASE, "stream": True},
    "message_multi_turn.json": {
        **BASE,
        "messages": [*MESSAGES, {"role": "assistant", "content": "A kind of"}, {"role": "user", "content": "More?"}],
    },
    "error_image.json": {  # an image outside a user message (a text model's refusal is the route's)
        **BASE,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "https://h/a.png"}}]},
        ],
    },
    "error_schema.json": {"model": "tiny", "messages": MESSAGES, "temperature": 3},
}


async def render(tiny_model, payload: dict) -> bytes:
    tokenizer = tiny_model.tokenizer
    limits = TextGenLimits(max_input_tokens=255, max_total_tokens=256)
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    render_chat = lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)  # noqa: E731
    try:
        call = adapter.messages(parse(MessagesRequest, payload), limits, count, render_chat)
    except LmiServeError as exc:
        return RENDERER.body(exc)
    msg_id = enc.message_id()
    encoder: enc.MessageEncoder | enc.MessageStreamEncoder
    if call.stream:
        encoder = enc.MessageStreamEncoder(msg_id, call.model, call.call.input_length, tools=None, reasoning=None)
    else:
        encoder = enc.MessageEncoder(msg_id, call.model, tools=None, reasoning=None)
    engine = create_engine(tiny_model, EngineConfig(max_running=4))
    engine.start()
    try:
        events = [e async for e in engine.generate(call.call.request)]
    finally:
        await engine.stop()
    return b"".join(encoder.on_event(0, e) for e in events) + encoder.close()


_ID = re.compile(rb'"id":"(msg|toolu)_[0-9a-f]{24}"')


def _same_id(raw: bytes) -> bytes:
    return _ID.sub(lambda m: b'"id":"' + m.group(1) + b"_" + b"0" * 24 + b'"', raw)


@pytest.mark.parametrize("name", sorted(CASES))
async def test_golden(name, tiny_model):
    actual = await render(tiny_model, CASES[name])
    assert len(re.findall(rb'"id":"msg_', actual)) == (0 if name.startswith("error") else 1)
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_same_id(actual))
    assert path.exists(), f"missing golden {path}: run with UPDATE_GOLDEN=1 and review it"
    assert _same_id(actual) == path.read_bytes()


def test_every_golden_file_has_a_case():
    assert sorted(p.name for p in GOLDEN_DIR.iterdir()) == sorted(CASES)


def test_stream_error_tail_is_an_error_event():
    assert RENDERER.in_band(LmiServeError("boom")) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n'
    )
