"""Where settings come from, and which source wins.

Precedence, highest first: command line > environment > serving.properties > defaults.
(DJL Serving lets serving.properties beat the environment; lmiserve follows the usual
twelve-factor order so a deployment can override a baked-in file.)

Environment mapping, lowest first within the environment (a later entry wins):

- shortcuts, in ``ENV_SHORTCUTS`` order: ``MODEL_ID`` (TGI's) then ``HF_MODEL_ID`` -> model_id, ``HF_REVISION`` ->
  revision, ``MAX_INPUT_LENGTH`` then ``MAX_INPUT_TOKENS`` -> max_input_tokens, ``MAX_TOTAL_TOKENS`` ->
  max_total_tokens, ``NUM_SHARD`` -> tensor_parallel_degree (TGI's launcher),
  ``HF_MODEL_TRUST_REMOTE_CODE`` -> trust_remote_code, ``MAX_BATCH_SIZE`` -> max_rolling_batch_size,
  ``MAX_BATCH_PREFILL_TOKENS`` -> max_rolling_batch_prefill_tokens, ``MAX_CONCURRENT_REQUESTS`` ->
  job_queue_size, ``SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS`` then ``PREDICT_TIMEOUT`` -> predict_timeout,
  ``AIP_HTTP_PORT`` (Vertex AI) then ``SAGEMAKER_BIND_TO_PORT`` -> port,
  ``SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT`` -> default_invocations_accept, ``SAGEMAKER_MAX_REQUEST_SIZE`` ->
  max_request_size, ``AIP_PREDICT_ROUTE`` / ``AIP_HEALTH_ROUTE`` / ``AIP_DEPLOYED_MODEL_ID`` ->
  vertex_predict_route / vertex_health_route / vertex_deployed_model_id, ``API_KEY`` -> api_key (TGI's
  name), ``LORA_ADAPTERS`` -> lora_adapters (TGI's), ``HF_MODEL_QUANTIZE`` then ``QUANTIZE`` -> quantize
  (SageMaker's TGI, TGI's), ``LWS_GROUP_SIZE`` / ``PET_NNODES`` / ``NNODES`` -> nnodes,
  ``LWS_WORKER_INDEX`` / ``PET_NODE_RANK`` / ``NODE_RANK`` -> node_rank, ``LWS_LEADER_ADDRESS`` / ``MASTER_ADDR``
  -> master_addr, ``MASTER_PORT`` -> master_port (LeaderWorkerSet's, torchrun's, the plain names),
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` then ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` -> otlp_traces_endpoint and
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` then ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` -> otlp_traces_protocol
  (OpenTelemetry's own), ``VLLM_IMAGE_FETCH_TIMEOUT`` -> media_fetch_timeout and
  ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` -> keep_alive_timeout (vLLM's);
- ``SERVING_<NAME>`` -> ``<name>`` lower-cased (e.g. ``SERVING_JOB_QUEUE_SIZE``);
- ``OPTION_<NAME>`` -> ``<name>`` lower-cased (e.g. ``OPTION_MAX_ROLLING_BATCH_SIZE``).

Within one source a key's own name beats its alias (``OPTION_BATCH_SIZE`` beats
``OPTION_MAX_DYNAMIC_BATCH_SIZE``). `environment_names` lists a key's variables, the winner first.
Empty environment values are ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from lmiserve.config.errors import ConfigError
from lmiserve.config.properties import read_properties, strip_option_prefix
from lmiserve.config.settings import KEY_ALIASES, Settings, canonical_key, unknown_option_error

PROPERTIES_FILE_NAME = "serving.properties"
# Vertex AI's location of the model's artifacts: the model when it is a `gs://` (or `s3://`) URL and no source names
# one (a local path is the container's model root: lmiserve/container.py)
STORAGE_URI_VARIABLE = "AIP_STORAGE_URI"

# (environment variable, key), lowest priority first.
ENV_SHORTCUTS: tuple[tuple[str, str], ...] = (
    ("MODEL_ID", "model_id"),  # TGI's launcher, then SageMaker's and lmiserve's own
    ("HF_MODEL_ID", "model_id"),
    ("HF_REVISION", "revision"),
    ("MAX_INPUT_LENGTH", "max_input_tokens"),  # TGI's older name, then its own
    ("MAX_INPUT_TOKENS", "max_input_tokens"),
    ("MAX_TOTAL_TOKENS", "max_total_tokens"),  # TGI's
    ("NUM_SHARD", "tensor_parallel_degree"),  # TGI's shards: tensor-parallel ranks
    ("HF_MODEL_TRUST_REMOTE_CODE", "trust_remote_code"),
    ("MAX_BATCH_SIZE", "max_rolling_batch_size"),
    ("MAX_BATCH_PREFILL_TOKENS", "max_rolling_batch_prefill_tokens"),
    ("MAX_CONCURRENT_REQUESTS", "job_queue_size"),
    ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "predict_timeout"),
    ("PREDICT_TIMEOUT", "predict_timeout"),
    ("AIP_HTTP_PORT", "port"),
    ("SAGEMAKER_BIND_TO_PORT", "port"),
    ("SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT", "default_invocations_accept"),
    ("SAGEMAKER_MAX_REQUEST_SIZE", "max_request_size"),
    ("AIP_PREDICT_ROUTE", "vertex_predict_route"),
    ("AIP_HEALTH_ROUTE", "vertex_health_route"),
    ("AIP_DEPLOYED_MODEL_ID", "vertex_deployed_model_id"),
    ("API_KEY", "api_key"),
    ("LORA_ADAPTERS", "lora_adapters"),
    ("HF_MODEL_QUANTIZE", "quantize"),  # SageMaker's TGI containers, then TGI's own
    ("QUANTIZE", "quantize"),
    ("LWS_GROUP_SIZE", "nnodes"),  # LeaderWorkerSet, then torchrun (PET_*), then the plain names
    ("PET_NNODES", "nnodes"),
    ("NNODES", "nnodes"),
    ("LWS_WORKER_INDEX", "node_rank"),
    ("PET_NODE_RANK", "node_rank"),
    ("NODE_RANK", "node_rank"),
    ("LWS_LEADER_ADDRESS", "master_addr"),
    ("MASTER_ADDR", "master_addr"),
    ("MASTER_PORT", "master_port"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "otlp_traces_endpoint"),  # OpenTelemetry's own, the traces' name winning
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "otlp_traces_endpoint"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "otlp_traces_protocol"),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "otlp_traces_protocol"),
    ("VLLM_IMAGE_FETCH_TIMEOUT", "media_fetch_timeout"),  # vLLM's
    ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "keep_alive_timeout"),  # vLLM's
)
_ENV_PREFIXES = ("SERVING_", "OPTION_")  # lowest priority first
_SPECIAL_ENV_NAMES = {"OPTION_ENTRYPOINT": "entryPoint"}  # as DJL Serving spells it
_UPPER_NAME = re.compile(r"[A-Z0-9_]+")

# key -> (value, where it came from)
Layer = dict[str, tuple[object, str]]


def parse_override(text: str) -> tuple[str, str]:
    """Split one ``-o key=value`` override into ``(key, value)``; ``option.`` is dropped."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"invalid override {text!r}: expected key=value, e.g. max_new_tokens=64")
    return canonical_key(key), value.strip()


