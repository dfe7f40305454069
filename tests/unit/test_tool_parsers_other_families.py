"""The pythonic, llama4_pythonic, deepseek_v3 and openai (harmony) tool-call parsers: answers shaped like
the ones vLLM's parser tests use, read whole and streamed at every split point (the streamed pieces say
what the whole answer says), malformed calls kept as text, and each family's grammar compiled with
llguidance, accepting a call in the family's syntax and rejecting one that breaks it or its schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lmiserve.protocols.textgen.tools.output import Arguments, CallStart, Content
from lmiserve.protocols.textgen.tools.parsers import ToolParser, text_literal
from lmiserve.protocols.textgen.tools.parsers.deepseek import DeepSeekV3Parser
from lmiserve.protocols.textgen.tools.parsers.harmony import HarmonyParser, harmony_reasoning
from lmiserve.protocols.textgen.tools.parsers.pythonic import Llama4PythonicParser, PythonicParser
from lmiserve.protocols.textgen.tools.spec import Function, ToolSpec

PYTHONIC, LLAMA4, DEEPSEEK, HARMONY = PythonicParser(), Llama4PythonicParser(), DeepSeekV3Parser(), HarmonyParser()

# --- reading ------------------------------------------------------------------------------------------


def read_whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, Any]], bool]:
    reader = parser.reader()
    reader.feed(text)
    reader.finish()
    return reader.content, [(c.name, json.loads(c.arguments or "")) for c in reader.calls], reader.done


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[Any, str, list[str], list[str]]:
    """The reader after `pieces`, and what its pieces said: content, call names, arguments per call."""
    reader = parser.reader()
    out = []
    for piece in pieces:
        out += reader.feed(piece)
    out += reader.finish()
    content, names, arguments = "", [], []
    for p in out:
        if isinstance(p, Content):
            content += p.text
        elif isinstance(p, CallStart):
            assert p.index == len(names)
            names.append(p.name)
            arguments.append("")
        else:
            assert isinstance(p, Arguments) and p.index < len(names)
            arguments[p.index] += p.text
    return reader, content, names, arguments


def check_stream(parser: ToolParser, text: str) -> None:
    """At every split point, and one character at a time, the pieces say what the whole answer says."""
    whole = parser.reader()
    whole.feed(text)
    whole.finish()
    expected_content = whole.content or ""
    expected_names = [c.name for c in whole.calls]
    expected_arguments = [c.arguments for c in whole.calls]
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        reader, content, names, arguments = streamed(parser, pieces)
        where = f"split {[len(p) for p in pieces][:2]}"
        assert content.strip() == expected_content.strip() if whole.content is None else content == expected_content, (
            where
        )
        assert names == expected_names, where
        assert arguments == expected_arguments, where
        assert [(c.name, c.arguments) for c in reader.calls] == list(
            zip(expected_names, expected_arguments, strict=True)
        )


def check(
    parser: ToolParser, text: str, calls: list[tuple[str, Any]], content: str | None = None, stream: bool = True
) -> None:
    got_content, got_calls, done = read_whole(parser, text)
    assert got_calls == calls
    assert got_content == content
    assert done
    if stream:
        check_stream(parser, text)


def check_text(parser: ToolParser, text: str) -> None:
    """A malformed answer is plain text whole, and streaming never raises."""
    reader = parser.reader()
    reader.feed(text)
    reader.finish()
    assert reader.calls == []
    assert reader.content == text
    for k in range(len(text) + 1):
        streamed(parser, [text[:k], text[k:]])
    streamed(parser, list(text))


# --- pythonic -----------------------------------------------------------------------------------------

WEATHER = "get_weather(city='San Francisco', metric='celsius')"
WEATHER_ARGS = {"city": "San Francisco", "metric": "celsius"}
USER = (
    "register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
    "passed_test=True, aliases=['John', 'Johnny'])"
)
USER_ARGS = {
    "name": "John Doe",
    "age": 37,
    "address": {"city": "San Francisco", "state": "CA"},
    "role": None,
    "passed_test": True,
    "aliases": ["John", "Johnny"],
}
ESCAPED = r"""get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')"""


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (f"[{WEATHER}]", [("get_weather", WEATHER_ARGS)]),
        (f"[{USER}]", [("register_user", USER_ARGS)]),
        ("[get_weather()]", [("get_weather", {})]),
        ("[do_something_cool(additional_data={})]", [("do_something_cool", {"additional_data": {}})]),
        ("[do_something_cool(steps=[])]", [("do_something_cool", {"steps": []})]),
        (f"[{ESCAPED}]", [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
        (f"[{WEATHER}, {USER}]", [("get_weather", WEATHER_ARGS), ("register_user", USER_ARGS)]),
        (
            f"\n  [{WEATHER},get_weather(), do_something_cool(steps=[])]",
            [("get_weather", WEATHER_ARGS), ("get_weather", {}), ("do_something_cool", {"steps": []})],
        ),
        (
            '[f(x=-1.5e3, y=(1, 2), z=true, w=null, v="caf\\u00e9 \\ud83c\\udf89", u=1,)]',
            [("f", {"x": -1500.0, "y": [1, 2], "z": True, "w": None, "v": "café 🎉", "u": 1})],
        ),
    ],
)
def test_pythonic_calls(text: str, calls: list[tuple[str, Any]]) -> None:
    check(PYTHONIC, text, calls)


