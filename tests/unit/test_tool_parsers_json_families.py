"""The tool-call parsers of the families that mark calls in the text (hermes, qwen3_coder, llama3_json,
granite, mistral): the model outputs of vLLM's own parser tests read the same whole and streamed at any
token boundary, malformed calls stay text, and each family's grammar accepts its own calls only."""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

import pytest

from lmiserve.protocols.textgen.tools.output import Arguments, CallStart, Content
from lmiserve.protocols.textgen.tools.parsers import ToolParser, text_literal, tool_parser
from lmiserve.protocols.textgen.tools.spec import Function, ToolSpec

WEATHER = Function(
    "get_weather",
    "Get the current weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
)
AREA = Function(
    "calculate_area",
    None,
    {
        "type": "object",
        "properties": {"shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"}},
    },
)
TYPES = Function(
    "test_types",
    None,
    {
        "type": "object",
        "properties": {
            "int_param": {"type": "integer"},
            "float_param": {"type": "float"},
            "bool_param": {"type": "boolean"},
            "str_param": {"type": "string"},
            "obj_param": {"type": "object"},
            "maybe": {"type": ["string", "null"]},
        },
    },
)
FUNCTIONS = [WEATHER, AREA, TYPES]


# --- reading a whole output and streaming it --------------------------------------------------------


@dataclass
class Read:
    content: str = ""  # the Content pieces, concatenated
    names: list[str] = field(default_factory=list)  # CallStart names, by index
    arguments: list[str] = field(default_factory=list)  # Arguments pieces concatenated, by index
    pieces: list[Any] = field(default_factory=list)


def read(parser: ToolParser, chunks: list[str], functions: list[Function] = FUNCTIONS) -> tuple[Any, Read]:
    reader, out = parser.reader(functions), Read()
    for chunk in chunks:
        out.pieces += reader.feed(chunk)
    out.pieces += reader.finish()
    for piece in out.pieces:
        if isinstance(piece, Content):
            out.content += piece.text
        elif isinstance(piece, CallStart):
            assert piece.index == len(out.names)
            out.names.append(piece.name)
            out.arguments.append("")
        elif isinstance(piece, Arguments):
            out.arguments[piece.index] += piece.text
    return reader, out


def check(
    name: str,
    text: str,
    calls: list[tuple[str, dict[str, Any]]],
    content: str | None,
    functions: list[Function] = FUNCTIONS,
) -> None:
    """`text` read whole says `calls` and `content`; streamed in two pieces at every offset and one
    character at a time, the pieces say the same."""
    parser = tool_parser(name)
    reader, _ = read(parser, [text], functions)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == calls
    assert reader.content == content
    assert reader.done
    parsed = parser.parse(text, final=True, functions=functions)
    final_arguments = [c.arguments for c in reader.calls]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in splits:
        _, streamed = read(parser, chunks, functions)
        assert streamed.content == parsed.content, chunks
        assert streamed.names == [c[0] for c in calls], chunks
        assert streamed.arguments == final_arguments, chunks


def check_text(name: str, text: str, functions: list[Function] = FUNCTIONS) -> None:
    """`text` (a malformed call) is plain text at the end, whatever the token boundaries, and reading it
    never raises."""
    parser = tool_parser(name)
    reader, _ = read(parser, [text], functions)
    assert reader.calls == [] and reader.content == text
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        reader, _ = read(parser, chunks, functions)
        assert reader.calls == [] and reader.content == text


# --- hermes -----------------------------------------------------------------------------------------

REASONING = "好的，用户现在要研发一个5MW的燃气轮机，需要确定总体参数。\n</think>\n\n"
SEARCH = '{"question": "5MW燃气轮机设计参数 空气流量 压气机压比 转速"}'


def test_hermes_call_after_text():
    text = f'{REASONING}<tool_call>\n{{"name": "internet_search", "arguments": {SEARCH}}}\n</tool_call>\n\n '
    check("hermes", text, [("internet_search", json.loads(SEARCH))], REASONING)
    reader, _ = read(tool_parser("hermes"), [text])
    assert reader.calls[0].arguments == SEARCH  # the raw JSON text the model wrote


