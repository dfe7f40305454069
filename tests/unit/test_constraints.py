"""The wire spellings of structured output read into one `Grammar` (lmiserve.core.constraints)."""

from __future__ import annotations

import json

import pytest

from lmiserve.core import constraints
from lmiserve.core.errors import InvalidRequest
from lmiserve.core.grammar import Grammar
from lmiserve.core.parameters import Limits, parse_parameters, to_sampling

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
AS_GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA))


@pytest.mark.parametrize(
    "tgi",
    [
        {"type": "json", "value": SCHEMA},
        {"type": "json", "value": json.dumps(SCHEMA)},
        {"type": "json_object", "value": SCHEMA},
        {"type": "json_schema", "value": {"name": "x", "schema": SCHEMA}},
    ],
)
def test_tgi_grammar_json_shapes_keep_the_property_order(tgi):
    grammar = constraints.from_tgi(tgi)
    assert grammar == AS_GRAMMAR
    assert list(json.loads(grammar.value)["properties"]) == ["b", "a"]


def test_tgi_regex_and_bad_shapes():
    assert constraints.from_tgi({"type": "regex", "value": "a+"}) == Grammar("regex", "a+")
    for bad in ({"type": "xml", "value": "x"}, {"value": "x"}, {"type": "json", "value": "{not json"}, "a+"):
        with pytest.raises(InvalidRequest):
            constraints.from_tgi(bad)


def test_openai_response_formats():
    assert constraints.from_response_format(None) is None
    assert constraints.from_response_format({"type": "text"}) is None
    assert constraints.from_response_format({"type": "json_object"}) == Grammar("json_object")
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert constraints.from_response_format(spec) == AS_GRAMMAR
    assert constraints.from_response_format({"type": "json", "value": SCHEMA}) == AS_GRAMMAR  # TGI's chat
    assert constraints.from_response_format({"type": "json_object", "value": SCHEMA}) == AS_GRAMMAR  # hf client
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, [1]):
        with pytest.raises(InvalidRequest):
            constraints.from_response_format(bad)


def test_vllm_fields_and_structured_outputs():
    assert constraints.from_vllm({"guided_json": SCHEMA}) == AS_GRAMMAR
    assert constraints.from_vllm({"guided_regex": "a+"}) == Grammar("regex", "a+")
    assert constraints.from_vllm({"guided_choice": ["x", "y"]}) == Grammar("choice", '["x", "y"]')
    assert constraints.from_vllm({"guided_grammar": "start: /a+/"}) == Grammar("ebnf", "start: /a+/")
    assert constraints.from_vllm({"structured_outputs": {"choice": ["x"]}}) == Grammar("choice", '["x"]')
    assert constraints.from_vllm({"structured_outputs": {"json": SCHEMA}}) == AS_GRAMMAR
    assert constraints.from_vllm({}) is None
    with pytest.raises(InvalidRequest, match="only one"):
        constraints.from_vllm({"guided_regex": "a", "guided_choice": ["b"]})
    with pytest.raises(InvalidRequest):
        constraints.from_vllm({"guided_choice": []})


@pytest.mark.parametrize(
    "parameters",
    [
        {"json_schema": SCHEMA},
        {"grammar": {"type": "json", "value": SCHEMA}},
        {"guided_json": json.dumps(SCHEMA)},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
    ],
)
def test_lmi_parameters_carry_the_constraint(parameters):
    sampling = to_sampling(parse_parameters(parameters), Limits(), stream=False)
    assert sampling.grammar == AS_GRAMMAR


def test_lmi_parameters_with_two_constraints_are_refused():
    with pytest.raises(InvalidRequest, match="only one"):
        to_sampling(parse_parameters({"json_schema": SCHEMA, "guided_regex": "a"}), Limits(), stream=False)