def load_settings(
    cli_overrides: Mapping[str, object] | None = None,
    properties_file: str | Path | None = None,
    model_dir: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    cli_sources: Mapping[str, str] | None = None,
) -> Settings:
    """Merge defaults, serving.properties, the environment and CLI overrides into Settings.

    ``properties_file`` is read if given (it must exist), else ``<model_dir>/serving.properties``
    if present. With ``model_dir`` and no model_id from any source, model_id is ``model_dir``; else, with
    Vertex AI's ``AIP_STORAGE_URI`` a ``gs://`` (or ``s3://``) URL and no model_id, model_id is that URL.
    ``cli_overrides`` values of ``None`` mean "not given"; an unknown key among them is an error (in
    the other sources it is kept in ``extra`` with a warning). ``cli_sources`` names where a command-line
    key came from (``command line --port``); the default is ``command line``. ``environ`` defaults to
    ``os.environ``. Raises ``ConfigError``.
    """
    model_path = Path(model_dir) if model_dir is not None else None
    if model_path is not None and not model_path.is_dir():
        raise ConfigError(f"model directory '{model_path}' does not exist or is not a directory")

    labels = cli_sources or {}
    cli = [(key, value, labels.get(key, "command line")) for key, value in (cli_overrides or {}).items()]
    cli_layer = _canonical((key, value, label) for key, value, label in cli if value is not None)
    known = set(Settings.option_keys())
    unknown = [key for key in cli_layer if key not in known]
    if unknown:
        raise ConfigError(unknown_option_error(unknown))
    layers = [
        properties_layer(properties_file, model_path),
        environment_layer(os.environ if environ is None else environ),
        cli_layer,
    ]
    merged: Layer = {}
    for layer in layers:
        merged.update(layer)
    model_id = merged.get("model_id", ("", ""))[0]
    storage_uri = (os.environ if environ is None else environ).get(STORAGE_URI_VARIABLE, "").strip()
    if model_path is not None and not str(model_id).strip():
        merged["model_id"] = (str(model_path), f"model directory {model_path}")
    elif storage_uri.startswith(("gs://", "s3://")) and not str(model_id).strip():
        merged["model_id"] = (storage_uri, f"environment {STORAGE_URI_VARIABLE}")

    options = {key: value for key, (value, _) in merged.items()}
    sources = {key: source for key, (_, source) in merged.items()}
    return Settings.from_options(options, sources)