def test_hermes_parallel_calls_and_text_after():
    text = (
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Dallas", "unit": "fahrenheit"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "calculate_area", "arguments": {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3}}\n'
        "</tool_call>\nDone {ok}."
    )
    calls = [
        ("get_weather", {"city": "Dallas", "unit": "fahrenheit"}),
        ("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3}),
    ]
    check("hermes", text, calls, "\nDone {ok}.")


def test_hermes_escapes_and_braces_in_strings():
    arguments = {"text": 'He said "Hello {world}" \\ </tool_call>', "n": [1, -2.5e3, None, True]}
    text = f'<tool_call>{{"name": "parser_tool", "arguments": {json.dumps(arguments)}}}</tool_call>'
    check("hermes", text, [("parser_tool", arguments)], None)


def test_hermes_unclosed_block_at_the_end_is_a_call():
    check(
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        [("get_weather", {"city": "Paris"})],
        None,
    )


def test_hermes_malformed_calls_stay_text():
    check_text("hermes", 'I will call <tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>')
    check_text("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    check_text("hermes", "<tool_call>get_weather(city='Paris')</tool_call>")
    check_text("hermes", '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>')
    check_text("hermes", '<tool_call>{"name": "get_weather"}</tool_call>')
    check_text("hermes", "a <tool_ca")


def test_hermes_malformed_block_between_calls():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{oops}</tool_call>'
    reader, _ = read(tool_parser("hermes"), [text])
    assert [(c.name, c.arguments) for c in reader.calls] == [("a", "{}")]
    assert reader.content == " <tool_call>{oops}</tool_call>"


# --- qwen3_coder ------------------------------------------------------------------------------------

DALLAS = "<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>"


def test_qwen3_coder_calls():
    check("qwen3_coder", DALLAS, [("get_weather", {"city": "Dallas", "unit": "fahrenheit"})], None)
    text = "Sure! Let me check the weather for you." + DALLAS
    check("qwen3_coder", text, [("get_weather", {"city": "Dallas", "unit": "fahrenheit"})], text[: -len(DALLAS)])
    orlando = DALLAS.replace("Dallas", "Orlando")
    calls = [("get_weather", {"city": c, "unit": "fahrenheit"}) for c in ("Dallas", "Orlando")]
    check("qwen3_coder", DALLAS + "\n" + orlando, calls, None)


def test_qwen3_coder_values_by_schema_type():
    text = (
        "Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n"
        "<parameter=shape>\nrectangle\n</parameter>\n"
        '<parameter=dimensions>\n{"width": 10, \n "height": 20}\n</parameter>\n'
        "<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    calls = [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})]
    check("qwen3_coder", text, calls, "Let me calculate that area for you.")
    text = (
        "<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n"
        "<parameter=float_param>\n3.14\n</parameter>\n<parameter=bool_param>\nTrue\n</parameter>\n"
        '<parameter=str_param>\n123\n</parameter>\n<parameter=obj_param>\n{"key": "value"}\n</parameter>\n'
        "<parameter=maybe>\nnull\n</parameter>\n<parameter=unknown>\n[1, 2]\n</parameter>\n"
        "<parameter=unknown_text>\nhello world\n</parameter>\n</function>\n</tool_call>"
    )
    expected = {
        "int_param": 42,
        "float_param": 3.14,
        "bool_param": True,
        "str_param": "123",  # a string parameter stays text
        "obj_param": {"key": "value"},
        "maybe": None,
        "unknown": [1, 2],
        "unknown_text": "hello world",
    }
    check("qwen3_coder", text, [("test_types", expected)], None)
    # a tool the request does not declare: JSON when the value reads as JSON
    undeclared = {**expected, "str_param": 123, "bool_param": "True"}
    check("qwen3_coder", text.replace("test_types", "other"), [("other", undeclared)], None)


def test_qwen3_coder_multiline_text_and_lenient_ends():
    code = "def f(x):\n    return x < 1\n\n"
    text = f"<function=calculate_area>\n<parameter=shape>\n{code}\n</parameter>\n<parameter=precision>\n2\n</function>"
    check("qwen3_coder", text, [("calculate_area", {"shape": code, "precision": 2})], None)


def test_qwen3_coder_streams_a_parameter_at_a_time():
    _, streamed = read(tool_parser("qwen3_coder"), list(DALLAS))
    assert [p for p in streamed.pieces if not isinstance(p, Content)] == [
        CallStart(0, "get_weather"),
        Arguments(0, '{"city": "Dallas"'),
        Arguments(0, ', "unit": "fahrenheit"'),
        Arguments(0, "}"),
    ]


def test_qwen3_coder_malformed_calls_stay_text():
    check_text("qwen3_coder", DALLAS[: DALLAS.index("</function>")])  # never closed
    check_text("qwen3_coder", "<tool_call>\n<function=get weather>\n</function>\n</tool_call>")
    check_text("qwen3_coder", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')


# --- llama3_json ------------------------------------------------------------------------------------


def test_llama3_json_calls():
    check(
        "llama3_json",
        '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
        [("searchTool", {"query": "test query", "limit": 10})],
        None,
    )
    check(
        "llama3_json",
        '{"name": "searchTool", "arguments": {"query": "test"}}',
        [("searchTool", {"query": "test"})],
        None,
    )
    check(
        "llama3_json",
        ' <|python_tag|>{"name": "getOpenIncidentsTool", "parameters": {}}',
        [("getOpenIncidentsTool", {})],
        None,
    )


def test_llama3_json_several_calls():
    text = (
        '{"name": "searchTool", "parameters": {"query": "test1"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}} ; '
        '{"name": "searchTool", "parameters": {"query": "test2"}}'
    )
    calls = [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]
    check("llama3_json", text, calls, None)
    text = (
        '{"name": "simpleTool", "parameters": {"value": "test"}}; '
        '{"name": "complexTool", "parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}} '
        "Would you like to know more?"
    )
    calls = [
        ("simpleTool", {"value": "test"}),
        ("complexTool", {"config": {"database": {"connection": {"pool": {"size": 10}}}}}),
    ]
    check("llama3_json", text, calls, " Would you like to know more?")


def test_llama3_json_strings_with_brackets_and_quotes():
    arguments = {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}, "q": 'He said "Hi {x}"'}
    check("llama3_json", json.dumps({"name": "searchTool", "parameters": arguments}), [("searchTool", arguments)], None)


def test_llama3_json_text_and_malformed_calls():
    check(
        "llama3_json",
        "This is just some text without any tool calls",
        [],
        "This is just some text without any tool calls",
    )
    check_text("llama3_json", 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}}')
    check_text("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}')
    check_text("llama3_json", '{"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "searchTool", "param')
    check_text("llama3_json", '<|python_tag|>brave_search.call(query="weather")')


# --- granite ----------------------------------------------------------------------------------------


def test_granite_calls():
    tokyo = ("get_weather", {"city": "Tokyo"})
    check("granite", '<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', [tokyo], None)
    check("granite", '<tool_call> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', [tokyo], None)
    text = """<|tool_call|> [
  {"name": "get_weather", "arguments": {"city": "Tokyo"}},
  {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}
]"""
    check("granite", text, [tokyo, ("get_time", {"timezone": "Asia/Tokyo"})], None)
    check("granite", '<|tool_call|> [{"name": "refresh", "arguments": {}}]', [("refresh", {})], None)
    text = 'Let me check the weather for you.\n<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]\nI\'ll get that information.'
    check("granite", text, [tokyo], "Let me check the weather for you.\n\nI'll get that information.")


def test_granite_data_types_and_escapes():
    arguments = {
        "string_field": "hello",
        "int_field": 42,
        "float_field": 3.14,
        "bool_field": True,
        "null_field": None,
        "array_field": ["a", "b", "c"],
        "object_field": {"nested": "value"},
        "empty_array": [],
        "empty_object": {},
        "quoted": 'He said "hello"',
        "path": "C:\\Users\\file.txt",
        "newline": "line1\nline2",
        "unicode": "emoji: 🎉",
    }
    text = '<tool_call> [{\n  "name": "test_function",\n  "arguments": ' + json.dumps(arguments, indent=2) + "\n}]"
    check("granite", text, [("test_function", arguments)], None)


def test_granite_malformed_calls_stay_text():
    check_text("granite", '<|tool_call|> [{"name": "func", "arguments": {')
    check_text("granite", '<|tool_call|> {"name": "func", "arguments": {}}')  # not an array
    check_text("granite", '<|tool_call|>[{"name": "func", "arguments": "not a dict"}]')
    check_text("granite", 'Some text [{"name": "func"}]')
    check_text("granite", "<|tool_call|>[]")


# --- mistral ----------------------------------------------------------------------------------------


WEATHER_ARGS = {"city": "San Francisco", "state": "CA", "unit": "celsius"}


def test_mistral_array_calls():
    check(
        "mistral", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', [("add", {"a": 3.5, "b": 4})], None
    )
    check(
        "mistral",
        '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
        [("add", {"a": 3, "b": 4})],
        None,
    )
    text = '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, "name": "get_current_weather"}]'
    check("mistral", text, [("get_current_weather", WEATHER_ARGS)], None)
    text = '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]'
    check("mistral", text, [("get_age", {"name": "John Doe"})], None)
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]'
    check("mistral", text, [("add", {"a": 3.5, "b": 4}), ("get_current_weather", WEATHER_ARGS)], None)


def test_mistral_name_then_arguments():
    check("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}', [("add", {"a": 3.5, "b": 4})], None)
    text = 'Let me see. [TOOL_CALLS]get_current_weather[ARGS]{"city": "San Francisco", "state": "CA", "unit": "celsius"}[TOOL_CALLS]add[ARGS]{"a": "3"}'
    check("mistral", text, [("get_current_weather", WEATHER_ARGS), ("add", {"a": "3"})], "Let me see. ")


def test_mistral_text_and_malformed_calls():
    check("mistral", "This is a test", [], "This is a test")
    # vLLM's "multiple_tools" output misses the second call's closing brace
    check_text(
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", "arguments":{"city": "San Francisco"}]',
    )
    check_text("mistral", '[TOOL_CALLS]add[ARGS]{"a": 3.5,')
    check_text("mistral", "[TOOL_CALLS]add[ARGS]3.5")
    check_text("mistral", "[TOOL_CALLS]add the numbers")


def test_mistral_ids():
    parser = tool_parser("mistral")
    ids = {parser.call_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(len(i) == 9 and set(i) <= set(string.ascii_letters + string.digits) for i in ids)


# --- the template markers ---------------------------------------------------------------------------

LLAMA31 = """{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}
{{- "<|python_tag|>" + tool_call.name + ".call(" }}
{%- elif message.role == "tool" or message.role == "ipython" %}{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}"""
LLAMA32 = LLAMA31.replace('{{- "<|python_tag|>" + tool_call.name + ".call(" }}', "")
LLAMA4 = """{{- "<|header_start|>system<|header_end|>\\n\\n" }}{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- '<|python_start|>' }}{{- '{"name": "' + tool_call.function.name + '", ' }}{{- '"parameters": ' }}
{{- "<|header_start|>ipython<|header_end|>\\n\\n" }}"""


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ('{%- for tool_call in message.tool_calls %}{{- \'<tool_call>\\n{"name": "\' }}', {"hermes"}),
        (
            "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k + '>\\n' }}",
            {"qwen3_coder", "hermes"},
        ),
        (LLAMA31, {"llama3_json"}),
        (LLAMA32, {"llama3_json"}),
        (LLAMA4, set()),
        ("{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] }}", {"granite"}),
        ('{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}', {"mistral"}),
    ],
)
def test_template_markers(template: str, expected: set[str]):
    names = ("hermes", "qwen3_coder", "llama3_json", "granite", "mistral")
    found = {n for n in names if any(m in template for m in tool_parser(n).template_markers)}
    assert found == expected


# --- grammars ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    import llguidance.hf

    from helpers.tiny_model import build_tiny_tokenizer

    hf = build_tiny_tokenizer()
    return hf, llguidance.hf.from_tokenizer(hf)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    import llguidance

    hf, tok = tokenizer
    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(lark, tok) == ""
    matcher = llguidance.LLMatcher(tok, lark, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(hf.encode(text, add_special_tokens=False))) and matcher.is_accepting()


def spec(mode: str = "required", parallel: bool = True) -> ToolSpec:
    return ToolSpec([WEATHER, AREA], mode, parallel)  # type: ignore[arg-type]


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
QWEN_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
QWEN_AREA = '<tool_call>\n<function=calculate_area>\n<parameter=shape>\na <b>\n\nc\n</parameter>\n<parameter=dimensions>\n{"w": 1}\n</parameter>\n</function>\n</tool_call>'
GRAMMAR_CASES = [
    # (parser, accepted, rejected: an argument of the wrong type or a missing required one)
    ("hermes", [f" {HERMES_CALL}", f"{HERMES_CALL}\n{HERMES_CALL}"], [HERMES_CALL.replace("3", '"3"'), "Paris"]),
    (
        "qwen3_coder",
        [QWEN_CALL, f"\n{QWEN_CALL}\n{QWEN_AREA}", QWEN_CALL.replace("Paris", "Paris\n</param")],
        [QWEN_CALL.replace("\n3\n", "\nthree\n"), QWEN_CALL.replace("<parameter=city>\nParis\n</parameter>\n", "")],
    ),
    (
        "llama3_json",
        ['{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "calculate_area", "parameters": {}}'],
        ['{"name": "get_weather", "parameters": {"days": 3}}', '{"name": "get_weather", "arguments": {"city": "P"}}'],
    ),
    (
        "granite",
        ['<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'],
        ['<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3.5}}]', "<|tool_call|>[]"],
    ),
    (
        "mistral",
        [
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "calculate_area", "arguments": {}}]'
        ],
        [
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 1}}]',
            '[TOOL_CALLS]get_weather[ARGS]{"city": "P"}',
        ],
    ),
]


