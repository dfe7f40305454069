"""`lmiserve serve` argument handling: bad values stop the server before it binds, naming key and value."""

from __future__ import annotations

import logging
import re
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


# ---- --version, serve --help, lmiserve options ------------------------------------------------------------


def test_version_prints_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"lmiserve {version('lmiserve')}\n"


SERVE_FLAGS = [
    "--model-id",
    "--dtype",
    "--device",
    "--max-model-len",
    "--max-rolling-batch-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--max-new-tokens",
    "--output-formatter",
    "--model-store",
    "--api-key",
    "--host",
    "--port",
    "--metrics-port",
    "--log-level",
    "--log-format",
    "--trust-remote-code",
    "--quantize",
    "--quantization",
    "--model",
    "--served-model-name",
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "--block-size",
    "--load-format",
    "--revision",
    "--max-logprobs",
    "--speculative-config",
    "--stream-interval",
    "--engine-process",
    "--num-shard",
    "--max-total-tokens",
    "--max-input-tokens",
]


def serve_help(capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # one line per flag's help: easy to read back
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_serve_help_lists_the_common_settings_as_flags_with_their_defaults(capsys, monkeypatch):
    out = serve_help(capsys, monkeypatch)
    for flag in SERVE_FLAGS:
        assert re.search(rf"(^|[\s\[,|]){re.escape(flag)}\b", out), flag
    assert "--pipeline-parallel-degree" not in out  # no such setting, no flag
    lines = out.splitlines()

    def help_of(flag: str) -> str:
        """The flag's help: its line and the indented lines below, up to the next flag."""
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(flag))
        end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 8))
        return " ".join(line.strip() for line in lines[start:end])

    assert "[default: 8080; -o port; env OPTION_PORT, SAGEMAKER_BIND_TO_PORT" in help_of("--port")
    assert "[default: 32; -o max_rolling_batch_size" in help_of("--max-rolling-batch-size")
    assert "[default: auto; -o dtype" in help_of("--dtype {auto,fp32,fp16,bf16,int8,int4}")
    assert "vLLM's name for max_total_tokens" in help_of("--max-model-len")
    assert "[default: 0.0.0.0" in help_of("--host")
    assert "[default: unset; -o api_key; env OPTION_API_KEY, API_KEY]" in help_of("--api-key")
    assert "lmiserve options " in out  # the epilog points to every other key


