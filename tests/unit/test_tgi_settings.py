"""Settings of the TGI/OpenAI routes: defaults of TGI's launcher, the API key's sources and
precedence, its hiding in the startup log, and the mapping onto the model's limits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmiserve.cli import build_parser
from lmiserve.config import ConfigError, load_settings
from lmiserve.core.limits import limits_for as tgi_limits


def test_tgi_defaults():
    s = load_settings({}, environ={})
    assert (
        s.max_concurrent_requests,
        s.max_best_of,
        s.max_stop_sequences,
        s.max_top_n_tokens,
        s.max_client_batch_size,
    ) == (128, 2, 4, 5, 4)
    assert s.api_key is None and s.max_input_tokens is None and s.max_total_tokens is None
    assert s.sse_keepalive_interval == 15.0 and s.payload_limit == 2_000_000


def test_api_key_sources_and_precedence():
    assert load_settings({}, environ={"API_KEY": "a"}).api_key == "a"
    assert load_settings({}, environ={"API_KEY": "a", "OPTION_API_KEY": "b"}).api_key == "b"
    assert load_settings({"api_key": "c"}, environ={"OPTION_API_KEY": "b"}).api_key == "c"


def test_api_key_is_hidden_in_the_summary():
    lines = load_settings({"api_key": "topsecret"}, environ={}).summary()
    assert "api_key=<hidden> (from command line)" in lines
    assert not any("topsecret" in line for line in lines)


def test_cli_flag():
    args = build_parser().parse_args(["serve", "--api-key", "k"])
    assert args.api_key == "k"


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="max_concurrent_requests"):
        load_settings({"max_concurrent_requests": "0"}, environ={})
    with pytest.raises(ConfigError, match="sse_keepalive_interval"):
        load_settings({"sse_keepalive_interval": "-1"}, environ={})


def service(context: int, **options) -> SimpleNamespace:
    return SimpleNamespace(settings=load_settings(options, environ={}), loaded=SimpleNamespace(max_context=context))


def test_limits_from_the_model_context():
    limits = tgi_limits(service(2048))
    assert (limits.max_total_tokens, limits.max_input_tokens) == (2048, 2047)


def test_limits_are_capped_by_the_context_and_max_input_len():
    assert tgi_limits(service(2048, max_total_tokens="9999")).max_total_tokens == 2048
    limits = tgi_limits(service(2048, max_total_tokens="1024", max_input_tokens="2000"))
    assert (limits.max_total_tokens, limits.max_input_tokens) == (1024, 1023)
    assert tgi_limits(service(2048, max_input_len="100")).max_input_tokens == 100
    assert tgi_limits(service(2048, max_input_len="100", max_input_tokens="500")).max_input_tokens == 100
    assert tgi_limits(service(2048, max_input_tokens="500")).max_input_tokens == 500