@pytest.mark.parametrize(("name", "accepted", "rejected"), GRAMMAR_CASES)
def test_grammar_accepts_the_family_calls(tokenizer, name: str, accepted: list[str], rejected: list[str]):
    parser = tool_parser(name)
    grammar = parser.grammar(spec())
    assert grammar.kind == "ebnf"
    for text in accepted:
        assert accepts(tokenizer, grammar.value, text), text
        parsed = parser.parse(text, final=True, functions=[WEATHER, AREA])
        assert parsed.calls and all(c.complete for c in parsed.calls), text
    for text in rejected:
        assert not accepts(tokenizer, grammar.value, text), text


@pytest.mark.parametrize(("name", "accepted", "rejected"), GRAMMAR_CASES)
def test_grammar_one_call(tokenizer, name: str, accepted: list[str], rejected: list[str]):
    parser = tool_parser(name)
    one = accepted[0]
    if name in ("granite", "mistral"):  # a one-element array
        one = one.replace(', {"name": "calculate_area", "arguments": {}}', "")
    elif name == "llama3_json":
        one = one.split("; ")[0]
    else:
        one = one.strip().split("\n<tool_call>")[0] if name == "hermes" else QWEN_CALL
    several = {"hermes": f"{one}\n{one}", "qwen3_coder": f"{one}\n{one}", "llama3_json": f"{one}; {one}"}.get(
        name, one.replace("}}]", '}}, {"name": "get_weather", "arguments": {"city": "Paris"}}]')
    )
    for named in (ToolSpec([WEATHER], "named"), spec(parallel=False)):
        grammar = parser.grammar(named).value
        assert accepts(tokenizer, grammar, one), one
        assert not accepts(tokenizer, grammar, several), several
    assert accepts(tokenizer, parser.grammar(spec()).value, several)