def test_pythonic_streams_each_argument_as_it_completes() -> None:
    reader = PYTHONIC.reader()
    assert reader.feed("[get_weather(") == [CallStart(0, "get_weather")]
    assert reader.feed("city='Paris'") == []
    assert reader.feed(", ") == [Arguments(0, '{"city": "Paris"')]
    assert reader.feed("unit='celsius'") == []
    assert reader.feed(")") == [Arguments(0, ', "unit": "celsius"}')]
    assert reader.feed(", get_time()]") == [CallStart(1, "get_time"), Arguments(1, "{}")]
    assert reader.finish() == []
    assert reader.content is None and reader.done


def test_pythonic_plain_text_and_text_after_the_list() -> None:
    check(PYTHONIC, "How can I help you today?", [], "How can I help you today?")
    check(PYTHONIC, "[get_time()] Done.", [("get_time", {})], "Done.")


@pytest.mark.parametrize(
    "text",
    [
        "[get_weather(city='Paris', 3)]",  # positional
        "[get_weather(city=os.environ)]",  # an expression
        "[get_weather(city='a' + 'b')]",
        "[get_weather(city='Paris', city='Rome')]",
        "[1, 2, 3] are numbers",
        "[]",
        "[get_weather(city='Paris'",  # unclosed
        "[get_weather(city='Paris')",
        "[get_weather(city='Par",
        "hello world[A(A=\t)A(A=,\t",
        "[A(A=\t)A(A=,\t",
        "[f(x=b'bytes'), g(y=1j)]",
    ],
)
def test_pythonic_malformed_is_text(text: str) -> None:
    check_text(PYTHONIC, text)


# --- llama4_pythonic ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        (
            "<|python_start|>[get_weather(city='LA', metric='C')]<|python_end|>",
            [("get_weather", {"city": "LA", "metric": "C"})],
            None,
        ),
        (
            "[get_weather(city='LA',metric='C'),register_user(name='Doe',age=9)]",
            [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})],
            None,
        ),
        (
            "<|python_start|>[get_weather(city='LA', metric='C'),register_user(name='Doe', age=9)]",
            [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})],
            None,
        ),
        (
            "<|python_start|>[get_weather(), do_something_cool(steps=[])]<|python_end|>\nDone.",
            [("get_weather", {}), ("do_something_cool", {"steps": []})],
            "Done.",
        ),
        ("How can I help you today?", [], "How can I help you today?"),
        ("<|python_end|> is a marker", [], "<|python_end|> is a marker"),
    ],
)
def test_llama4_pythonic(text: str, calls: list[tuple[str, Any]], content: str | None) -> None:
    check(LLAMA4, text, calls, content)