def properties_layer(properties_file: str | Path | None, model_dir: Path | None) -> Layer:
    """Options from the given properties file, or from ``<model_dir>/serving.properties``."""
    if properties_file is not None:
        path = Path(properties_file)
    elif model_dir is not None and (model_dir / PROPERTIES_FILE_NAME).is_file():
        path = model_dir / PROPERTIES_FILE_NAME
    else:
        return {}
    label = f"properties file {path}"
    return _canonical((k, v, label) for k, v in read_properties(path).items())


def environment_layer(environ: Mapping[str, str]) -> Layer:
    """Options from environment variables (see the module docstring for the mapping)."""
    entries: list[tuple[str, object, str]] = []
    for var, key in ENV_SHORTCUTS:
        if environ.get(var, "").strip():
            entries.append((key, environ[var], f"environment {var}"))
    for prefix in _ENV_PREFIXES:
        for var in sorted(v for v in environ if v.startswith(prefix) and len(v) > len(prefix)):
            if environ[var].strip():
                entries.append((_env_key(var, prefix), environ[var], f"environment {var}"))
    return _canonical(entries)


def environment_names(key: str) -> list[str]:
    """The environment variables that set ``key``, the winner first (see the module docstring):
    ``OPTION_<KEY>``, ``SERVING_<KEY>``, the shortcuts (the later listed first), then the aliases' names."""
    names = [f"{prefix}{key.upper()}" for prefix in reversed(_ENV_PREFIXES)]
    names += [var for var, target in reversed(ENV_SHORTCUTS) if target == key]
    for alias in (alias for alias, target in KEY_ALIASES.items() if target == key):
        names += [f"{prefix}{alias.upper()}" for prefix in reversed(_ENV_PREFIXES)]
    return names


def _env_key(var: str, prefix: str) -> str:
    if var in _SPECIAL_ENV_NAMES:
        return _SPECIAL_ENV_NAMES[var]
    name = var[len(prefix) :]
    return name.lower() if _UPPER_NAME.fullmatch(name) else name


def _canonical(entries: Iterable[tuple[str, object, str]]) -> Layer:
    """Canonical keys; within one source a canonical key beats its alias, later beats earlier."""
    direct: Layer = {}
    aliased: Layer = {}
    for raw_key, value, source in entries:
        target = aliased if strip_option_prefix(raw_key.strip()) in KEY_ALIASES else direct
        key = canonical_key(raw_key)
        target.pop(key, None)  # re-insert so the dict order follows the input order
        target[key] = (value, source)
    return {**aliased, **direct}