def test_grammar_markers_as_special_tokens(tokenizer):
    """A marker that is one special token of the tokenizer is matched as that token (`lit`)."""

    def lit(marker: str) -> str:
        return {"</parameter>": "<|system|>", "<|tool_call|>": "<|user|>", "[TOOL_CALLS]": "<|user|>"}.get(
            marker, text_literal(marker)
        )

    qwen = tool_parser("qwen3_coder").grammar(spec(), lit).value
    assert accepts(tokenizer, qwen, QWEN_AREA.replace("</parameter>", "<|system|>"))
    assert not accepts(tokenizer, qwen, QWEN_AREA)
    for name in ("granite", "mistral"):
        grammar = tool_parser(name).grammar(spec(), lit).value
        assert accepts(tokenizer, grammar, '<|user|>[{"name": "calculate_area", "arguments": {}}]')
        assert not accepts(tokenizer, grammar, '[TOOL_CALLS][{"name": "calculate_area", "arguments": {}}]')


def test_mistral_grammar_with_an_args_token(tokenizer):
    """A tokenizer with ``[ARGS]`` (v11 on) gets ``[TOOL_CALLS]NAME[ARGS]{...}`` calls."""

    def lit(marker: str) -> str:
        return {"[TOOL_CALLS]": "<|user|>", "[ARGS]": "<|assistant|>"}.get(marker, text_literal(marker))

    parser = tool_parser("mistral")
    one = '<|user|>get_weather<|assistant|>{"city": "Paris", "days": 3}'
    two = one + "<|user|>calculate_area<|assistant|>{}"
    grammar = parser.grammar(spec(), lit).value
    assert accepts(tokenizer, grammar, one) and accepts(tokenizer, grammar, two)
    assert not accepts(tokenizer, grammar, one.replace("3", '"3"'))
    assert not accepts(tokenizer, grammar, '<|user|>[{"name": "calculate_area", "arguments": {}}]')
    grammar = parser.grammar(ToolSpec([WEATHER], "named"), lit).value
    assert accepts(tokenizer, grammar, one) and not accepts(tokenizer, grammar, one + one)
    text = one.replace("<|user|>", "[TOOL_CALLS]").replace("<|assistant|>", "[ARGS]")  # as the reader sees it
    assert [(c.name, c.arguments) for c in parser.parse(text, final=True).calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}')
    ]


