"""`lmiserve bench` argument handling: bad values stop before any server or model is started."""

from __future__ import annotations

import pytest

from lmiserve import cli


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--concurrency", "0"], "positive"),
        (["--concurrency", "1,x"], "comma-separated"),
        (["--max-new-tokens", "0"], ">= 1"),
        (["--requests-per-client", "2", "--duration", "5"], "not allowed with"),
        (["--warmup", "-1"], ">= 0"),
    ],
)
def test_bad_arguments_exit_2(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_bad_server_option_is_a_configuration_error(tmp_path, capsys):
    assert cli.main(["bench", "-o", "dtype=fp64", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dtype" in err and "fp64" in err
    assert not (tmp_path / "out").exists()


def test_bad_device_is_a_configuration_error(tmp_path, capsys):
    assert cli.main(["bench", "--device", "tpu", "--output-dir", str(tmp_path / "out")]) == 2
    assert "device" in capsys.readouterr().err


def test_compare_names_need_urls(capsys):
    assert cli.main(["bench", "--compare-name", "x"]) == 2
    assert "--compare-name" in capsys.readouterr().err


def test_non_positive_duration_is_rejected(capsys):
    assert cli.main(["bench", "--duration", "0"]) == 2
    assert "--duration" in capsys.readouterr().err


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model-id", "--url", "--compare-url", "--compare-name", "--concurrency", "--max-new-tokens",
                   "--requests-per-client", "--duration", "--warmup", "--output-dir", "--device", "--dtype",
                   "--skip-baselines", "--soak-requests", "KEY=VALUE"):
        assert option in out, option