def test_llama4_malformed_is_text() -> None:
    check_text(LLAMA4, "<|python_start|>print('hi')<|python_end|>")
    check_text(LLAMA4, "<|python_start|>[get_weather(city=x)]<|python_end|>")
    check_text(LLAMA4, "<|python_start|>")


# --- deepseek_v3 --------------------------------------------------------------------------------------

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


VARIOUS = (
    '{"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": true, "null_field": null, '
    '"array_field": ["a", "b", "c"], "object_field": {"nested": "value"}, "empty_array": [], "empty_object": {}}'
)
ESCAPES = r'{"text": "He said \"hello\"", "path": "C:\\Users\\file", "newline": "line1\nline2"}'


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        (
            "How can I help you today? I can check weather for you.",
            [],
            "How can I help you today? I can check weather for you.",
        ),
        (
            CALLS_BEGIN + v3("get_weather", '{"city": "Tokyo", "unit": "celsius"}') + CALLS_END,
            [("get_weather", {"city": "Tokyo", "unit": "celsius"})],
            None,
        ),
        (
            CALLS_BEGIN
            + v3("get_weather", '{"city": "Tokyo", "unit": "celsius"}')
            + v3("search_hotels", '{"location": "Tokyo", "check_in": "2025-01-15"}')
            + CALLS_END,
            [
                ("get_weather", {"city": "Tokyo", "unit": "celsius"}),
                ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"}),
            ],
            None,
        ),
        (CALLS_BEGIN + v3("test_function", VARIOUS) + CALLS_END, [("test_function", json.loads(VARIOUS))], None),
        (CALLS_BEGIN + v3("get_current_time", "{}") + CALLS_END, [("get_current_time", {})], None),
        (
            "Let me check the weather for you." + CALLS_BEGIN + v3("get_weather", '{"city": "Paris"}') + CALLS_END,
            [("get_weather", {"city": "Paris"})],
            "Let me check the weather for you.",
        ),
        (CALLS_BEGIN + v3("send_message", ESCAPES) + CALLS_END, [("send_message", json.loads(ESCAPES))], None),
        # the chat template's layout: a newline between calls
        (
            CALLS_BEGIN + v3("a", '{"x": 1}') + "\n" + v3("b", '{\n  "y": [2]\n}') + CALLS_END,
            [("a", {"x": 1}), ("b", {"y": [2]})],
            None,
        ),
        # V3.1
        ("normal text" + CALLS_BEGIN + v31("foo", '{"x":1}') + CALLS_END, [("foo", {"x": 1})], "normal text"),
        (
            "some prefix text"
            + CALLS_BEGIN
            + v31("foo", '{"x":1}')
            + v31("bar", '{"y":2}')
            + CALLS_END
            + " some suffix text",
            [("foo", {"x": 1}), ("bar", {"y": 2})],
            "some prefix text some suffix text",
        ),
        (CALLS_BEGIN + v31("function", '{"x": 1}') + CALLS_END, [("function", {"x": 1})], None),
        # the call closed, the list not (cut off, or its end left out of the text)
        (
            "Sure: " + CALLS_BEGIN + v3("get_weather", '{"city": "Tokyo"}'),
            [("get_weather", {"city": "Tokyo"})],
            "Sure: ",
        ),
    ],
)
def test_deepseek(text: str, calls: list[tuple[str, Any]], content: str | None) -> None:
    check(DEEPSEEK, text, calls, content)