def test_options_lists_every_key_with_its_default(capsys):
    from lmiserve.config import Settings

    assert cli.main(["options"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["KEY", "DEFAULT", "MEANING"]
    rows = {
        line.split()[0]: line.split()[1]
        for line in lines
        if line[:1].strip() and line.split()[0] in Settings.option_keys()  # a key's row, not a wrapped line
    }
    assert set(rows) == set(Settings.option_keys())
    assert (rows["max_rolling_batch_size"], rows["port"], rows["dtype"], rows["model_id"]) == (
        "32",
        "8080",
        "auto",
        "unset",
    )


def test_options_search_and_markdown(capsys):
    from lmiserve.config.reference import render_markdown

    assert cli.main(["options", "--search", "prefix_cach"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:] if line and not line[0].isspace()]
    assert keys == ["Batching", "enable_prefix_caching", "prefix_cache_size"]  # "Batching and engine:"
    assert cli.main(["options", "--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown()
    assert cli.main(["options", "--markdown", "--search", "HF_REVISION"]) == 0
    out = capsys.readouterr().out
    assert "| `revision`" in out and "| `model_id`" not in out
    assert cli.main(["options", "--search", "no-such-setting"]) == 1
    assert "no setting mentions 'no-such-setting'" in capsys.readouterr().err


# ---- unknown keys and flags as a source ------------------------------------------------------------------


def test_unknown_option_is_an_error_with_the_closest_key(capsys):
    assert cli.main(["serve", "-o", "max_rolling_batch_sise=64"]) == 2
    assert capsys.readouterr().err == (
        "lmiserve: configuration error: unknown option 'max_rolling_batch_sise' "
        "(did you mean 'max_rolling_batch_size'?)\n"
    )


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("max-new-tokens=5", "unknown option 'max-new-tokens' (did you mean 'max_new_tokens'?)"),
        ("option.dtpye=bf16", "unknown option 'dtpye' (did you mean 'dtype'?)"),
        (
            "pipeline_parallel_degree=2",
            "unknown option 'pipeline_parallel_degree' (an LMI option lmiserve does not use",
        ),
        ("zzz=1", "unknown option 'zzz' (`lmiserve options` lists every option)"),
    ],
)
def test_unknown_option_messages(option, expected, capsys):
    assert cli.main(["serve", "-o", option]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmiserve: configuration error: {expected}") and err.count("\n") == 1


def test_aliases_are_known_options(monkeypatch):
    seen = capture_serve(monkeypatch)
    assert cli.main(["serve", "-o", "max_num_seqs=4", "-o", "option.max_model_len=100"]) == 0
    settings = seen["settings"]
    assert (settings.max_rolling_batch_size, settings.max_total_tokens) == (4, 100)


def test_a_vllm_serve_command_line_is_understood(monkeypatch, capsys):
    """`vllm serve MODEL --flags` with `lmiserve serve` in front: the positional model (or --model), and
    vLLM's flags of settings lmiserve shares, each as `-o` would set it."""
    seen = capture_serve(monkeypatch)
    argv = [
        "serve",
        "/models/llama",
        "--served-model-name",
        "llama",
        "my-llama",
        "--gpu-memory-utilization",
        "0.85",
        "--kv-cache-memory-bytes",
        "4GiB",
        "--block-size",
        "32",
        "--load-format",
        "dummy",
        "--revision",
        "v2",
        "--max-logprobs",
        "5",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
    ]
    assert cli.main(argv) == 0
    settings = seen["settings"]
    assert settings.model_id == "/models/llama" and settings.sources["model_id"] == "command line MODEL"
    assert settings.served_model_name == "llama,my-llama"
    assert settings.sources["served_model_name"] == "command line --served-model-name"
    assert (settings.gpu_memory_utilization, settings.kv_cache_memory_bytes, settings.block_size) == (0.85, 4 << 30, 32)
    assert (settings.load_format, settings.revision, settings.max_logprobs) == ("dummy", "v2", 5)
    assert settings.speculative_config is not None
    assert cli.main(["serve", "--model", "/models/qwen"]) == 0
    assert (
        seen["settings"].model_id == "/models/qwen" and seen["settings"].sources["model_id"] == "command line --model"
    )
    assert cli.main(["serve", "/models/llama", "--model-id", "/models/llama"]) == 0  # the same model twice: fine
    assert cli.main(["serve", "/models/llama", "--model-id", "/models/qwen"]) == 2
    assert capsys.readouterr().err.endswith(
        "lmiserve: configuration error: two models: MODEL /models/llama and --model-id /models/qwen\n"
    )
    assert cli.main(["serve", "--gpu-memory-utilization", "1.5"]) == 2  # validated as -o would be
    assert "gpu_memory_utilization" in capsys.readouterr().err


def test_a_tgi_launcher_command_line_is_understood(monkeypatch):
    """`text-generation-launcher`'s flags with `lmiserve serve` in front."""
    seen = capture_serve(monkeypatch)
    argv = ["--model-id", "/models/llama", "--num-shard", "2", "--max-input-tokens", "4000"]
    assert cli.main(["serve", *argv, "--max-total-tokens", "4096", "--quantize", "awq"]) == 0
    settings = seen["settings"]
    assert (settings.model_id, settings.tensor_parallel_degree, settings.quantize) == ("/models/llama", "2", "awq")
    assert (settings.max_input_tokens, settings.max_total_tokens) == (4000, 4096)
    assert settings.sources["tensor_parallel_degree"] == "command line --num-shard"


def test_quantize_by_tgis_and_vllms_spellings(monkeypatch, capsys):
    """TGI's --quantize, vLLM's --quantization (and -o / OPTION_ quantization, its awq_marlin and gptq_marlin
    the same checkpoints' formats, fbgemm_fp8 an fp8 checkpoint's, modelopt NVIDIA's) all set quantize; a format lmiserve does not read stops with one line."""
    from lmiserve.config import load_settings

    seen = capture_serve(monkeypatch)
    for argv, expected in (
        (["--quantize", "fp8"], ("fp8", "command line --quantize")),
        (["--quantization", "awq_marlin"], ("awq", "command line --quantization")),
        (["-o", "quantization=GPTQ_Marlin"], ("gptq", "command line -o")),
        (["--quantization", "fbgemm_fp8"], ("fp8", "command line --quantization")),
        (["--quantization", "modelopt"], ("modelopt", "command line --quantization")),
    ):
        assert cli.main(["serve", *argv]) == 0
        assert (seen["settings"].quantize, seen["settings"].sources["quantize"]) == expected
    env = load_settings({}, None, None, environ={"OPTION_QUANTIZATION": "awq"})
    assert (env.quantize, env.sources["quantize"]) == ("awq", "environment OPTION_QUANTIZATION")
    assert cli.main(["serve", "--quantization", "bitsandbytes"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "invalid value 'bitsandbytes' for option 'quantize': expected one of fp8, awq" in err
    )


def test_max_num_batched_tokens_is_the_steps_token_budget_by_every_spelling(monkeypatch, tmp_path, capsys):
    """vLLM's max_num_batched_tokens is a setting of its own (no longer an unknown option): the flag, -o,
    OPTION_ and serving.properties all set it, and it reaches the engine as the step's budget beside
    LMI's prompt-side max_rolling_batch_prefill_tokens."""
    from lmiserve.config import load_settings
    from lmiserve.models.compose import engine_config

    seen = capture_serve(monkeypatch)
    assert cli.main(["serve", "--max-num-batched-tokens", "512", "--max-num-seqs", "16"]) == 0
    settings = seen["settings"]
    assert settings.max_num_batched_tokens == 512
    assert settings.sources["max_num_batched_tokens"] == "command line --max-num-batched-tokens"
    config = engine_config(settings)
    assert (config.max_step_tokens, config.max_prefill_tokens, config.max_running) == (512, 2048, 16)
    assert cli.main(["serve", "-o", "max_num_batched_tokens=64"]) == 0
    assert seen["settings"].max_num_batched_tokens == 64
    env = load_settings({}, None, None, environ={"OPTION_MAX_NUM_BATCHED_TOKENS": "256"})
    assert (env.max_num_batched_tokens, env.sources["max_num_batched_tokens"]) == (
        256,
        "environment OPTION_MAX_NUM_BATCHED_TOKENS",
    )
    properties = tmp_path / "serving.properties"
    properties.write_text("option.max_num_batched_tokens=128\noption.max_rolling_batch_prefill_tokens=64\n")
    from_file = load_settings({}, properties, None, environ={})
    assert (from_file.max_num_batched_tokens, from_file.max_rolling_batch_prefill_tokens) == (128, 64)
    assert load_settings({}, None, None, environ={}).max_num_batched_tokens is None  # unset: no step budget
    assert engine_config(load_settings({}, None, None, environ={})).max_step_tokens is None


def test_a_step_budget_below_max_num_seqs_refuses_to_start_with_one_line(capsys):
    assert cli.main(["serve", "--max-num-batched-tokens", "8", "--max-num-seqs", "16"]) == 2
    assert capsys.readouterr().err == (
        "lmiserve: configuration error: invalid configuration: max_num_batched_tokens=8 is smaller than "
        "max_rolling_batch_size=16 (vLLM's max_num_seqs): a step must hold a token of every running sequence\n"
    )
    assert cli.main(["serve", "-o", "max_num_batched_tokens=2", "-o", "batch_size=4"]) == 2  # dynamic batching
    assert "max_num_batched_tokens=2 is smaller than batch_size=4" in capsys.readouterr().err


def capture_serve(monkeypatch) -> dict:
    """Replace `cli.serve` (which would start the server) by one that keeps what it was given."""
    seen: dict = {}

    def fake_serve(settings, services=None, held=None):
        seen.update(settings=settings, services=services, held=held)
        return 0

    monkeypatch.setattr(cli, "serve", fake_serve)
    return seen


def test_flags_are_validated_like_options(capsys):
    assert cli.main(["serve", "--port", "http"]) == 2
    by_flag = capsys.readouterr().err
    assert cli.main(["serve", "-o", "port=http"]) == 2
    by_option = capsys.readouterr().err
    expected = "invalid value 'http' for option 'port': expected an integer from 1 to 65535"
    assert by_flag == f"lmiserve: configuration error: {expected} (from command line --port)\n"
    assert by_option == f"lmiserve: configuration error: {expected} (from command line -o)\n"
    assert cli.main(["serve", "--max-num-seqs", "0"]) == 2
    assert "for option 'max_rolling_batch_size'" in capsys.readouterr().err
    assert cli.main(["serve", "--log-level", "loud"]) == 2  # not argparse's own usage error
    assert capsys.readouterr().err == (
        "lmiserve: configuration error: invalid value 'loud' for option 'log_level': "
        "expected one of debug, info, warning, error (from command line --log-level)\n"
    )


def test_flags_set_settings_and_their_sources(monkeypatch):
    seen = capture_serve(monkeypatch)
    argv = [
        "serve",
        "-o", "dtype=fp16",
        "-o", "port=9001",
        "--port", "9000",
        "--max-num-seqs", "8",
        "--max-model-len", "512",
        "--no-enable-prefix-caching",
        "--trust-remote-code",
        "--log-format", "json",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    s = seen["settings"]
    assert (s.port, s.max_rolling_batch_size, s.max_total_tokens, s.dtype) == (9000, 8, 512, "fp16")
    assert (s.enable_prefix_caching, s.trust_remote_code, s.log_format) == (False, True, "json")
    assert s.sources == {
        "dtype": "command line -o",
        "port": "command line --port",  # the flag beats -o
        "max_rolling_batch_size": "command line --max-num-seqs",
        "max_total_tokens": "command line --max-model-len",
        "enable_prefix_caching": "command line --no-enable-prefix-caching",
        "trust_remote_code": "command line --trust-remote-code",
        "log_format": "command line --log-format",
    }


def test_unknown_environment_keys_give_one_warning_line(monkeypatch, tmp_path):
    (tmp_path / "serving.properties").write_text(
        "engine=Python\noption.entryPoint=model.py\noption.max_rolling_batch_sise=8\n"
    )
    monkeypatch.setenv("OPTION_PIPELINE_PARALLEL_DEGREE", "2")
    seen = capture_serve(monkeypatch)
    assert cli.main(["serve", "--model-dir", str(tmp_path)]) == 0
    assert seen["settings"].extra == {
        "engine": "Python",
        "entryPoint": "model.py",
        "max_rolling_batch_sise": "8",
        "pipeline_parallel_degree": "2",
    }
    warnings = [r.getMessage() for r in seen["held"] if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    (line,) = warnings
    assert "\n" not in line and line.startswith("ignoring 4 unknown options: ")
    props = f"from properties file {tmp_path / 'serving.properties'}"
    assert f"'max_rolling_batch_sise' (did you mean 'max_rolling_batch_size'?; {props})" in line
    assert f"'engine' (an LMI option lmiserve does not use; {props})" in line
    assert "'pipeline_parallel_degree' (an LMI option lmiserve does not use; from environment " in line


def test_held_warnings_are_printed_when_the_configuration_fails(monkeypatch, capsys):
    monkeypatch.setenv("OPTION_MAX_NEW_TOKEN", "5")
    assert cli.main(["serve", "--dtype", "fp64"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "lmiserve: warning: ignoring unknown option 'max_new_token' "
        "(did you mean 'max_new_tokens'?; from environment OPTION_MAX_NEW_TOKEN)"
    )
    assert err[1].startswith("lmiserve: configuration error: invalid value 'fp64' for option 'dtype'")


def test_enforce_eager_is_an_option_not_an_ignored_lmi_key(monkeypatch):
    """LMI's and vLLM's `enforce_eager` (no CUDA graphs) reaches the engine from the flag, -o, serving.properties
    and OPTION_ENFORCE_EAGER, and is no longer among the LMI keys lmiserve ignores."""
    from lmiserve.config import load_settings
    from lmiserve.config.settings import LMI_IGNORED_KEYS
    from lmiserve.models.compose import engine_config

    assert "enforce_eager" not in LMI_IGNORED_KEYS
    seen = capture_serve(monkeypatch)
    assert cli.main(["serve", "--enforce-eager"]) == 0
    assert seen["settings"].enforce_eager
    assert seen["settings"].sources["enforce_eager"] == "command line --enforce-eager"
    settings = load_settings({}, None, None, environ={"OPTION_ENFORCE_EAGER": "true"})
    assert engine_config(settings).enforce_eager
    assert not engine_config(load_settings({}, None, None, environ={})).enforce_eager
