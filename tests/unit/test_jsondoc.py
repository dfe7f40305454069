"""`lmiserve.core.jsondoc`: the one reader of JSON request bodies (depth limit, strict UTF-8, no lone
surrogates, never a RecursionError)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmiserve.core import jsondoc
from lmiserve.core.jsondoc import MAX_JSON_DEPTH, JsonNotText, JsonSyntaxError, JsonTooDeep


def depth_of(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


def test_the_limit_is_64_levels_of_arrays_and_objects():
    assert MAX_JSON_DEPTH == 64
    assert depth_of(jsondoc.loads(b"[" * 64 + b"]" * 64)) == 64
    assert depth_of(jsondoc.loads(b'{"a":' * 64 + b"1" + b"}" * 64)) == 64
    for body in (b"[" * 65 + b"]" * 65, b'{"a":' * 33 + b"[" * 32 + b"1" + b"]" * 32 + b"}" * 33):
        with pytest.raises(JsonTooDeep) as info:
            jsondoc.loads(body)
        assert str(info.value) == "the JSON document is nested deeper than 64 levels"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("depth", [65, 999, 1001, 10_000, 1_000_000])
@pytest.mark.parametrize("kind", ["array", "object", "unclosed"])
def test_deep_documents_never_reach_the_recursive_parser(depth, kind):
    body = {
        "array": b"[" * depth + b"]" * depth,
        "object": b'{"a":' * depth + b"1" + b"}" * depth,
        "unclosed": b'{"inputs": ' + b"[" * depth,
    }[kind]
    with pytest.raises(JsonTooDeep):
        jsondoc.loads(body)


def test_brackets_in_strings_and_escapes_do_not_count():
    text = "[" * 100 + '\\"{[' + "\\\\"
    doc = jsondoc.loads(json.dumps({"a": text, "b": ["]]]]", "\\"], "c": "[" * 70}))
    assert doc["a"] == text and doc["c"] == "[" * 70


def test_lone_surrogates_are_not_text():
    for body in (b'"\\ud800"', b'{"inputs": "a\\udc00b"}', b'{"\\udbff": 1}', b'["\\ud83d"]', b'"\\uDFFF"'):
        with pytest.raises(JsonNotText, match=r"lone surrogate \(\\u[0-9a-f]{4}\)"):
            jsondoc.loads(body)
    assert jsondoc.loads(b'"\\ud83d\\ude00"') == "\U0001f600"  # an escaped pair is one character
    assert jsondoc.loads(b'"\\\\ud800"') == "\\ud800"  # an escaped backslash, then text
    assert jsondoc.loads('"é😀"'.encode()) == "é😀"


def test_bytes_must_be_utf8_and_str_must_be_encodable():
    for body in (b"\xff", b'"\xed\xa0\x80"', b'{"a": "\xc3"}'):
        with pytest.raises(JsonNotText, match="can't decode"):
            jsondoc.loads(body)
    with pytest.raises(JsonNotText, match="surrogates not allowed"):
        jsondoc.loads('"\ud800"')
    assert jsondoc.loads(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a UTF-8 byte-order mark is dropped
    with pytest.raises(TypeError):
        jsondoc.loads(3)  # type: ignore[arg-type]


def test_syntax_errors_keep_the_json_modules_message():
    for body in (b"", b"nonsense", b'{"a" 1}', b"[1,]", b"1 2"):
        with pytest.raises(json.JSONDecodeError) as expected:
            json.loads(body)
        with pytest.raises(JsonSyntaxError) as got:
            jsondoc.loads(body)
        assert (str(got.value), got.value.msg, got.value.pos) == (
            str(expected.value),
            expected.value.msg,
            expected.value.pos,
        )
        assert (got.value.lineno, got.value.colno) == (expected.value.lineno, expected.value.colno)


def test_numbers():
    doc = jsondoc.loads(b"[NaN, Infinity, -Infinity, 1e999, 12345678901234567890]")
    assert math.isnan(doc[0]) and doc[1:4] == [math.inf, -math.inf, math.inf] and doc[4] == 12345678901234567890
    with pytest.raises(JsonSyntaxError, match="integer with too many digits"):
        jsondoc.loads(b'{"seed": 1' + b"0" * 5000 + b"}")


def test_first_value_reads_one_value_and_ignores_what_follows():
    assert jsondoc.first_value("  [1, 2] trailing", 2) == ([1, 2], 8)
    assert jsondoc.first_value(b"[1] " + b"[" * 1000)[0] == [1]  # the depth of the first value only
    with pytest.raises(JsonTooDeep):
        jsondoc.first_value(b"[" * 100 + b"]" * 100 + b" [1]")
    with pytest.raises(JsonNotText):
        jsondoc.first_value('["\\ud800"] 1')


def test_all_values_reads_json_lines():
    assert jsondoc.all_values(b'{"a": 1}\n[2]\n\n"x"\n') == [{"a": 1}, [2], "x"]
    with pytest.raises(JsonTooDeep):
        jsondoc.all_values(b"[1]\n" + b"[" * 65 + b"]" * 65)
    with pytest.raises(JsonSyntaxError) as info:
        jsondoc.all_values(b"[1]\n[2,")
    assert info.value.lineno == 2


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=200,
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(value=json_values, wrap=st.integers(0, 80))
def test_loads_agrees_with_json_within_the_limit_and_refuses_beyond(value, wrap):
    for _ in range(wrap):
        value = [value]
    body = json.dumps(value).encode()
    if depth_of(value) <= MAX_JSON_DEPTH:
        assert jsondoc.loads(body) == json.loads(body)
    else:
        with pytest.raises(JsonTooDeep):
            jsondoc.loads(body)