@pytest.mark.parametrize(
    "text",
    [
        CALLS_BEGIN + v3("get_weather", '{"city": "Tokyo"') + CALLS_END,  # JSON not closed
        f'{CALLS_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Tokyo"}}\n```{CALLS_END}',  # no call begin
        "Sure: " + CALLS_BEGIN + v3("get_weather", '{"city": "Tokyo"}')[: -len(CALL_END)],  # call not closed
        CALLS_BEGIN + v31("get_weather", '["Tokyo"]') + CALLS_END,  # not an object
        CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_weather\n{}" + CALL_END + CALLS_END,  # no fence
    ],
)
def test_deepseek_malformed_is_text(text: str) -> None:
    check_text(DEEPSEEK, text)


def test_deepseek_keeps_the_calls_before_a_malformed_one() -> None:
    broken = v3("b", '{"y": ')
    text = "Hi" + CALLS_BEGIN + v3("a", '{"x": 1}') + broken + CALLS_END
    content, calls, _ = read_whole(DEEPSEEK, text)
    assert calls == [("a", {"x": 1})]
    assert content == "Hi" + broken + CALLS_END


# --- openai (harmony) ---------------------------------------------------------------------------------

ANALYSIS = '<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use get_current_weather.<|end|>'


def harmony_call(name: str, arguments: str, end: str = "<|call|>") -> str:
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}{end}"


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>This is a test<|return|>", [], "This is a test"),
        ("<|channel|>final<|message|>Hello!<|return|>", [], "Hello!"),
        (
            ANALYSIS + harmony_call("get_current_weather", '{"location": "Tokyo"}'),
            [("get_current_weather", {"location": "Tokyo"})],
            None,
        ),
        (
            ANALYSIS + harmony_call("get_current_weather", '{\n"location": "Tokyo"\n}'),
            [("get_current_weather", {"location": "Tokyo"})],
            None,
        ),
        (
            ANALYSIS
            + harmony_call("get_current_weather", '{"location": "Tokyo"}')
            + harmony_call("get_user_location", '{"location": "Tokyo"}')
            + '<|start|>assistant<|channel|>commentary to=functions.no_content_type<|message|>{"location": "Tokyo"}<|call|>'
            + harmony_call("empty_args", "{}")
            + harmony_call("no_args", ""),
            [
                ("get_current_weather", {"location": "Tokyo"}),
                ("get_user_location", {"location": "Tokyo"}),
                ("no_content_type", {"location": "Tokyo"}),
                ("empty_args", {}),
                ("no_args", {}),
            ],
            None,
        ),
        (
            ANALYSIS
            + harmony_call("get_current_weather", '{"location": "Tokyo"}')
            + "<|start|>assistant<|channel|>final<|message|>This tool call will get the weather.<|return|>",
            [("get_current_weather", {"location": "Tokyo"})],
            "This tool call will get the weather.",
        ),
        # the recipient before the channel, as gpt-oss's chat template writes past calls
        (
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
            [("get_weather", {"city": "Paris"})],
            None,
        ),
        (
            ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
            [("get_weather", {"city": "Paris"})],
            None,
        ),
        # a preamble is content; a built-in tool's call is not a function call
        (
            "<|channel|>commentary<|message|>Checking the weather.<|end|>"
            + '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>'
            + harmony_call("get_weather", '{"city": "Paris"}'),
            [("get_weather", {"city": "Paris"})],
            "Checking the weather.",
        ),
        # the stop token left out of the text
        (
            ANALYSIS + harmony_call("get_weather", '{"city": "Paris"}', end=""),
            [("get_weather", {"city": "Paris"})],
            None,
        ),
        (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Hi", [], "Hi"),
        # no header at all (the prompt opened the final message)
        ("Just text.", [], "Just text."),
    ],
)
def test_harmony(text: str, calls: list[tuple[str, Any]], content: str | None) -> None:
    check(HARMONY, text, calls, content)


