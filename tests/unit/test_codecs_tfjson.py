"""TF Serving's JSON dialect: number tokens, its float formatting rule, message dumps, body layout (goldens)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from lmiserve.core.errors import InvalidRequest, LmiServeError
from lmiserve.protocols.tensor.codecs.tfjson import (
    document,
    dump,
    error_body,
    format_float,
    parse_document,
)
from lmiserve.protocols.tensor.codecs.tftensor import render_columns, render_rows
from lmiserve.protocols.tensor.tfserving.errors import RENDERER

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tfserving"


@pytest.mark.parametrize(
    ("value", "single", "text"),
    [
        (2.5, True, "2.5"),
        (100.0, True, "100.0"),
        (1e7, True, "1e+07"),
        (1234567.0, True, "1234567.0"),
        (float(np.float32(1 / 3)), True, "0.333333343"),
        (1 / 3, False, "0.33333333333333331"),
        (6e-07, False, "6e-07"),
        (0.1, False, "0.1"),
        (float(np.float32(0.1)), True, "0.1"),
        (-0.0, False, "-0.0"),
        (math.nan, True, "NaN"),
        (math.inf, False, "Infinity"),
        (-math.inf, True, "-Infinity"),
    ],
)
def test_float_formatting_rule(value, single, text):
    assert format_float(value, single) == text


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b'{"a": [NaN, Infinity, -Infinity, Inf, -Inf]}', None),
        (b'{"a": 1} trailing bytes are ignored', {"a": 1}),
        (
            b'  {"s": "Inf inside a string stays", "t": "-Infinity"}',
            {"s": "Inf inside a string stays", "t": "-Infinity"},
        ),
    ],
)
def test_parse_document(body, value):
    doc = parse_document(body)
    if value is None:
        a = doc["a"]
        assert math.isnan(a[0]) and a[1:] == [math.inf, -math.inf, math.inf, -math.inf]
    else:
        assert doc == value


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "JSON Parse error: The document is empty"),
        (b"   \n", "JSON Parse error: The document is empty"),
        (b"x", "JSON Parse error: Invalid value. at offset: 0"),
        (b'{"a" 1}', "JSON Parse error: Missing a colon after a name of object member. at offset: 5"),
        (b"[" * 100_000, "JSON Parse error: The document is nested too deeply. at offset: 0"),
    ],
)
def test_parse_errors(body, message):
    with pytest.raises(LmiServeError) as info:
        parse_document(body)
    assert info.value.message == message and RENDERER.status(info.value) == 400


def test_dump_is_pretty_objects_single_line_arrays_and_truncated():
    assert (
        dump({"instances": [1, 2], "x": {"y": "z"}})
        == '{\n    "instances": [1, 2],\n    "x": {\n        "y": "z"\n    }\n}'
    )
    assert dump([1.0, float("nan")]) == "[1.0, NaN]"
    assert len(dump({"k": list(range(500))}).encode()) == 256


def test_error_body_golden():
    assert error_body('bad "thing" é') == (GOLDEN / "error.json").read_bytes()


def test_single_output_rows_golden():
    body = document("predictions", render_rows({"y": np.array([1.0, 2.0, 1 / 3, 1e7, np.nan], dtype=np.float32)}))
    assert body == (GOLDEN / "predictions_fp32.json").read_bytes()


def test_multi_output_rows_golden():
    outputs = {
        "y": np.array([[1.5, 14.75], [9.5, 28.75]], dtype=np.float32),
        "best": np.array([1, 1], dtype=np.int64),
        "name_bytes": np.array([b"\x00\x01", b"ok"], dtype=object),
        "text": np.array([b"a", "é".encode()], dtype=object),
        "flag": np.array([True, False]),
    }
    assert document("predictions", render_rows(outputs)) == (GOLDEN / "predictions_multi.json").read_bytes()


def test_columnar_golden():
    outputs = {"y": np.array([[1 / 3, 2.0]], dtype=np.float64), "best": np.array([0], dtype=np.int64)}
    assert document("outputs", render_columns(outputs)) == (GOLDEN / "outputs_columnar.json").read_bytes()


def test_row_output_checks():
    with pytest.raises(InvalidRequest, match="Tensor name: s has no shape information "):
        render_rows({"s": np.array(1.0)})
    with pytest.raises(InvalidRequest, match="Tensor name: b has inconsistent batch size: 3 expecting: 2"):
        render_rows({"a": np.zeros(2), "b": np.zeros(3)})
    with pytest.raises(InvalidRequest, match="Cannot convert empty tensor map to JSON"):
        render_rows({})
    with pytest.raises(InvalidRequest, match="Failed to write JSON value for tensor type: DT_HALF"):
        render_rows({"h": np.zeros(2, dtype=np.float16)})
    assert (
        document("predictions", render_rows({"a": np.zeros((0, 2)), "b": np.zeros(0)}))
        == b'{\n    "predictions": []\n}'
    )


def test_deeply_nested_ignored_keys_are_skipped_iteratively():
    deep = b"[" * 100_000 + b"]" * 100_000
    doc = parse_document(b'{"junk": ' + deep + b', "instances": [1, NaN], "more": {"a": "}"}}', keep=("instances",))
    assert doc["instances"][0] == 1 and math.isnan(doc["instances"][1]) and set(doc) == {"instances"}
    for body, message in [
        (b'{"instances": ' + deep + b"}", "The document is nested too deeply."),
        (b'{"junk": ' + b"[" * 100_000, "Missing a comma or ']' after an array element."),
        (b'{"junk": ' + deep + b', "instances": [1,,]}', "Invalid value."),
        (b'{"junk": ' + deep + b", 3: 1}", "Missing a name for object member."),
        (b"[" + deep + b"]", "The document is nested too deeply."),
    ]:
        with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(".", r"\.").replace("[", r"\[")):
            parse_document(body, keep=("instances",))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vectorized_float_formatting_equals_the_scalar_rule(dtype):
    from lmiserve.protocols.tensor.codecs.tfjson import format_floats

    rng = np.random.default_rng(0)
    specials = [0.0, -0.0, 100, 1e7, 1234567, 1 / 3, np.nan, np.inf, -np.inf, 6e-7, 1e-45, 3.4e38, 0.1, 2.5]
    with np.errstate(over="ignore"):
        values = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-40, 40, 5000), specials]).astype(
            dtype
        )
    assert format_floats(values) == [format_float(float(v), dtype == np.float32) for v in values]
