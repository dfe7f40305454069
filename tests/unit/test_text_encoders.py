"""The pieces of the embedding and rerank routes that need no server: vLLM's score pairing, the
Matryoshka and prompt declarations read from a model directory, and TEI's error statuses and shapes."""

from __future__ import annotations

import json

import pytest

from lmiserve.core.errors import (
    InvalidRequest,
    MalformedBody,
    ModelNotReady,
    ModelRequired,
    Overloaded,
    SchemaViolation,
    Unauthorized,
)
from lmiserve.models import ModelLoadError
from lmiserve.models.tensor_models import read_matryoshka, read_prompts
from lmiserve.models.text_encoders import InputTooLong, TooManyInputs, WrongModelKind, pairs_of
from lmiserve.protocols.tei.errors import RENDERER, EmptyBatch


def test_score_pairs_one_against_many_and_position_by_position():
    assert pairs_of("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pairs_of(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pairs_of(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    assert pairs_of("q", "a") == [("q", "a")]
    with pytest.raises(InvalidRequest, match="give one text_1, or as many as text_2"):
        pairs_of(["q", "r"], ["a", "b", "c"])
    with pytest.raises(InvalidRequest, match="must not be empty"):
        pairs_of("q", [])


def test_matryoshka_declarations(tmp_path):
    assert read_matryoshka(tmp_path, 32) is None
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"is_matryoshka": True}))
    assert read_matryoshka(tmp_path, 32) == ()
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [16, 8]}))
    assert read_matryoshka(tmp_path, 32) == (8, 16, 32)  # config.json first; the whole size always allowed
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [64]}))
    with pytest.raises(ModelLoadError, match="from 1 to 32"):
        read_matryoshka(tmp_path, 32)


def test_prompts_are_read_from_the_sentence_transformers_config(tmp_path):
    assert read_prompts(tmp_path) == {}
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "bad": 3}, "default_prompt_name": None})
    )
    assert read_prompts(tmp_path) == {"query": "query: "}


@pytest.mark.parametrize(
    ("exc", "status", "body"),
    [
        (
            InputTooLong(0, 600, 512),
            413,
            b'{"error":"Input validation error: `inputs` must have less than 512 '
            b'tokens. Given: 600","error_type":"Validation"}',
        ),
        (
            TooManyInputs(3000, "inputs"),
            413,
            b'{"error":"batch size 3000 > maximum allowed batch size 2048","error_type":"Validation"}',
        ),
        (EmptyBatch("Batch is empty"), 400, b'{"error":"Batch is empty","error_type":"Empty"}'),
        (
            WrongModelKind("m", "embedding", "reranker"),
            400,
            b'{"error":"`model` m is an embedding model: this route needs a reranker model.","error_type":"Backend"}',
        ),
        (ModelRequired("name one"), 400, b'{"error":"Input validation error: name one","error_type":"Validation"}'),
        (Overloaded("full"), 429, b'{"error":"full","error_type":"Overloaded"}'),
        (ModelNotReady("loading"), 503, b'{"error":"loading","error_type":"Unhealthy"}'),
        (SchemaViolation("Failed to deserialize"), 422, b"Failed to deserialize"),
        (MalformedBody("not JSON"), 400, b"not JSON"),
        (Unauthorized("no key"), 401, b""),
    ],
)
def test_tei_error_answers(exc, status, body):
    assert (RENDERER.status(exc), RENDERER.body(exc)) == (status, body)
