"""Triton's binary tensor data extension: request splitting, raw tensor bytes, response layout.

A body with an `Inference-Header-Content-Length: N` header (whatever its Content-Type) is N bytes of
JSON followed by the binary segments of the inputs that carry `parameters.binary_data_size`, in the
order the inputs appear. Raw layout: little-endian, row-major, no padding; BOOL one byte; each BYTES
element a uint32 little-endian length followed by its bytes.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np

from lmiserve.core.errors import (
    InvalidInput,
    InvalidRequest,
    MalformedBody,
    UnsupportedMediaType,
)
from lmiserve.protocols.tensor.codecs.datatypes import numpy_dtype

HEADER = "Inference-Header-Content-Length"


def split_body(body: bytes, header_value: str | None) -> tuple[bytes, bytes]:
    """(JSON header, binary tail); without the header the whole body is JSON."""
    if header_value is None:
        return body, b""
    try:
        size = int(header_value.strip())
    except ValueError:
        raise InvalidRequest(f"Unable to parse {HEADER}, got: {header_value}") from None
    if size <= 0 or size > len(body):
        raise InvalidRequest(f"inference header size should be in range (0, {len(body)}), got: {size}")
    return body[:size], body[size:]


def decompress(body: bytes, encoding: str | None) -> bytes:
    """A `Content-Encoding: gzip | deflate` request body, inflated (tritonclient's request compression)."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedMediaType(f"unsupported Content-Encoding: {encoding} (expected gzip or deflate)")
    try:
        return zlib.decompress(body, wbits=47)  # 32 + 15: gzip or zlib header, detected
    except zlib.error as exc:
        raise MalformedBody(f"the {encoding} request body could not be decompressed: {exc}") from None


class BinaryReader:
    """Hands out consecutive binary segments of the request tail."""

    def __init__(self, tail: bytes):
        self.tail = memoryview(tail)
        self.offset = 0

    def take(self, size: object, name: str, model: str = "") -> bytes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"invalid 'binary_data_size' for input '{name}': {size!r}")
        if self.offset + size > len(self.tail):
            short = self.offset + size - len(self.tail)
            raise InvalidInput(
                f"unexpected size for input '{name}', expecting {short} additional bytes for model '{model}'"
            )
        chunk = bytes(self.tail[self.offset : self.offset + size])
        self.offset += size
        return chunk

    def check_consumed(self, model: str = "") -> None:
        left = len(self.tail) - self.offset
        if left:
            raise InvalidInput(
                f"unexpected additional input data for model '{model}': "
                f"{left} bytes are not claimed by any input's 'binary_data_size'"
            )


def decode_tensor(raw: bytes, datatype: str, shape: Sequence[int], name: str, model: str = "") -> np.ndarray:
    """Raw bytes of one tensor -> array of `shape` (Triton's words when the size does not fit the shape)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        values = _split_bytes(raw, name)
        if len(values) != count:
            raise InvalidInput(
                f"unexpected number of string elements {len(values)} for inference input '{name}' "
                f"for model '{model}', expecting {count}"
            )
        array = np.empty(count, dtype=object)
        array[:] = values
        return array.reshape(shape)
    dtype = numpy_dtype(datatype, name).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(
            f"input byte size mismatch for input '{name}' for model '{model}'. "
            f"Expected {count * dtype.itemsize}, got {len(raw)}"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if datatype == "BOOL":
        array = array.view(np.uint8) != 0
    return array.astype(dtype.newbyteorder("="))


def _split_bytes(raw: bytes, name: str) -> list[bytes]:
    values, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput(f"malformed BYTES data for input '{name}': truncated length prefix")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput(f"malformed BYTES data for input '{name}': element of {length} bytes overruns the data")
        values.append(bytes(raw[offset : offset + length]))
        offset += length
    return values


def encode_tensor(array: np.ndarray) -> bytes:
    """Raw little-endian bytes of an array (BYTES: length-prefixed elements)."""
    flat = np.asarray(array).reshape(-1)
    if flat.dtype.kind in "OSU":
        parts = []
        for value in flat.tolist():
            data = value if isinstance(value, bytes) else str(value).encode("utf-8")
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    if flat.dtype == np.bool_:
        return flat.astype(np.uint8).tobytes()
    return flat.astype(flat.dtype.newbyteorder("<")).tobytes()


def compose(header: bytes, segments: Sequence[bytes]) -> tuple[bytes, dict[str, str]]:
    """Body and headers of a binary response."""
    return header + b"".join(segments), {HEADER: str(len(header))}
