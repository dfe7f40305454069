"""`lmiserve serve` argument handling: bad values stop the server before it binds, naming key and value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmiserve import cli


def test_bad_option_value_fails_at_startup_naming_key_value_and_choices(capsys):
    assert cli.main(["serve", "-o", "dtype=fp64"]) == 2
    err = capsys.readouterr().err
    assert "dtype" in err and "fp64" in err and "bf16" in err


def test_override_without_equals_is_a_configuration_error(capsys):
    assert cli.main(["serve", "-o", "max_rolling_batch_size"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_missing_properties_file_is_reported(tmp_path, capsys):
    assert cli.main(["serve", "--properties", str(tmp_path / "nope.properties")]) == 2
    assert "nope.properties" in capsys.readouterr().err


def test_bad_value_in_environment_names_its_variable(monkeypatch, capsys):
    monkeypatch.setenv("OPTION_MAX_ROLLING_BATCH_SIZE", "many")
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "max_rolling_batch_size" in err and "many" in err and "OPTION_MAX_ROLLING_BATCH_SIZE" in err


def test_python_dash_m_entry_point_parses_the_same_options():
    result = subprocess.run(
        [sys.executable, "-m", "lmiserve", "serve", "-o", "rolling_batch=sometimes"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "rolling_batch" in result.stderr and "sometimes" in result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    assert "lmiserve" in capsys.readouterr().out
