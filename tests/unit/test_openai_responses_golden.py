"""The Responses API's wire format, byte for byte (floats to 3 decimals): the tiny model generates greedily
in process, the request is read by `responses_request` and written by `responses_output` with a fixed id
and creation time, and the bytes must equal tests/golden/openai_responses/<case>. The random part of
every item id (``msg_``, ``rs_``, ``fc_`` + 32 hex) reads as 32 zeros, ``call_`` ids as 24 zeros and
``completed_at`` as the creation time, on both sides (the golden files hold that form).
`UPDATE_GOLDEN=1 pytest tests/unit/test_openai_responses_golden.py` rewrites them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lmiserve.core.limits import TextGenLimits
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.protocols.openai.responses_output import Head, ResponseEncoder, ResponseStreamEncoder
from lmiserve.protocols.openai.responses_request import ResponsesRequest, responses_call

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "openai_responses"
CREATED = 1700000000
RESPONSE_ID = "resp_" + "0" * 32
BASE = {"model": "tiny", "input": "What is deep learning?", "instructions": "Be brief.", "temperature": 0}

CASES: dict[str, dict] = {
    "response.json": {**BASE, "max_output_tokens": 4},
    "response_stream.sse": {**BASE, "max_output_tokens": 3, "stream": True},
}


async def render(tiny_model, payload: dict) -> bytes:
    tokenizer = tiny_model.tokenizer
    limits = TextGenLimits(max_input_tokens=255, max_total_tokens=256)

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    def render_chat(messages, **kwargs) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    req = ResponsesRequest.model_validate(payload)
    call = responses_call(req, [], limits, count, render_chat, "tiny", stored=True)
    head = Head(call.echo, id=RESPONSE_ID, created_at=CREATED)
    encoder = ResponseStreamEncoder(head, None, None) if call.stream else ResponseEncoder(head, None, None)
    engine = create_engine(tiny_model, EngineConfig(max_running=4))
    engine.start()
    try:
        events = [e async for e in engine.generate(call.call.request)]
    finally:
        await engine.stop()
    return b"".join(encoder.on_event(0, e) for e in events) + encoder.close()


@pytest.mark.parametrize("name", sorted(CASES))
async def test_golden(name, tiny_model):
    actual = normal(await render(tiny_model, CASES[name]))
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(actual)
    assert path.exists(), f"missing golden {path}: run with UPDATE_GOLDEN=1 and review it"
    assert floats(actual) == floats(normal(path.read_bytes()))


def test_every_golden_file_has_a_case():
    assert sorted(p.name for p in GOLDEN_DIR.iterdir()) == sorted(CASES)


_ITEM_ID = re.compile(rb'"(msg|rs|fc)_[0-9a-f]{32}"')
_CALL_ID = re.compile(rb'"call_[0-9a-f]{24}"')
_COMPLETED = re.compile(rb'"completed_at":\d+')
_FLOAT = re.compile(rb"-?\d+\.\d+(?:e-?\d+)?")


def normal(raw: bytes) -> bytes:
    raw = _ITEM_ID.sub(lambda m: b'"' + m.group(1) + b"_" + b"0" * 32 + b'"', raw)
    raw = _CALL_ID.sub(b'"call_' + b"0" * 24 + b'"', raw)
    return _COMPLETED.sub(b'"completed_at":%d' % CREATED, raw)


def floats(raw: bytes) -> bytes:
    return _FLOAT.sub(lambda m: b"%.3f" % float(m.group()), raw)
