"""TGI wire formats, byte for byte: the tiny model generates greedily in process (real engine, real
tokenizer), the TGI adapter and formatters render, and the bytes must equal tests/golden/tgi/<case>.
`UPDATE_GOLDEN=1 pytest tests/unit/test_tgi_golden.py` rewrites them (review the diff).

Floats are compared to 3 decimals (everything else byte for byte): engine work that moves logprobs in
the last bits (batch shapes, kernels) must not churn these files."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.limits import TextGenLimits as TgiLimits
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.protocols.textgen.validation import build
from lmiserve.protocols.tgi import encoders as fmt
from lmiserve.protocols.tgi.errors import RENDERER
from lmiserve.protocols.tgi.schema import TgiParameters

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "tgi"
PROMPT = "Deep learning is"

CASES: dict[str, tuple[str, dict]] = {
    "generate_default.json": ("json", {"max_new_tokens": 5}),
    "generate_details.json": ("json", {"max_new_tokens": 5, "details": True}),
    "generate_prefill_top_tokens.json": (
        "json",
        {"max_new_tokens": 3, "decoder_input_details": True, "top_n_tokens": 2},
    ),
    "generate_return_full_text_stop.json": (
        "json",
        {"max_new_tokens": 8, "details": True, "return_full_text": True, "stop": ["J"]},
    ),
    "compat_list.json": ("compat", {"max_new_tokens": 4, "details": True}),
    "stream_default.sse": ("sse", {"max_new_tokens": 4}),
    "stream_details_top_tokens.sse": ("sse", {"max_new_tokens": 4, "details": True, "top_n_tokens": 2}),
    "stream_validation_error.sse": ("sse", {"max_new_tokens": 4, "decoder_input_details": True}),
    "error_validation.json": ("json", {"max_new_tokens": 1000}),
}


async def render(tiny_model, kind: str, params: dict) -> bytes:
    tokenizer = tiny_model.tokenizer
    engine = create_engine(tiny_model, EngineConfig(max_running=4))
    engine.start()
    try:
        limits = TgiLimits(max_input_tokens=255, max_total_tokens=256)
        count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
        special = lambda i: tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
        try:
            call = build(PROMPT, TgiParameters(**params), limits, count, stream=kind == "sse")
        except InvalidRequest as exc:
            return RENDERER.in_band(exc) if kind == "sse" else RENDERER.body(exc)
        shape = fmt.AnswerShape.of(PROMPT, call)
        events = [e async for e in engine.generate(call.request)]
        encoder = (
            fmt.StreamEncoder(shape, special)
            if kind == "sse"
            else fmt.GenerateEncoder(shape, special, compat=kind == "compat")
        )
        return b"".join(encoder.on_event(0, e) for e in events) + encoder.close()
    finally:
        await engine.stop()


@pytest.mark.parametrize("name", sorted(CASES))
async def test_golden(name, tiny_model):
    kind, params = CASES[name]
    actual = await render(tiny_model, kind, params)
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(actual)
    assert path.exists(), f"missing golden {path}: run with UPDATE_GOLDEN=1 and review it"
    assert same_bytes(actual, path.read_bytes())


_FLOAT = re.compile(rb"-?\d+\.\d+(?:e-?\d+)?")


def same_bytes(actual: bytes, expected: bytes) -> bool:
    """Equal bytes, with every float rounded to 3 decimals on both sides."""
    norm = lambda raw: _FLOAT.sub(lambda m: b"%.3f" % float(m.group()), raw)  # noqa: E731
    return norm(actual) == norm(expected)


def test_every_golden_file_has_a_case():
    assert sorted(p.name for p in GOLDEN_DIR.iterdir()) == sorted(CASES)