def test_harmony_analysis_is_reasoning_not_content() -> None:
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    content, calls, _ = read_whole(HARMONY, text)
    assert content == "Sunny." and calls == []
    assert harmony_reasoning(text) == 'User asks: "What is the weather in Tokyo?" We need to use get_current_weather.'
    assert (
        harmony_reasoning("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b")
        == "a\nb"
    )
    reader = HARMONY.reader()
    pieces = [p for ch in text for p in reader.feed(ch)] + reader.finish()
    assert "".join(p.text for p in pieces if isinstance(p, Content)) == "Sunny."


def test_harmony_malformed_call_is_text() -> None:
    bad = harmony_call("not_json", "foo")
    content, calls, done = read_whole(HARMONY, ANALYSIS + bad)
    assert calls == [] and content == bad and done
    cut = ANALYSIS + harmony_call("get_weather", '{"city": "Par', end="")
    content, calls, _ = read_whole(HARMONY, cut)
    assert calls == [] and content == harmony_call("get_weather", '{"city": "Par', end="")
    for k in range(len(cut) + 1):
        streamed(HARMONY, [cut[:k], cut[k:]])


# --- template markers ---------------------------------------------------------------------------------

# excerpts of the families' own chat templates (Llama 4 Scout, DeepSeek V3, gpt-oss)
LLAMA4_TEMPLATE = "{{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}{{- '<|python_start|>' }}"
DEEPSEEK_TEMPLATE = "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}"
GPT_OSS_TEMPLATE = (
    '{{- "functions." + tool_call.name + "<|channel|>commentary " }}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}'
)


def test_template_markers() -> None:
    assert PYTHONIC.template_markers == ()
    for parser, template in ((LLAMA4, LLAMA4_TEMPLATE), (DEEPSEEK, DEEPSEEK_TEMPLATE), (HARMONY, GPT_OSS_TEMPLATE)):
        assert parser.reads_special_tokens
        assert all(m in template for m in parser.template_markers)
        others = [t for t in (LLAMA4_TEMPLATE, DEEPSEEK_TEMPLATE, GPT_OSS_TEMPLATE) if t != template]
        assert not any(m in t for m in parser.template_markers for t in others)


def test_detect_picks_these_families() -> None:
    from lmiserve.protocols.textgen.tools.parsers import detect

    assert detect(LLAMA4_TEMPLATE) == "llama4_pythonic"
    assert detect(DEEPSEEK_TEMPLATE) == "deepseek_v3"
    assert detect(GPT_OSS_TEMPLATE) == "openai"


# --- grammars -----------------------------------------------------------------------------------------

