"""The one-time GGUF conversion says what it does at INFO level (`make serve`'s first start is otherwise
silent for tens of seconds): what it converts, where to, and when it is done; a cached start says nothing."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmiserve.models import bundled


def fake_convert(gguf_path: Path, out_dir: Path) -> None:  # replaces bundled._convert_into
    bundled.logger.info("conversion 1/3: (fake)")
    (out_dir / "config.json").write_text("{}")
    (out_dir / "model.safetensors").write_bytes(b"weights")


def test_first_conversion_logs_start_and_end_then_cached_starts_are_quiet(tmp_path, monkeypatch, caplog):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * (3 * 2**20))
    monkeypatch.setattr(bundled, "_convert_into", fake_convert)
    with caplog.at_level(logging.INFO, logger="lmiserve.models.bundled"):
        final = bundled.convert_gguf(gguf, tmp_path / "cache")
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert messages[0] == (
        f"converting the GGUF file {gguf} (3 MiB) to a transformers model once, into {final}; "
        "later starts load it from there (this takes a while)"
    )
    assert messages[1] == "conversion 1/3: (fake)"
    assert messages[2].startswith("converted model.gguf in ") and messages[2].endswith(f" s; cached at {final}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmiserve.models.bundled"):
        assert bundled.convert_gguf(gguf, tmp_path / "cache") == final
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


class FakePretrained:
    """Stands for transformers' model and tokenizer classes: loads nothing, saves a file."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.config = SimpleNamespace(quantization_config={"gguf": True})

    @classmethod
    def from_pretrained(cls, path: Path, gguf_file: str) -> FakePretrained:
        return cls(gguf_file)

    def save_pretrained(self, out_dir: Path) -> None:
        (Path(out_dir) / f"{type(self).__name__}.json").write_text(self.name)


class FakeModel(FakePretrained):
    pass


class FakeTokenizer(FakePretrained):
    pass


def test_the_conversion_logs_its_three_steps(tmp_path, monkeypatch, caplog):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", FakeModel)
    monkeypatch.setattr(transformers, "AutoTokenizer", FakeTokenizer)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with caplog.at_level(logging.INFO, logger="lmiserve.models.bundled"):
        bundled._convert_into(gguf, tmp_path)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "conversion 1/3: reading and de-quantizing the weights of m.gguf"
    assert messages[1].startswith("conversion 2/3: reading the tokenizer (")
    assert messages[2].startswith("conversion 3/3: writing the model and tokenizer (")
    assert (tmp_path / "FakeModel.json").read_text() == (tmp_path / "FakeTokenizer.json").read_text() == "m.gguf"
