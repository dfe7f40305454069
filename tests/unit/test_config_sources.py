"""Configuration sources and precedence: CLI > environment > serving.properties > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmiserve.config import ConfigError, load_settings


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def props(tmp_path: Path) -> Path:
    return write(
        tmp_path / "test.properties",
        "option.model_id=from-props\noption.max_rolling_batch_size=8\n"
        "option.port=7000\noption.dtype=fp16\njob_queue_size=10\n",
    )


def test_defaults_only() -> None:
    s = load_settings({}, None, None, environ={})
    assert s.model_id is None and s.port == 8080 and s.sources == {}


def test_properties_beat_defaults(props: Path) -> None:
    s = load_settings({}, props, None, environ={})
    assert (s.model_id, s.max_rolling_batch_size, s.port) == ("from-props", 8, 7000)
    assert s.dtype == "fp16"
    assert s.sources["port"] == f"properties file {props}"
    assert "predict_timeout" not in s.sources


def test_environment_beats_properties(props: Path) -> None:
    env = {
        "HF_MODEL_ID": "from-env",
        "MAX_BATCH_SIZE": "16",
        "SAGEMAKER_BIND_TO_PORT": "7001",
        "SERVING_JOB_QUEUE_SIZE": "20",
    }
    s = load_settings({}, props, None, environ=env)
    assert (s.model_id, s.max_rolling_batch_size) == ("from-env", 16)
    assert (s.port, s.job_queue_size) == (7001, 20)
    assert s.dtype == "fp16"  # untouched keys keep the file's value
    assert s.sources["model_id"] == "environment HF_MODEL_ID"
    assert s.sources["max_rolling_batch_size"] == "environment MAX_BATCH_SIZE"


def test_cli_beats_environment(props: Path) -> None:
    env = {"HF_MODEL_ID": "from-env", "MAX_BATCH_SIZE": "16", "SAGEMAKER_BIND_TO_PORT": "7001"}
    cli = {"model_id": "from-cli", "option.max_rolling_batch_size": "64", "port": "9000"}
    s = load_settings(cli, props, None, environ=env)
    assert (s.model_id, s.max_rolling_batch_size, s.port) == ("from-cli", 64, 9000)
    assert s.sources["port"] == "command line"


def test_cli_none_values_mean_not_given() -> None:
    s = load_settings({"port": None}, None, None, environ={"SAGEMAKER_BIND_TO_PORT": "7001"})
    assert s.port == 7001


def test_option_env_beats_shortcuts() -> None:
    env = {
        "HF_MODEL_ID": "shortcut",
        "OPTION_MODEL_ID": "explicit",
        "MAX_BATCH_SIZE": "4",
        "OPTION_MAX_ROLLING_BATCH_SIZE": "5",
        "MAX_BATCH_PREFILL_TOKENS": "100",
        "SERVING_PORT": "7002",
        "OPTION_PORT": "7003",
        "SAGEMAKER_BIND_TO_PORT": "7004",
    }
    s = load_settings({}, None, None, environ=env)
    assert (s.model_id, s.max_rolling_batch_size, s.port) == ("explicit", 5, 7003)
    assert s.max_rolling_batch_prefill_tokens == 100
    assert s.sources["model_id"] == "environment OPTION_MODEL_ID"


@pytest.mark.parametrize(
    ("env", "key", "expected"),
    [
        ({"HF_REVISION": "v2"}, "revision", "v2"),
        ({"HF_MODEL_TRUST_REMOTE_CODE": "TRUE"}, "trust_remote_code", True),
        ({"PREDICT_TIMEOUT": "30"}, "predict_timeout", 30.0),
        ({"SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS": "45"}, "predict_timeout", 45.0),
        (
            {"PREDICT_TIMEOUT": "30", "SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS": "45"},
            "predict_timeout",
            30.0,
        ),
        ({"OPTION_TGI_COMPAT": "true"}, "tgi_compat", True),
        ({"OPTION_ROLLING_BATCH": "vllm"}, "rolling_batch", "lmi"),
        ({"SERVING_BATCH_SIZE": "4"}, "rolling_batch", "disable"),
        ({"OPTION_MAX_DYNAMIC_BATCH_SIZE": "3"}, "batch_size", 3),
        # TGI's launcher's variables (a TGI deployment's environment, unchanged)
        ({"MODEL_ID": "/models/tgi"}, "model_id", "/models/tgi"),
        ({"MODEL_ID": "/models/tgi", "HF_MODEL_ID": "/models/sagemaker"}, "model_id", "/models/sagemaker"),
        ({"MAX_INPUT_LENGTH": "1000"}, "max_input_tokens", 1000),
        ({"MAX_INPUT_LENGTH": "1000", "MAX_INPUT_TOKENS": "2000"}, "max_input_tokens", 2000),
        ({"MAX_TOTAL_TOKENS": "4096"}, "max_total_tokens", 4096),
        ({"NUM_SHARD": "2"}, "tensor_parallel_degree", "2"),
    ],
)
def test_environment_mapping(env: dict[str, str], key: str, expected: object) -> None:
    assert getattr(load_settings({}, None, None, environ=env), key) == expected


def test_empty_environment_values_are_ignored(props: Path) -> None:
    env = {"HF_MODEL_ID": "", "OPTION_PORT": "  ", "OPTION_MODEL_ID": ""}
    s = load_settings({}, props, None, environ=env)
    assert (s.model_id, s.port) == ("from-props", 7000)


def test_unrelated_and_unknown_environment_is_not_fatal() -> None:
    env = {
        "PATH": "/bin",
        "OPTION_PIPELINE_PARALLEL_DEGREE": "max",
        "OPTION_ENTRYPOINT": "djl_python.x",
    }
    s = load_settings({}, None, None, environ=env)
    assert s.extra == {"pipeline_parallel_degree": "max", "entryPoint": "djl_python.x"}
    assert "path" not in s.extra


def test_model_dir_with_serving_properties(tmp_path: Path) -> None:
    write(tmp_path / "serving.properties", "engine=Python\noption.max_rolling_batch_size=12\n")
    s = load_settings({}, None, tmp_path, environ={})
    assert s.model_id == str(tmp_path)
    assert s.sources["model_id"] == f"model directory {tmp_path}"
    assert s.max_rolling_batch_size == 12
    assert s.extra == {"engine": "Python"}


def test_model_dir_properties_can_name_another_model(tmp_path: Path) -> None:
    write(tmp_path / "serving.properties", "option.model_id=other/model\n")
    assert load_settings({}, None, tmp_path, environ={}).model_id == "other/model"


def test_model_dir_without_properties(tmp_path: Path) -> None:
    s = load_settings({}, None, tmp_path, environ={})
    assert s.model_id == str(tmp_path) and s.max_rolling_batch_size == 32


def test_model_id_from_environment_beats_model_dir(tmp_path: Path) -> None:
    s = load_settings({}, None, tmp_path, environ={"HF_MODEL_ID": "org/model"})
    assert s.model_id == "org/model"


def test_explicit_properties_file_beats_model_dir_file(tmp_path: Path, props: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    write(model_dir / "serving.properties", "option.max_rolling_batch_size=99\n")
    s = load_settings({}, props, model_dir, environ={})
    assert s.max_rolling_batch_size == 8 and s.model_id == "from-props"


def test_missing_properties_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.properties"):
        load_settings({}, tmp_path / "missing.properties", None, environ={})


def test_missing_model_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings({}, None, tmp_path / "absent", environ={})


def test_canonical_key_beats_alias_within_one_source(tmp_path: Path) -> None:
    path = write(tmp_path / "a.properties", "batch_size=2\nmax_dynamic_batch_size=5\n")
    assert load_settings({}, path, None, environ={}).batch_size == 2
    s = load_settings({"max_dynamic_batch_size": "3"}, path, None, environ={})
    assert s.batch_size == 3 and s.sources["batch_size"] == "command line"


def test_empty_cli_value_resets_to_default() -> None:
    s = load_settings({"dtype": ""}, None, None, environ={"OPTION_DTYPE": "bf16"})
    assert s.dtype == "auto" and "dtype" not in s.sources


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTION_MAX_NEW_TOKENS", "77")
    assert load_settings({}, None, None).max_new_tokens == 77


def test_vertex_aip_storage_uri_is_the_model_when_none_is_named(tmp_path):
    from lmiserve.config import load_settings

    gs = {"AIP_STORAGE_URI": "gs://bucket/model"}
    settings = load_settings(environ=gs)
    assert settings.model_id == "gs://bucket/model"
    assert settings.sources["model_id"] == "environment AIP_STORAGE_URI"
    assert load_settings(environ={**gs, "HF_MODEL_ID": "org/name"}).model_id == "org/name"
    assert load_settings(model_dir=tmp_path, environ=gs).model_id == str(tmp_path)
    assert load_settings(environ={"AIP_STORAGE_URI": str(tmp_path)}).model_id is None  # the container's model root