WEATHER_TOOL = Function(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1},
            "hourly": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": ["string", "null"]}, "maxItems": 2},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}, "exact": {"type": "boolean"}}},
        },
        "required": ["city"],
    },
)
TIME_TOOL = Function("get_time", None, {"type": "object", "properties": {}})
REQUIRED = ToolSpec([WEATHER_TOOL, TIME_TOOL], "required", parallel=True)
ONE = ToolSpec([WEATHER_TOOL, TIME_TOOL], "required", parallel=False)
NAMED = ToolSpec([WEATHER_TOOL], "named")
MARKERS = [
    "<|python_start|>", "<|python_end|>", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP,
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>", "<|return|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    """(HF tokenizer, llguidance tokenizer, lit): markers as text, and markers as special tokens."""
    import llguidance.hf

    from tests.helpers.tiny_model import build_tiny_tokenizer

    plain = build_tiny_tokenizer()
    special = build_tiny_tokenizer()
    special.add_special_tokens({"additional_special_tokens": MARKERS})

    def as_token(marker: str) -> str:  # as the serving layer writes an added token: by its id
        return f"<[{special.convert_tokens_to_ids(marker)}]>" if marker in MARKERS else text_literal(marker)

    return {
        "text": (plain, llguidance.hf.from_tokenizer(plain, n_vocab=len(plain)), text_literal),
        "special": (special, llguidance.hf.from_tokenizer(special, n_vocab=len(special)), as_token),
    }


def accepts(tokenizers: dict[str, Any], kind: str, parser: ToolParser, spec: ToolSpec, text: str) -> bool:
    import llguidance

    hf, tokenizer, lit = tokenizers[kind]
    grammar = parser.grammar(spec, lit)
    assert grammar.kind == "ebnf"
    source = llguidance.LLMatcher.grammar_from_lark(grammar.value)
    assert llguidance.LLMatcher.validate_grammar(source, tokenizer) == ""
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
    ids = hf.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


PY_CALL = '[get_weather(city="Paris", days=3, hourly=True, tags=["a", None], where={"lat": 1.5, "exact": False})]'
PY_TWO = '  [get_weather(city="Paris", unit="celsius"), get_time()]'


@pytest.mark.parametrize("parser", [PYTHONIC, LLAMA4])
@pytest.mark.parametrize("kind", ["text", "special"])
def test_pythonic_grammar(tokenizers: dict[str, Any], parser: ToolParser, kind: str) -> None:
    for spec in (REQUIRED, ONE, NAMED):
        assert accepts(tokenizers, kind, parser, spec, PY_CALL)
        assert not accepts(tokenizers, kind, parser, spec, '[get_weather(unit="celsius")]')  # city required
        assert not accepts(tokenizers, kind, parser, spec, '[get_weather(city="Paris", unit="kelvin")]')
        assert not accepts(tokenizers, kind, parser, spec, '[get_weather(city="Paris", days=0)]')
        assert not accepts(tokenizers, kind, parser, spec, '[get_weather(days=3, city="Paris")]')  # schema order
        assert not accepts(tokenizers, kind, parser, spec, '[get_weather(city="Paris", hourly=true)]')
        assert not accepts(tokenizers, kind, parser, spec, "get_weather(city='Paris')")
    assert accepts(tokenizers, kind, parser, REQUIRED, PY_TWO)
    assert not accepts(tokenizers, kind, parser, ONE, PY_TWO)
    assert not accepts(tokenizers, kind, parser, NAMED, "[get_time()]")
    _, calls, _ = read_whole(parser, PY_CALL)
    assert calls == [
        (
            "get_weather",
            {"city": "Paris", "days": 3, "hourly": True, "tags": ["a", None], "where": {"lat": 1.5, "exact": False}},
        )
    ]
    if parser is LLAMA4:
        wrapped = f"<|python_start|>{PY_CALL}<|python_end|>"
        assert accepts(tokenizers, kind, parser, REQUIRED, wrapped)
        assert read_whole(parser, wrapped)[1] == calls


@pytest.mark.parametrize("kind", ["text", "special"])
def test_deepseek_grammar(tokenizers: dict[str, Any], kind: str) -> None:
    one = v3("get_weather", '{"city": "Paris", "unit": "celsius"}')
    two = CALLS_BEGIN + one + "\n" + v3("get_time", "{}") + CALLS_END
    for spec in (REQUIRED, ONE, NAMED):
        assert accepts(tokenizers, kind, DEEPSEEK, spec, CALLS_BEGIN + one + CALLS_END)
        assert not accepts(
            tokenizers, kind, DEEPSEEK, spec, CALLS_BEGIN + v3("get_weather", '{"unit": "celsius"}') + CALLS_END
        )
        assert not accepts(
            tokenizers, kind, DEEPSEEK, spec, CALLS_BEGIN + v31("get_weather", '{"city": "Paris"}') + CALLS_END
        )
        assert not accepts(tokenizers, kind, DEEPSEEK, spec, one)
    assert accepts(tokenizers, kind, DEEPSEEK, REQUIRED, "\n" + two)
    assert not accepts(tokenizers, kind, DEEPSEEK, ONE, two)
    assert read_whole(DEEPSEEK, two)[1] == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]