# --- any output -------------------------------------------------------------------------------------

ATOMS = {
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        "\n",
        " ",
        '{"name": "f", "arguments": {"a": [1, "}"]}}',
        "{",
        "}",
        '"x"',
        ":",
        ",",
        "1",
        "tr",
        "<tool_",
        "hi",
    ],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "\n",
        "<function=get_weather>",
        "<function=",
        ">",
        "<parameter=city>",
        "<parameter=",
        "</parameter>",
        "</function>",
        "Paris",
        "3",
        "<tool_",
    ],
    "llama3_json": [
        "<|python_tag|>",
        "; ",
        " ",
        '{"name": "f", "parameters": {"a": 1}}',
        "{",
        "}",
        '"name"',
        ":",
        '"f"',
        ",",
        "1",
        "hi",
        "<|py",
    ],
    "granite": [
        "<|tool_call|>",
        "<tool_call>",
        "[",
        "]",
        " ",
        '{"name": "f", "arguments": {"a": 1}}',
        ", ",
        "{",
        "}",
        '"x"',
        "hi",
        "<|tool",
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[ARGS]",
        "[",
        "]",
        " ",
        '{"name": "f", "arguments": {}}',
        "add",
        '{"a": 1}',
        "{",
        "}",
        '"x"',
        "hi",
        "[TOOL_",
        "[AR",
    ],
}


