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
        (["--scenario", "dialogue"], "invalid choice"),
        (["--chat-turns", "0"], ">= 1"),
        (["--chat-conversations", "0"], ">= 1"),
        (["--client-processes", "0"], ">= 1"),
    ],
)
def test_bad_arguments_exit_2(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_vision_scenario_refuses_client_processes(tmp_path, capsys):
    argv = ["bench", "--scenario", "vision", "--client-processes", "2", "--output-dir", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    assert "--client-processes: the vision scenario runs its clients in one process" in capsys.readouterr().err


def test_bad_server_option_is_a_configuration_error(tmp_path, capsys):
    assert cli.main(["bench", "-o", "dtype=fp64", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dtype" in err and "fp64" in err
    assert not (tmp_path / "out").exists()


def test_bad_device_is_a_configuration_error(tmp_path, capsys):
    assert cli.main(["bench", "--device", "tpu", "--output-dir", str(tmp_path / "out")]) == 2
    assert "device" in capsys.readouterr().err


def test_ab_option_is_checked_before_anything_starts(tmp_path, capsys):
    assert cli.main(["bench", "--ab-option", "dtype=fp64", "--output-dir", str(tmp_path / "out")]) == 2
    assert "fp64" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert cli.main(["bench", "--url", "http://127.0.0.1:9", "--ab-option", "dtype=fp32"]) == 2
    assert "--ab-option and --lora need a server started by the bench" in capsys.readouterr().err


def test_lora_options_are_checked_before_anything_starts(capsys):
    assert cli.main(["bench", "--url", "http://127.0.0.1:9", "--lora", "4"]) == 2
    assert "need a server started by the bench" in capsys.readouterr().err
    assert cli.main(["bench", "--lora", "4", "--ab-option", "dtype=fp32"]) == 2
    assert "--lora compares with the base model" in capsys.readouterr().err
    assert cli.main(["bench", "--lora", "4", "--scenario", "chat"]) == 2
    assert "--lora runs the completion scenario" in capsys.readouterr().err


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
    for option in (
        "--model-id",
        "--url",
        "--compare-url",
        "--compare-name",
        "--concurrency",
        "--max-new-tokens",
        "--requests-per-client",
        "--duration",
        "--warmup",
        "--output-dir",
        "--device",
        "--dtype",
        "--skip-baselines",
        "--soak-requests",
        "KEY=VALUE",
        "--scenario",
        "--chat-turns",
        "--chat-conversations",
        "--ab-option",
        "--api-key",
        "--client-processes",
    ):
        assert option in out, option


def test_without_the_bench_extra_one_line_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from lmiserve.bench import cli as bench_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        bench_cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("psutil", "matplotlib") else real(name, *a),
    )
    assert cli.main(["bench", "--skip-baselines"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "lmiserve bench: psutil, matplotlib not installed; install the bench extra: pip install 'lmiserve[bench]'\n"
    )


def test_serving_and_help_never_import_the_bench_dependencies():
    """`lmiserve --help`, `lmiserve serve`'s argument parsing and the app's modules leave the `bench`
    extra (matplotlib, psutil, httpx) and the bench runner unimported."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, lmiserve.cli, lmiserve.server.app\n"
        "lmiserve.cli.build_parser().parse_args(['serve', '--model-id', 'x'])\n"
        "print(sorted(m for m in ('matplotlib', 'psutil', 'httpx', 'lmiserve.bench.runner') if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_servers_the_bench_starts_leave_the_grpc_port_alone(tmp_path, monkeypatch):
    """Two servers of one run (`--ab-option`) would both take gRPC's default port 8081: the bench turns
    gRPC off unless the user named a port (an argument or OPTION_GRPC_PORT)."""
    from lmiserve.bench.server import ManagedServer

    monkeypatch.delenv("OPTION_GRPC_PORT", raising=False)
    command = ManagedServer(["--dtype", "fp32"], tmp_path / "log").command
    assert command[command.index("--grpc-port") + 1] == "0"
    assert "0" not in ManagedServer(["-o", "grpc_port=9001"], tmp_path / "log").command
    assert ManagedServer(["--grpc-port", "9001"], tmp_path / "log").command.count("--grpc-port") == 1
    monkeypatch.setenv("OPTION_GRPC_PORT", "9002")
    assert "--grpc-port" not in ManagedServer([], tmp_path / "log").command


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--api-key", "K", "--url", "u"], ["--api-key", "<hidden>", "--url", "u"]),
        (["--api-key=K"], ["--api-key=<hidden>"]),
        (["--api", "K"], ["--api", "<hidden>"]),  # argparse takes the abbreviation
        (["-o", "api_key=K", "-o", "max_new_tokens=4"], ["-o", "api_key=<hidden>", "-o", "max_new_tokens=4"]),
        (["--option", "option.api_key=K"], ["--option", "option.api_key=<hidden>"]),
        (["--option=api_key=K"], ["--option=api_key=<hidden>"]),
        (["-oapi_key=K"], ["-oapi_key=<hidden>"]),
        (["--ab-option", "api_key=K"], ["--ab-option", "api_key=<hidden>"]),
        (["--ab-option", "max_rolling_batch_size=2"], ["--ab-option", "max_rolling_batch_size=2"]),
        (["--model-id", "api_key=K"], ["--model-id", "api_key=K"]),  # not an option's value: shown
    ],
)
def test_the_api_key_is_hidden_in_every_spelling(args, shown):
    from lmiserve.bench.config import hidden_options, redacted

    assert redacted(["lmiserve", "bench", *args]) == ["lmiserve", "bench", *shown]
    assert hidden_options([("api_key", "K"), ("dtype", "bf16")]) == {"api_key": "<hidden>", "dtype": "bf16"}
