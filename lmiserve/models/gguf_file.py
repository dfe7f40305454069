"""A GGUF file's header and tensor table, and its tensors' raw blocks as slices of a memory map.

What `gguf_codes` needs of a file, without `gguf.GGUFReader`, which builds a numpy view of every
value of every key (a tokenizer's 49 152 strings: seconds) before the first tensor: here array values
are skipped by seeking past them (a string array by its items' lengths), scalars and strings read,
and no tensor byte is read until a tensor's blocks are used (a read-only `numpy.memmap`).

The format (ggml's docs/gguf.md, versions 2 and 3, little-endian): the magic `GGUF`, uint32 version,
uint64 tensor count, uint64 key-value count; the key-value pairs (key: a string, uint64 length and
UTF-8 bytes; uint32 value type; value, an array being uint32 item type, uint64 count, items); the tensor
infos (name, uint32 dimension count, uint64 dimensions innermost first, uint32 ggml type, uint64 offset
from the data start); the data start: the end of the infos rounded up to `general.alignment` (32 when
absent).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFArray", "GGUFFile", "GGUFTensorInfo", "read_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, str] = {  # value type -> struct format (little-endian)
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


@dataclass(frozen=True)
class GGUFArray:
    """An array value, skipped: its item type (GGUF's value type number) and length."""

    item_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml's order: innermost (a row's length) first
    type_name: str  # gguf.GGMLQuantizationType name: F32, Q4_K, ...
    offset: int  # from the file's start
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's order (rows first), as `GGUFReader`'s `tensor.data` has it for float types."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    fields: dict[str, Any]  # key -> int, float, bool, str, or GGUFArray
    tensors: list[GGUFTensorInfo]

    def blocks(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """`tensor`'s raw bytes as uint8 [rows..., bytes per row] (what `GGUFReader` gives a quantized
        tensor's `data`), a read-only view of the file: nothing is read until it is used."""
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(tensor.n_bytes,))
        rows = tensor.shape[:-1]
        return data.reshape(*rows, -1) if rows else data


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.pos = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        value = bytes(self.buffer[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return value

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            self.skip_items(item_type, count)
            return GGUFArray(item_type, count)
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self.unpack(fmt)

    def skip_items(self, item_type: int, count: int) -> None:
        fmt = _SCALARS.get(item_type)
        if fmt is not None:
            self.pos += struct.calcsize(fmt) * count
        elif item_type == _STRING:
            read, buffer, pos = struct.unpack_from, self.buffer, self.pos
            for _ in range(count):
                pos += 8 + read("<Q", buffer, pos)[0]
            self.pos = pos
        else:  # arrays of arrays: each item is a value of its own
            for _ in range(count):
                self.value(item_type)
        if self.pos > len(self.buffer):
            raise ValueError("an array runs past the end of the file")


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """`path`'s header and tensor table; ValueError for a file that is not a little-endian GGUF of
    version 2 or 3, or is truncated."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer)
        try:
            if bytes(buffer[:4]) != _MAGIC:
                raise ValueError(f"{path.name} is not a GGUF file")
            cursor.pos = 4
            version = cursor.unpack("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (or a big-endian file) is not read here")
            n_tensors, n_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
            fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key = cursor.string()
                fields[key] = cursor.value(cursor.unpack("<I"))
            infos = []
            for _ in range(n_tensors):
                name = cursor.string()
                dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
                infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
        except struct.error as exc:
            raise ValueError(f"{path.name} is truncated ({exc})") from exc
        size = len(buffer)
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment {alignment!r} is not a positive integer")
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, type_number, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_number)
        except ValueError:
            raise ValueError(f"tensor {name} has an unknown ggml type {type_number}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(dims, dtype=np.int64))
        if elements % block:
            raise ValueError(f"tensor {name} of {elements} values is not whole {qtype.name} blocks")
        info = GGUFTensorInfo(name, dims, qtype.name, start + offset, elements // block * type_size)
        if info.offset + info.n_bytes > size:
            raise ValueError(f"tensor {name} runs past the end of {path.name}")
        tensors.append(info)
    return GGUFFile(path, fields, tensors)
