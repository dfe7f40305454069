"""lmiserve.models.gguf_file: the header and tensor table of a GGUF file, against gguf's own GGUFReader
(the same tensor names, types, shapes and bytes; the same scalar values; arrays skipped but counted)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from helpers.gguf_files import write_gguf
from lmiserve.models.gguf_file import GGUFArray, read_gguf


def assert_same_as_reader(path: Path) -> None:
    file, reader = read_gguf(path), GGUFReader(path)
    assert [t.name for t in file.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(file.tensors, reader.tensors, strict=True):
        assert ours.type_name == theirs.tensor_type.name
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert ours.offset == theirs.data_offset and ours.n_bytes == theirs.n_bytes
        blocks = file.blocks(ours)
        assert blocks.dtype == np.uint8 and not blocks.flags.writeable
        if not ours.type_name.startswith("F"):  # quantized: the reader's uint8 [rows, bytes per row]
            assert blocks.shape == theirs.data.shape
        assert np.array_equal(blocks.reshape(-1), np.ascontiguousarray(theirs.data).view(np.uint8).reshape(-1))
    assert set(file.fields) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, value in file.fields.items():
        field = reader.fields[key]
        if isinstance(value, GGUFArray):
            assert field.types[0] == GGUFValueType.ARRAY
            assert value.item_type == field.types[1]
            if value.item_type != GGUFValueType.ARRAY:  # the reader's data of nested arrays are their leaves
                assert value.count == len(field.data)
        else:
            assert value == field.contents(), key


@pytest.mark.parametrize(("arch", "output", "extra"), [("llama", None, True), ("qwen2", "Q6_K", False)])
def test_the_table_is_the_readers(tmp_path: Path, arch: str, output: str | None, extra: bool) -> None:
    path = write_gguf(tmp_path / "m.gguf", arch, output=output, extra=extra)
    assert_same_as_reader(path)
    file = read_gguf(path)
    if extra:
        assert file.fields["general.alignment"] == 64
        assert file.fields["test.strings"] == GGUFArray(int(GGUFValueType.STRING), 301)
        assert (file.fields["test.string"], file.fields["test.bool"], file.fields["test.i64"]) == ("naïve", True, -7)
        assert file.fields["test.nested"] == GGUFArray(int(GGUFValueType.ARRAY), 2)
    assert all(t.offset % file.fields.get("general.alignment", 32) == 0 for t in file.tensors)


def test_not_gguf_or_truncated(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", extra=True)
    data = path.read_bytes()
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path / "bad.gguf")
    (tmp_path / "v1.gguf").write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="version 1"):
        read_gguf(tmp_path / "v1.gguf")
    for cut in (20, 2000, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError):
            read_gguf(tmp_path / "cut.gguf")


@pytest.mark.e2e  # the real bundled GGUF (49 152 tokenizer strings): well under a second, the reader's seconds
def test_bundled_file_is_read_fast(smollm_dir: Path) -> None:
    from lmiserve.models.bundled import bundled_gguf_path

    start = time.monotonic()
    file = read_gguf(bundled_gguf_path())
    took = time.monotonic() - start
    assert len(file.tensors) == 272 and file.fields["tokenizer.ggml.tokens"].count == 49152
    assert took < 1, took
    assert_same_as_reader(bundled_gguf_path())
