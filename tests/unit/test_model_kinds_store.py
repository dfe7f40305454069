"""Model-store scanning and per-model settings (global < the model's serving.properties < overrides)."""

from __future__ import annotations

import pytest

from lmiserve.cli import main, store_services
from lmiserve.config import ConfigError, Settings, load_settings
from lmiserve.models.store import model_settings, scan_store


def test_scan_store_finds_model_directories(tmp_path, tiny_model_dir):
    (tmp_path / "b-props").mkdir()
    (tmp_path / "b-props" / "serving.properties").write_text("option.max_new_tokens=7\n")
    (tmp_path / "a-weights").mkdir()
    (tmp_path / "a-weights" / "model.pt").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "serving.properties").write_text("")
    (tmp_path / "file.txt").write_text("")
    assert [name for name, _ in scan_store(tmp_path)] == ["a-weights", "b-props"]
    with pytest.raises(ConfigError, match="does not exist"):
        scan_store(tmp_path / "nope")


def test_model_settings_merge_over_the_global_ones(tmp_path, tiny_model_dir):
    base = load_settings({"max_new_tokens": "9", "batch_size": "4", "model_name": "global"}, environ={})
    own = tmp_path / "own"
    own.mkdir()
    (own / "serving.properties").write_text("option.max_new_tokens=5\noption.model_id=weights\n")
    (own / "weights").mkdir()
    settings = model_settings(base, own, "own", {"job_queue_size": 3})
    assert (settings.max_new_tokens, settings.batch_size, settings.job_queue_size) == (5, 4, 3)
    assert settings.model_name == "own"
    assert settings.model_id == str((own / "weights").resolve())  # relative to the model directory
    assert "properties file" in settings.sources["max_new_tokens"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "serving.properties").write_text("")
    assert model_settings(Settings(), bare, "bare").model_id is None  # the bundled default


def test_store_services_and_conflicting_model_id(tmp_path, torchscript_dir, capsys):
    import shutil

    shutil.copytree(torchscript_dir, tmp_path / "affine")
    services = store_services(Settings(), str(tmp_path))
    assert [(s.name, s.kind) for s in services] == [("affine", "torchscript")]
    with pytest.raises(ConfigError, match="cannot be combined with model_id"):
        store_services(Settings(model_id=str(torchscript_dir)), str(tmp_path))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "serving.properties").write_text("option.batch_size=zero\n")
    assert main(["serve", "--model-store", str(tmp_path)]) == 2
    assert "model bad" in capsys.readouterr().err
