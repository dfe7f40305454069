"""V2 datatypes <-> numpy: JSON data (flat and nested), element checks, shape checks, binary layout."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from lmiserve.core.errors import InvalidRequest, LmiServeError
from lmiserve.protocols.tensor.codecs import binary
from lmiserve.protocols.tensor.codecs.datatypes import (
    DTYPES,
    datatype_of,
    fit_shape,
    flatten,
    json_data,
    to_array,
)
from lmiserve.protocols.tensor.kserve.errors import RENDERER

SAMPLES = {
    "BOOL": [True, False, True, True],
    "UINT8": [0, 1, 254, 255],
    "UINT16": [0, 1, 65534, 65535],
    "UINT32": [0, 1, 2**32 - 2, 2**32 - 1],
    "UINT64": [0, 1, 2**64 - 2, 2**64 - 1],
    "INT8": [-128, -1, 0, 127],
    "INT16": [-(2**15), -1, 0, 2**15 - 1],
    "INT32": [-(2**31), -1, 0, 2**31 - 1],
    "INT64": [-(2**63), -1, 0, 2**63 - 1],
    "FP16": [0.5, -1.0, 65504.0, 0.0],
    "FP32": [0.5, -1.25, 3.0e38, 0.0],
    "FP64": [0.1, -1e300, 2.5, 0.0],
    "BYTES": ["a", "", "héllo", "x y"],
}


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_json_round_trip_for_every_datatype(datatype):
    array = to_array(SAMPLES[datatype], datatype, (2, 2), "x")
    assert array.shape == (2, 2)
    assert datatype_of(array) == datatype
    expected = SAMPLES[datatype]
    if datatype in ("FP16", "FP32"):
        expected = np.array(expected, dtype=DTYPES[datatype]).astype(float).tolist()
    assert json_data(array) == expected


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_binary_round_trip_for_every_datatype(datatype):
    array = to_array(SAMPLES[datatype], datatype, (4,), "x")
    raw = binary.encode_tensor(array)
    back = binary.decode_tensor(raw, datatype, (4,), "x")
    assert back.dtype == array.dtype and back.shape == (4,)
    assert back.tolist() == array.tolist()


def test_nested_and_flat_data_are_the_same_tensor():
    nested = to_array([[1, 2, 3], [4, 5, 6]], "INT32", (2, 3), "x")
    flat = to_array([1, 2, 3, 4, 5, 6], "INT32", (2, 3), "x")
    assert nested.tolist() == flat.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_scalar_shape():
    assert to_array([7], "INT64", (), "x").tolist() == 7


def test_null_in_fp_is_nan_and_nan_leaves_as_null():
    array = to_array([1.2, None], "FP64", (2,), "x")
    assert math.isnan(array[1])
    assert json_data(np.array([1.5, np.nan, np.inf], dtype=np.float32)) == [1.5, None, None]


@pytest.mark.parametrize(
    ("data", "datatype", "shape", "message"),
    [
        ([1, 2, 3], "INT32", (2, 2), "shape [2, 2] needs 4 elements, got 3"),
        ([1, 2, 3, 4, 5], "INT32", (2, 2), "needs 4 elements, got 5"),
        ([[1, 2], [3]], "INT32", (2, 2), "needs 4 elements, got 3"),
        ([1.5], "INT32", (1,), "expected an integer for INT32, got number"),
        (["1"], "FP32", (1,), "expected a number for FP32, got string"),
        ([1], "BYTES", (1,), "expected a string for BYTES, got number"),
        ([2], "BOOL", (1,), "expected true or false for BOOL"),
        ([None], "INT8", (1,), "got null"),
        ([300], "UINT8", (1,), "300 is out of range for UINT8"),
        ([-1], "UINT64", (1,), "-1 is out of range for UINT64"),
        ([2**63], "INT64", (1,), "out of range for INT64"),
        ([{"a": 1}], "FP64", (1,), "got object"),
        ([True], "INT32", (1,), "got boolean"),
    ],
)
def test_bad_json_data_is_a_400(data, datatype, shape, message):
    with pytest.raises(LmiServeError) as info:
        to_array(data, datatype, shape, "x")
    assert RENDERER.status(info.value) == 400
    assert message in info.value.message


def test_unknown_datatype():
    with pytest.raises(InvalidRequest, match="invalid datatype for input x"):
        to_array([1], "FP8", (1,), "x")


def test_deep_nesting_is_refused_without_recursion():
    data: list = [1]
    for _ in range(100_000):
        data = [data]
    with pytest.raises(InvalidRequest, match="nesting depth exceeds maximum allowed limit"):
        flatten(data, "x")


def test_bool_accepts_0_and_1_like_mlserver():
    assert to_array([0, 1], "BOOL", (2,), "x").tolist() == [False, True]


@pytest.mark.parametrize(
    ("shape", "expected", "result"),
    [((3, 4), (-1, 4), (3, 4)), ((3,), (-1, 1), (3, 1)), ((3, 1), (-1,), (3,)), ((2, 5), (-1, -1), (2, 5))],
)
def test_fit_shape(shape, expected, result):
    assert fit_shape(np.zeros(shape), expected, "x", "m").shape == result


def test_fit_shape_mismatch_message():
    with pytest.raises(LmiServeError) as info:
        fit_shape(np.zeros((2, 3)), (-1, 4), "x", "m")
    assert info.value.message == "unexpected shape for input 'x' for model 'm'. Expected [-1,4], got [2,3]"


def test_bytes_binary_layout_is_length_prefixed():
    array = np.array([b"ab", b"", "é".encode()], dtype=object)
    raw = binary.encode_tensor(array)
    assert raw == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0) + struct.pack("<I", 2) + "é".encode()


def test_bool_binary_is_one_byte_each():
    assert binary.encode_tensor(np.array([True, False, True])) == b"\x01\x00\x01"


@pytest.mark.parametrize(
    ("raw", "datatype", "shape", "message"),
    [
        (b"\x00" * 7, "FP32", (2,), r"^input byte size mismatch for input 'x' for model 'm'\. Expected 8, got 7$"),
        (b"\x05\x00\x00\x00ab", "BYTES", (1,), "overruns the data"),
        (b"\x01\x00", "BYTES", (1,), "truncated length prefix"),
        (
            struct.pack("<I", 1) + b"a",
            "BYTES",
            (2,),
            r"^unexpected number of string elements 1 for inference input 'x' for model 'm', expecting 2$",
        ),
    ],
)
def test_bad_binary_data(raw, datatype, shape, message):
    with pytest.raises(InvalidRequest, match=message):
        binary.decode_tensor(raw, datatype, shape, "x", "m")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("abc", "Unable to parse Inference-Header-Content-Length, got: abc"),
        ("0", "should be in range (0, 10), got: 0"),
        ("11", "got: 11"),
    ],
)
def test_header_length_errors(header, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        binary.split_body(b"0123456789", header)


def test_split_body_and_reader():
    header, tail = binary.split_body(b'{"a":1}XYZW', "7")
    assert header == b'{"a":1}' and tail == b"XYZW"
    reader = binary.BinaryReader(tail)
    assert reader.take(3, "x") == b"XYZ"
    with pytest.raises(
        InvalidRequest, match="^unexpected additional input data for model 'm': 1 bytes are not claimed"
    ):
        reader.check_consumed("m")
    with pytest.raises(
        InvalidRequest, match="^unexpected size for input 'y', expecting 1 additional bytes for model 'm'$"
    ):
        reader.take(2, "y", "m")


def test_request_decompression():
    import gzip
    import zlib

    assert binary.decompress(gzip.compress(b"payload"), "gzip") == b"payload"
    assert binary.decompress(zlib.compress(b"payload"), "deflate") == b"payload"
    assert binary.decompress(b"plain", None) == b"plain"
    with pytest.raises(InvalidRequest, match="could not be decompressed"):
        binary.decompress(b"not gzip", "gzip")
    with pytest.raises(LmiServeError) as info:
        binary.decompress(b"x", "br")
    assert RENDERER.status(info.value) == 415
