"""Configuration: properties syntax, typed settings, error messages and source precedence."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmiserve.config import (
    ConfigError,
    Settings,
    load_settings,
    parse_override,
    parse_properties,
    read_properties,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_FILES = [
    *sorted((ROOT / "configs").glob("*.properties")),
    ROOT / "serving.properties.example",
]


# ---------------------------------------------------------------- properties syntax


def test_separators_and_whitespace() -> None:
    text = "a=1\nb: 2\nc 3\n  d  =  4  \ne\t:\tfive six\nf==x\ng = \n"
    assert parse_properties(text) == {
        "a": "1", "b": "2", "c": "3", "d": "4", "e": "five six", "f": "=x", "g": "",
    }  # fmt: skip


def test_comments_and_blank_lines() -> None:
    text = "# comment\n! bang comment\n   # indented comment\n\n   \nkey=value # not a comment\n"
    assert parse_properties(text) == {"key": "value # not a comment"}


def test_backslash_continuation() -> None:
    text = "key=one, \\\n    two, \\\n    three\nnext=ok\nescaped=ends with backslash\\\\\nlast=1"
    assert parse_properties(text) == {
        "key": "one, two, three",
        "next": "ok",
        "escaped": "ends with backslash\\",
        "last": "1",
    }


def test_continuation_line_starting_with_hash_is_value() -> None:
    assert parse_properties("key=a\\\n  #b") == {"key": "a#b"}


def test_escapes_in_keys_and_values() -> None:
    text = "a\\=b=c\\td\nu=caf\\u00e9\nwin=C:\\\\models"
    assert parse_properties(text) == {"a=b": "c\td", "u": "café", "win": "C:\\models"}


def test_option_prefix_is_stripped_and_later_duplicate_wins() -> None:
    text = "option.max_rolling_batch_size=8\nmax_rolling_batch_size=16\nengine=Python\n"
    assert parse_properties(text) == {"max_rolling_batch_size": "16", "engine": "Python"}
    text = "max_rolling_batch_size=16\noption.max_rolling_batch_size=8\n"
    assert parse_properties(text) == {"max_rolling_batch_size": "8"}


def test_keys_are_case_sensitive() -> None:
    assert parse_properties("Dtype=fp16\ndtype=bf16") == {"Dtype": "fp16", "dtype": "bf16"}


def test_crlf_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "serving.properties"
    path.write_bytes("\ufeffoption.dtype=bf16\r\noption.port=9000\r\n".encode())
    assert read_properties(path) == {"dtype": "bf16", "port": "9000"}


def test_read_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.properties"):
        read_properties(tmp_path / "nope.properties")


# ---------------------------------------------------------------- typed settings


def test_defaults() -> None:
    s = Settings()
    assert (s.model_id, s.dtype, s.device, s.rolling_batch) == (None, "auto", "auto", "auto")
    assert (s.max_rolling_batch_size, s.max_rolling_batch_prefill_tokens) == (32, 2048)
    assert (s.max_new_tokens, s.max_new_tokens_limit, s.job_queue_size) == (30, 4096, 1000)
    assert (s.batch_size, s.max_batch_delay, s.predict_timeout) == (1, 100, 120.0)
    assert (s.host, s.port, s.log_level, s.output_formatter) == ("0.0.0.0", 8080, "info", None)
    assert not (s.tgi_compat or s.trust_remote_code or s.enable_streaming or s.batch_invariant)
    assert s.dynamic_batching is False
    assert s.extra == {} and s.sources == {}


def test_every_field_has_a_description() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description, name


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("TRUE", True), ("True", True), ("1", True), ("yes", True), ("on", True),
     ("false", False), ("False", False), ("0", False), ("NO", False), (" off ", False)],
)  # fmt: skip
def test_boolean_coercion(text: str, expected: bool) -> None:
    assert Settings.from_options({"tgi_compat": text}).tgi_compat is expected


def test_integer_and_float_coercion() -> None:
    options = {"max_rolling_batch_size": "64", "predict_timeout": "2.5", "port": "9000"}
    s = Settings.from_options(options)
    assert (s.max_rolling_batch_size, s.predict_timeout, s.port) == (64, 2.5, 9000)


def test_word_normalisation() -> None:
    s = Settings.from_options({"dtype": "BF16", "device": "CUDA:1", "log_level": "WARN"})
    assert (s.dtype, s.device, s.log_level) == ("bf16", "cuda:1", "warning")
    assert Settings.from_options({"dtype": "float16"}).dtype == "fp16"


@pytest.mark.parametrize("engine", ["vllm", "lmi-dist", "scheduler", "trtllm", "LMI", "auto"])
def test_lmi_engine_names_mean_lmi(engine: str) -> None:
    expected = "auto" if engine == "auto" else "lmi"
    assert Settings.from_options({"rolling_batch": engine}).rolling_batch == expected


def test_empty_value_means_default() -> None:
    s = Settings.from_options({"max_input_len": "", "dtype": " ", "model_id": ""})
    assert (s.max_input_len, s.dtype, s.model_id) == (None, "auto", None)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("dtype", "fp64", "one of auto, fp32, fp16, bf16"),
        ("device", "tpu", "one of auto, cpu, cuda, cuda:N"),
        ("device", "cuda:x", "cuda:N"),
        ("trust_remote_code", "maybe", "true or false"),
        ("tgi_compat", "2", "true or false"),
        ("rolling_batch", "turbo", "one of auto, lmi, disable"),
        ("output_formatter", "xml", "one of json, jsonlines, sse, tgi_compat"),
        ("log_level", "loud", "one of debug, info, warning, error"),
        ("max_rolling_batch_size", "0", "an integer >= 1"),
        ("max_rolling_batch_size", "lots", "an integer >= 1"),
        ("max_rolling_batch_prefill_tokens", "-5", "an integer >= 1"),
        ("max_input_len", "0", "an integer >= 1"),
        ("max_new_tokens", "1.5", "an integer >= 1"),
        ("max_new_tokens_limit", "0", "an integer >= 1"),
        ("job_queue_size", "0", "an integer >= 1"),
        ("batch_size", "0", "an integer >= 1"),
        ("max_batch_delay", "-1", "an integer >= 0"),
        ("predict_timeout", "0", "a number > 0"),
        ("predict_timeout", "soon", "a number > 0"),
        ("port", "70000", "an integer from 1 to 65535"),
    ],
)
def test_bad_value_message_names_key_value_and_allowed(key: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_options({f"option.{key}": value})
    message = str(info.value)
    assert f"invalid value {value!r} for option {key!r}: expected " in message
    assert allowed in message


def test_bad_value_message_names_the_source() -> None:
    with pytest.raises(ConfigError, match="from environment OPTION_DTYPE"):
        load_settings({}, None, None, environ={"OPTION_DTYPE": "fp64"})


def test_several_bad_values_are_all_reported() -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_options({"dtype": "fp64", "port": "x"})
    assert "'dtype'" in str(info.value) and "'port'" in str(info.value)


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_max_new_tokens_above_limit_is_rejected() -> None:
    with pytest.raises(ConfigError, match="max_new_tokens=100 is larger than max_new_tokens_limit"):
        Settings.from_options({"max_new_tokens": "100", "max_new_tokens_limit": "50"})


def test_batch_size_above_one_forces_dynamic_batching() -> None:
    s = Settings.from_options({"batch_size": "4"})
    assert s.rolling_batch == "disable" and s.dynamic_batching
    assert s.sources["rolling_batch"] == "batch_size=4"
    assert Settings.from_options({"max_dynamic_batch_size": "2"}).batch_size == 2
    assert Settings.from_options({"rolling_batch": "disable"}).dynamic_batching


def test_batch_size_above_one_with_streaming_is_an_error() -> None:
    with pytest.raises(ConfigError, match="enable_streaming"):
        Settings.from_options({"batch_size": "4", "enable_streaming": "true"})
    s = Settings.from_options({"rolling_batch": "disable", "enable_streaming": "true"})
    assert s.enable_streaming and s.dynamic_batching


def test_unknown_keys_are_kept_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lmiserve.config"):
        s = Settings.from_options({"engine": "Python", "option.pipeline_parallel_degree": "max"})
    assert s.extra == {"engine": "Python", "pipeline_parallel_degree": "max"}
    assert "pipeline_parallel_degree" in caplog.text


def test_unknown_keys_are_named_in_one_warning_line(caplog: pytest.LogCaptureFixture) -> None:
    options = {"engine": "Python", "pipeline_parallel_degree": "8", "max_rolling_batch_sise": "4", "zzz": "1"}
    sources = {"engine": "properties file p", "max_rolling_batch_sise": "environment OPTION_MAX_ROLLING_BATCH_SISE"}
    with caplog.at_level(logging.WARNING, logger="lmiserve.config"):
        s = Settings.from_options(options, sources)
    assert s.extra == options
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "ignoring 4 unknown options: 'engine' (an LMI option lmiserve does not use; from properties file p), "
        "'pipeline_parallel_degree' (an LMI option lmiserve does not use), "
        "'max_rolling_batch_sise' (did you mean 'max_rolling_batch_size'?; "
        "from environment OPTION_MAX_ROLLING_BATCH_SISE), 'zzz'"
    )


def test_model_cache_dir(tmp_path: Path) -> None:
    assert Settings(model_cache_dir=str(tmp_path)).resolved_model_cache_dir() == tmp_path
    assert Settings().resolved_model_cache_dir().name == "lmiserve"


def test_summary_names_sources() -> None:
    s = load_settings({}, None, None, environ={"OPTION_MAX_ROLLING_BATCH_SIZE": "64"})
    lines = s.summary()
    assert "max_rolling_batch_size=64 (from environment OPTION_MAX_ROLLING_BATCH_SIZE)" in lines
    assert "dtype=auto (default)" in lines


def test_changed_names_only_the_values_that_differ_from_their_defaults() -> None:
    env = {"OPTION_MAX_NEW_TOKENS": "64", "OPTION_PORT": "8080"}
    s = load_settings({"dtype": "bf16", "api_key": "secret"}, None, None, environ=env)
    assert s.changed() == [
        "dtype=bf16 (command line)",
        "max_new_tokens=64 (environment OPTION_MAX_NEW_TOKENS)",
        "api_key=<hidden> (command line)",
    ]  # port=8080 is set, but to its default
    assert load_settings({}, None, None, environ={}).changed() == []
    assert "rolling_batch=disable (batch_size=4)" in Settings.from_options({"batch_size": "4"}).changed()


def test_unknown_command_line_keys_are_an_error_but_unknown_file_keys_are_kept(tmp_path: Path) -> None:
    props = tmp_path / "serving.properties"
    props.write_text("option.pipeline_parallel_degree=2\n")
    assert load_settings({}, props, None, environ={}).extra == {"pipeline_parallel_degree": "2"}
    with pytest.raises(ConfigError, match=r"^unknown option 'pipeline_parallel_degree' \(an LMI option"):
        load_settings({"pipeline_parallel_degree": "2"}, None, None, environ={})
    with pytest.raises(ConfigError, match=r"^unknown option 'extra' "):
        load_settings({"extra": "x"}, None, None, environ={})  # the bookkeeping fields are no keys


# ---------------------------------------------------------------- overrides


def test_parse_override() -> None:
    assert parse_override("max_new_tokens=64") == ("max_new_tokens", "64")
    assert parse_override("option.model_id = a=b ") == ("model_id", "a=b")
    assert parse_override("model_id=") == ("model_id", "")


@pytest.mark.parametrize("text", ["max_new_tokens", "=5", ""])
def test_parse_override_without_key_value(text: str) -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override(text)


# ---------------------------------------------------------------- example files


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_files_load(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lmiserve.config"):
        settings = load_settings({}, path, None, environ={})
    assert settings.extra == {}
    assert "lmiserve serve --properties" in path.read_text()


def test_example_file_lists_every_key() -> None:
    text = (ROOT / "serving.properties.example").read_text()
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for key in Settings.option_keys():
        assert f"{key}=" in text, key
        assert f"| `{key}`" in docs, key


def test_configs_set_what_their_names_promise() -> None:
    def load(name: str) -> Settings:
        return load_settings({}, ROOT / "configs" / name, None, environ={})

    gpu = load("gpu-llama-bf16.properties")
    assert (gpu.device, gpu.dtype, gpu.max_rolling_batch_size) == ("cuda", "bf16", 64)
    assert gpu.model_id and "llama" in gpu.model_id.lower()
    assert load("tgi-compatible.properties").tgi_compat
    assert load("jsonlines-streaming.properties").output_formatter == "jsonlines"
    cpu = load("cpu-demo.properties")
    assert cpu.model_id is None and cpu.device == "cpu" and cpu.max_rolling_batch_size <= 8


def test_tensor_parallel_degree_is_a_number_of_ranks_or_max():
    """LMI's `tensor_parallel_degree` (vLLM's `tensor_parallel_size`, `--tensor-parallel-size`) is never
    ignored: a number of ranks (any, from every source; whether the model and the devices allow it is
    checked when the model loads) or `max` (the visible GPUs; 1 on a CPU). What tensor parallelism
    does not serve is refused with it (tests/unit/test_tensor_parallel.py)."""
    assert Settings.from_options({"option.tensor_parallel_degree": "max"}).tensor_parallel_degree == "max"
    assert Settings.from_options({"tensor_parallel_size": "1"}).tensor_parallel_degree == "1"
    settings = load_settings({}, None, None, environ={"OPTION_TENSOR_PARALLEL_DEGREE": "4"})
    assert (settings.tensor_parallel_degree, settings.sources["tensor_parallel_degree"]) == (
        "4",
        "environment OPTION_TENSOR_PARALLEL_DEGREE",
    )
    # `max` (and 1) combine with everything: on a CPU they mean one process
    assert Settings.from_options({"tensor_parallel_degree": "max", "enable_lora": "true"}).enable_lora
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree=4 cannot be combined with batch_invariant"):
        load_settings({}, None, None, environ={"OPTION_TENSOR_PARALLEL_DEGREE": "4", "OPTION_BATCH_INVARIANT": "true"})
    with pytest.raises(ConfigError, match=r"for option 'tensor_parallel_degree': expected a positive whole number"):
        Settings.from_options({"tensor_parallel_degree": "0"})


def test_kv_cache_slots_is_refused_with_one_line() -> None:
    """The slot KV cache is gone: `kv_cache=slots` stops the start with one line saying what serves
    instead (and where the value came from), whatever else is set; `paged` is the only value."""
    slots = (
        "kv_cache=slots is no longer served: the paged KV cache serves every model "
        "(batch_invariant=true gives generate()'s output bit for bit)"
    )
    with pytest.raises(ConfigError) as refused:
        load_settings({}, None, None, environ={"OPTION_KV_CACHE": "slots", "OPTION_TENSOR_PARALLEL_DEGREE": "4"})
    assert str(refused.value) == f"invalid configuration: {slots} (from environment OPTION_KV_CACHE)"
    for value in ("slots", " Slots "):
        with pytest.raises(ConfigError) as refused:
            Settings.from_options({"kv_cache": value, "batch_invariant": "true", "enable_lora": "true"})
        assert str(refused.value) == f"invalid configuration: {slots}"
    with pytest.raises(ValueError, match=r"kv_cache=slots is no longer served"):  # built directly too
        Settings(kv_cache="slots")
    with pytest.raises(ConfigError, match=r"for option 'kv_cache': expected paged"):
        Settings.from_options({"kv_cache": "blocks"})
    assert Settings().kv_cache == Settings.from_options({"kv_cache": "paged"}).kv_cache == "paged"
    # what the paged KV cache alone serves is still refused with batch_invariant (its runner is not paged)
    with pytest.raises(ConfigError, match=r"LoRA adapters are not served with batch_invariant=true"):
        Settings.from_options({"enable_lora": "true", "batch_invariant": "true"})
    with pytest.raises(ConfigError, match=r"speculative_config is not served with batch_invariant=true"):
        Settings.from_options({"speculative_config": '{"method": "ngram"}', "batch_invariant": "true"})
    assert Settings.from_options({"enable_lora": "true", "speculative_config": '{"method": "ngram"}'}).enable_lora