@pytest.mark.parametrize("kind", ["text", "special"])
def test_harmony_grammar(tokenizers: dict[str, Any], kind: str) -> None:
    one = harmony_call("get_weather", '{"city": "Paris", "days": 2}')[len("<|start|>assistant") :]
    two = one + harmony_call("get_time", "{}")
    for spec in (REQUIRED, ONE, NAMED):
        assert accepts(tokenizers, kind, HARMONY, spec, one)
        assert not accepts(tokenizers, kind, HARMONY, spec, one.replace('"city"', '"town"'))
        assert not accepts(tokenizers, kind, HARMONY, spec, one.replace("commentary", "analysis"))
        assert not accepts(tokenizers, kind, HARMONY, spec, "<|channel|>final<|message|>Hi<|return|>")
    assert accepts(tokenizers, kind, HARMONY, REQUIRED, two)
    assert accepts(tokenizers, kind, HARMONY, NAMED, "<|start|>assistant" + one)  # after an analysis message
    assert not accepts(tokenizers, kind, HARMONY, ONE, two)
    assert read_whole(HARMONY, two)[1] == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]


def test_pythonic_strings_with_quotes_escapes_and_newlines() -> None:
    text = "[f(a='it\\'s, (ok)', b=\"x\\\\\", c='''two\nlines ' '' ''', d=\"\"\"q\"\"\", e='')]"
    check(PYTHONIC, text, [("f", {"a": "it's, (ok)", "b": "x\\", "c": "two\nlines ' '' ", "d": "q", "e": ""})])
    check_text(PYTHONIC, "[f(a='one\nline')]")


def test_pythonic_long_argument_streams_fast() -> None:
    code = "x = 1\\n" * 2000
    text = f"[write_file(path='a.py', content='{code}')]"
    reader = PYTHONIC.reader()
    for start in range(0, len(text), 4):  # one token at a time
        reader.feed(text[start : start + 4])
    reader.finish()
    assert [(c.name, json.loads(c.arguments or "")) for c in reader.calls] == [
        ("write_file", {"path": "a.py", "content": "x = 1\n" * 2000})
    ]


FRAGMENTS = {
    PYTHONIC: ["[", "]", "f(", "g (", ")", "a=", "b =", "1", "'x'", '"y\\"', ", ", " ", "\n", "None", "[1]", "'''t", "x", "=="],
    LLAMA4: ["<|python_start|>", "<|python_end|>", "<|py", "[", "]", "f(", ")", "a=", "'x'", ", ", " ", "hi"],
    DEEPSEEK: [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "function", "get", "\n", "```json\n", "```", "{", "}", '"a": 1', "hi", "<｜tool"],
    HARMONY: [
        "<|channel|>", "analysis", "commentary", "final", " to=functions.f", " to=browser.x", "<|constrain|>", "json",
        "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>", "assistant", '{"a": 1}', "{", "}", "hi", "\n", "<|",
    ],
}  # fmt: skip


@pytest.mark.parametrize("parser", list(FRAGMENTS))
def test_snapshots_only_grow(parser: ToolParser) -> None:
    """Random texts made of the family's markers and pieces: each snapshot of a longer prefix keeps what
    the one before said, and the final reading never raises."""
    import random

    rng = random.Random(7)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS[parser]) for _ in range(rng.randint(1, 12)))
        before = parser.parse("", final=False)
        for k in range(1, len(text) + 1):
            now = parser.parse(text[:k], final=False)
            assert now.content.startswith(before.content), text[:k]
            assert len(now.calls) >= len([c for c in before.calls if c.name is not None]), text[:k]
            for old, new in zip(before.calls, now.calls, strict=False):
                assert old.name is None or old.name == new.name, text[:k]
                assert new.arguments.startswith(old.arguments), text[:k]
                assert not old.complete or (new.complete and new.arguments == old.arguments), text[:k]
            before = now
        parser.parse(text, final=True)