@pytest.mark.parametrize("name", sorted(ATOMS))
def test_any_output_reads_prefix_stable(name: str):
    """Random outputs of the family's pieces: reading never raises, and a longer text never takes back
    what a shorter one said (content only grows; a named call keeps its name; arguments only grow)."""
    parser, rng = tool_parser(name), random.Random(name)
    for _ in range(150):
        text = "".join(rng.choice(ATOMS[name]) for _ in range(rng.randint(1, 10)))
        before = parser.parse("", final=False, functions=FUNCTIONS)
        for end in range(1, len(text) + 1):
            parser.parse(text[:end], final=True, functions=FUNCTIONS)
            now = parser.parse(text[:end], final=False, functions=FUNCTIONS)
            assert now.content.startswith(before.content), text[:end]
            named = list(takewhile(lambda c: c.name is not None, before.calls))  # what a reader reported
            assert len(now.calls) >= len(named), text[:end]
            for old, new in zip(named, now.calls):
                assert new.name == old.name and new.arguments.startswith(old.arguments), text[:end]
            before = now


def test_interleaved_streams_read_alike():
    """Two streams that share a start and then differ, read in turns (the JSON readings are resumed
    from earlier, shorter texts), say what each text says when read alone."""
    from lmiserve.protocols.textgen.tools.parsers import blocks

    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    second = first.replace('"Paris", "days": 3', '"Lyon"') + " ok"
    parser = tool_parser("hermes")
    snapshots = []
    for end in range(1, max(len(first), len(second)) + 1):
        for text in (first[:end], second[:end]):
            snapshots.append((text, parser.parse(text, final=False)))
    for text, parsed in snapshots:
        blocks._readers.clear()
        assert parser.parse(text, final=False) == parsed, text
