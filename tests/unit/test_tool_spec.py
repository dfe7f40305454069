"""`tools` / `tool_choice` / `parallel_tool_calls` validation, and the schema the answer is generated
under: every shape it admits reads back as a plain answer or complete calls whose arguments validate
against the tool's own schema (checked with `jsonschema`)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lmiserve.protocols.openai.errors import RENDERER
from lmiserve.protocols.textgen.errors import ToolError
from lmiserve.protocols.textgen.tools.output import ToolOutput
from lmiserve.protocols.textgen.tools.schema import MAX_PARALLEL_CALLS, output_grammar, output_schema
from lmiserve.protocols.textgen.tools.spec import NO_PARAMETERS, tool_spec

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "arguments": {"type": "object", "properties": {}}}}
NOW = {"function": {"name": "now"}}  # no type, no parameters


def test_defaults_and_modes():
    spec = tool_spec([WEATHER, TIME], None, None)
    assert spec.mode == "auto" and spec.parallel and spec.active
    assert [f.name for f in spec.functions] == ["get_weather", "get_time"]
    assert spec.functions[1].parameters == {"type": "object", "properties": {}}  # TGI's `arguments` alias
    assert tool_spec([NOW], None, None).functions[0].parameters == NO_PARAMETERS
    assert not tool_spec(None, None, None).active and not tool_spec([], None, None).active
    none = tool_spec([WEATHER], "none", None)
    assert none.mode == "none" and not none.active
    assert tool_spec([WEATHER], "required", False).parallel is False
    named = tool_spec([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert named.mode == "named" and [f.name for f in named.functions] == ["get_time"] and not named.parallel
    assert tool_spec([WEATHER, TIME], "get_time", None).mode == "named"  # TGI: a bare function name
    assert tool_spec(None, "none", None).mode == "none"


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "message"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "Tool with name nope not found"),
        ([WEATHER], "nope", None, "Tool with name nope not found"),
        (None, "required", None, '`tool_choice` "required" needs `tools`'),
        (None, "auto", None, '`tool_choice` "auto" needs `tools`'),
        (None, {"type": "function", "function": {"name": "f"}}, None, "no `tools`"),
        ([WEATHER], {"type": "function"}, None, "`tool_choice` must be"),
        ([WEATHER], 3, None, "`tool_choice` must be"),
        ("get_weather", None, None, "`tools` must be a list of functions"),
        (["get_weather"], None, None, "`tools[0]` must be"),
        ([{"type": "retrieval"}], None, None, "`tools[0]` must be"),
        ([{"type": "function"}], None, None, "`tools[0].function` must be an object"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "`tools[0].function.name` must be"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, None, "`tools[0].function.name` must be"),
        ([WEATHER, WEATHER], None, None, "two tools are named get_weather"),
        ([{"function": {"name": "f", "description": 3}}], None, None, "description` must be a string"),
        ([{"function": {"name": "f", "parameters": "x"}}], None, None, "must be a JSON Schema object"),
        ([{"function": {"name": "f", "parameters": {"type": "string"}}}], None, None, "must describe an object"),
        ([{"function": {"name": "f", "parameters": {"properties": []}}}], None, None, "properties` must map"),
        ([{"function": {"name": "f", "parameters": {"required": "a"}}}], None, None, "required` must be a list"),
        ([{"function": {"name": "f", "parameters": {"additionalProperties": 1}}}], None, None, "additionalProperties"),
        ([WEATHER], None, "yes", "`parallel_tool_calls` must be a boolean"),
    ],
)
def test_bad_tools_are_tool_errors(tools, choice, parallel, message):
    with pytest.raises(ToolError, match=message.replace("[", r"\[").replace("(", r"\(")) as info:
        tool_spec(tools, choice, parallel)
    assert RENDERER.status(info.value) == 400
    body = json.loads(RENDERER.body(info.value))["error"]
    assert body["type"] == "invalid_request_error" and body["message"].startswith("Tool error: ")


# --- the output schema ------------------------------------------------------------------------------


def accepted(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except jsonschema.ValidationError:
        return False
    return True


CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
CALLS = f'[{CALL}, {{"name": "get_time", "parameters": {{}}}}]'
PLAIN = '{"content": "Hello"}'


def test_auto_schema_admits_calls_and_a_plain_answer():
    schema = output_schema(tool_spec([WEATHER, TIME], None, None))
    jsonschema.Draft202012Validator.check_schema(schema)
    for text in (CALL, CALLS, PLAIN):
        assert accepted(schema, text), text
    for text in (
        '{"name": "get_weather", "parameters": {}}',  # city is required
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "k"}}',
        '{"name": "other", "parameters": {}}',
        '{"name": "get_time", "parameters": {}, "extra": 1}',
        '{"name": "get_weather", "parameters": {"city": "Paris", "invented": 1}}',  # not declared
        "[]",
        json.dumps([json.loads(CALL)] * (MAX_PARALLEL_CALLS + 1)),
        '{"content": 3}',
    ):
        assert not accepted(schema, text), text


def test_required_named_and_single_call_schemas():
    required = output_schema(tool_spec([WEATHER, TIME], "required", False))
    assert accepted(required, CALL) and not accepted(required, PLAIN) and not accepted(required, CALLS)
    named = output_schema(tool_spec([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None))
    assert accepted(named, '{"name": "get_time", "parameters": {}}')
    assert not accepted(named, CALL) and not accepted(named, PLAIN) and not accepted(named, CALLS)
    assert accepted(output_schema(tool_spec([WEATHER], "required", None)), f"[{CALL}]")


def test_every_admitted_answer_reads_back_as_valid_calls():
    spec = tool_spec([WEATHER, TIME], None, None)
    for text in (CALL, CALLS):
        output = ToolOutput()
        output.feed(text)
        output.finish()
        assert output.done and output.calls
        for call in output.calls:
            function = spec.function(call.name)
            assert function is not None
            jsonschema.validate(json.loads(call.arguments), function.parameters)


def test_grammar_is_the_json_schema_with_name_before_parameters_in_the_clients_order():
    grammar = output_grammar(tool_spec([WEATHER], "required", False))
    assert grammar.kind == "json_schema"
    assert json.loads(grammar.value) == output_schema(tool_spec([WEATHER], "required", False))
    assert grammar.value.index('"name"') < grammar.value.index('"parameters"')
    unsorted = {"function": {"name": "f", "parameters": {"properties": {"zone": {}, "area": {}}}}}
    value = output_grammar(tool_spec([unsorted], "required", False)).value
    assert value.index('"zone"') < value.index('"area"')
    with pytest.raises(ValueError):
        output_schema(tool_spec([WEATHER], "none", None))
