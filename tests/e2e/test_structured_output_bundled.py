"""Structured output on the real bundled SmolLM2: varied schemas and a regex, greedy and seeded, all
sequences in one batch; every output that finished parses and validates (`jsonschema`) or full-matches."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from lmiserve.core.events import FinishReason
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine

pytestmark = pytest.mark.e2e

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "sunny": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 30},
        },
        "required": ["city", "temperature", "sunny"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "book": {
                "type": "object",
                "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"}},
                "required": ["title", "year"],
                "additionalProperties": False,
            }
        },
        "required": ["book"],
        "additionalProperties": False,
    },
]
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
PROMPT = "<|im_start|>user\nAnswer in JSON: {}<|im_end|>\n<|im_start|>assistant\n"


async def test_bundled_model_outputs_validate(smollm_model):
    engine = create_engine(smollm_model, EngineConfig(max_running=16))
    engine.start()
    try:
        jobs = []
        for i, schema in enumerate(SCHEMAS):
            for sampled in (False, True):
                params = SamplingParams(
                    max_new_tokens=120, grammar=Grammar("json_schema", json.dumps(schema)), do_sample=sampled, seed=i
                )
                jobs.append((schema, GenerationRequest(PROMPT.format("describe something"), params)))
        regex = GenerationRequest(
            "My phone number is ", SamplingParams(max_new_tokens=30, grammar=Grammar("regex", REGEX))
        )

        async def final(request):
            return [e async for e in engine.generate(request)][-1].finish

        finishes = await asyncio.gather(*(final(r) for _, r in jobs), final(regex))
    finally:
        await engine.stop()
    for (schema, _), finish in zip(jobs, finishes):
        assert finish.reason is FinishReason.EOS_TOKEN, finish.generated_text
        jsonschema.validate(json.loads(finish.generated_text), schema)
    assert re.fullmatch(REGEX, finishes[-1].generated_text)
