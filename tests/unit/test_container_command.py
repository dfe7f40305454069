"""The container entrypoint's choice of command (lmiserve/container.py), without a process.
(tests/integration/test_container.py runs it for real.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmiserve.container import DEFAULT_MODEL_ROOT, command, has_model, model_root

LMISERVE = [sys.executable, "-m", "lmiserve", "serve"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A directory laid out like /opt/ml/model: a serving.properties (the weights may sit beside it)."""
    model = tmp_path / "opt" / "ml" / "model"
    model.mkdir(parents=True)
    (model / "serving.properties").write_text("option.model_name=m\n")
    return model


@pytest.mark.parametrize("argv", [["serve"], []], ids=["serve", "no command"])
def test_serve_serves_the_model_root_when_it_holds_a_model(root, argv):
    line, notes = command(argv, {"SM_MODEL_DIR": str(root)})
    assert line == [*LMISERVE, "--model-dir", str(root)]
    assert notes == [f"serving the model directory {root}"]


def test_arguments_after_serve_or_options_alone_go_to_lmiserve_serve(root):
    env = {"SM_MODEL_DIR": str(root)}
    assert command(["serve", "-o", "max_new_tokens=4", "--port", "9000"], env)[0] == [
        *LMISERVE,
        "--model-dir",
        str(root),
        "-o",
        "max_new_tokens=4",
        "--port",
        "9000",
    ]
    assert command(["--log-level", "debug"], env)[0] == [*LMISERVE, "--model-dir", str(root), "--log-level", "debug"]


@pytest.mark.parametrize("flag", ["--model-id", "--model", "--model-dir", "--model-store"])
def test_a_model_given_on_the_command_line_wins_over_the_root(root, flag):
    line, _ = command(["serve", flag, "/models/x"], {"SM_MODEL_DIR": str(root)})
    assert line == [*LMISERVE, flag, "/models/x"]


def test_other_commands_run_as_given(root):
    assert command(["bash", "-c", "echo hi"], {"SM_MODEL_DIR": str(root)}) == (["bash", "-c", "echo hi"], [])
    assert command(["lmiserve", "bench", "--help"], {})[0] == ["lmiserve", "bench", "--help"]


def test_an_empty_or_missing_root_serves_the_bundled_model(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / ".keep").write_text("")
    (empty / "lost+found").mkdir()
    for root in (empty, tmp_path / "missing"):
        line, notes = command(["serve"], {"SM_MODEL_DIR": str(root)})
        assert line == LMISERVE
        assert notes == [f"{root} holds no model: serving the bundled default model"]


@pytest.mark.parametrize("variable", ["HF_MODEL_ID", "MODEL_ID"])  # SageMaker's, TGI's
def test_an_empty_root_with_a_model_id_variable_serves_that_model(tmp_path, variable):
    line, notes = command(["serve"], {"SM_MODEL_DIR": str(tmp_path / "missing"), variable: "/models/llama"})
    assert line == LMISERVE  # lmiserve's settings read the variable themselves
    source = "the model of HF_MODEL_ID/OPTION_MODEL_ID/MODEL_ID"
    assert notes == [f"{tmp_path / 'missing'} holds no model: serving {source}"]


def test_the_model_root_by_precedence(tmp_path):
    local = tmp_path / "vertex"
    local.mkdir()
    assert model_root({}) == (Path(DEFAULT_MODEL_ROOT), [])
    assert model_root({"SM_MODEL_DIR": "/sm"}) == (Path("/sm"), [])
    assert model_root({"SM_MODEL_DIR": "/sm", "AIP_STORAGE_URI": str(local)}) == (local, [])
    assert model_root({"SM_MODEL_DIR": "/sm", "AIP_STORAGE_URI": f"file://{local}"}) == (local, [])
    override = {"LMISERVE_MODEL_DIR": "/override", "SM_MODEL_DIR": "/sm", "AIP_STORAGE_URI": str(local)}
    assert model_root(override) == (Path("/override"), [])


def test_a_remote_aip_storage_uri_is_served_when_the_root_holds_no_model(tmp_path):
    environ = {"AIP_STORAGE_URI": "gs://bucket/model", "SM_MODEL_DIR": str(tmp_path / "missing")}
    assert model_root(environ) == (tmp_path / "missing", [])
    line, notes = command(["serve"], environ)
    assert line == LMISERVE  # lmiserve's settings read AIP_STORAGE_URI themselves
    assert notes == [
        f"{tmp_path / 'missing'} holds no model: serving the model at AIP_STORAGE_URI=gs://bucket/model "
        "(downloaded at start)"
    ]


def test_has_model(root, tmp_path):
    assert has_model(root)
    assert not has_model(tmp_path / "missing")
    assert not has_model(root / "serving.properties")  # a file, not a directory
