"""The Vision settings (lmiserve/config/settings_media.py): defaults, vLLM's spellings, the sources, one
clear line for a bad value, and the `MediaLimits` the media loader gets from them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmiserve.cli import build_parser
from lmiserve.config import ConfigError, load_settings
from lmiserve.config.flags import flag_values
from lmiserve.core.media import MediaLimits
from lmiserve.media import media_limits

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_media_limits_defaults():
    s = load_settings({}, environ={})
    assert (s.limit_mm_per_prompt, s.max_image_bytes, s.max_image_pixels, s.media_fetch_timeout) == (
        4,
        20 * 2**20,
        64 * 2**20,
        5.0,
    )
    assert s.allowed_media_domains is None and s.media_domains() == () and s.allow_private_media_urls is False
    assert media_limits(s) == MediaLimits()


@pytest.mark.parametrize(
    ("value", "images"), [("2", 2), ('{"image": 3}', 3), ('{"image": 1, "video": 0}', 1), ("0", 0), ("{}", 0)]
)
def test_limit_mm_per_prompt_takes_vllms_json_or_a_number(value, images):
    assert load_settings({"limit_mm_per_prompt": value}, environ={}).limit_mm_per_prompt == images


def test_other_modalities_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="lmiserve.config.settings"):
        s = load_settings({"limit_mm_per_prompt": '{"image": 2, "video": 1}'}, environ={})
    assert s.limit_mm_per_prompt == 2
    assert "serves images only; video ignored" in caplog.text


def test_the_media_settings_from_every_source(tmp_path):
    properties = tmp_path / "serving.properties"
    properties.write_text("option.max_image_bytes=5MiB\nallowed_media_domains=a.example, *.cdn.example\n")
    environ = {
        "OPTION_LIMIT_MM_PER_PROMPT": '{"image": 8}',
        "VLLM_IMAGE_FETCH_TIMEOUT": "2.5",
        "OPTION_ALLOW_PRIVATE_MEDIA_URLS": "yes",
        "SERVING_MAX_IMAGE_PIXELS": "1000000",
    }
    s = load_settings({}, properties, environ=environ)
    assert media_limits(s) == MediaLimits(
        max_images=8,
        max_image_bytes=5 * 2**20,
        max_image_pixels=1_000_000,
        fetch_timeout=2.5,
        allowed_domains=("a.example", "*.cdn.example"),
        allow_private=True,
    )
    assert s.sources["media_fetch_timeout"] == "environment VLLM_IMAGE_FETCH_TIMEOUT"
    # OPTION_* beats vLLM's variable
    both = {"VLLM_IMAGE_FETCH_TIMEOUT": "2.5", "OPTION_MEDIA_FETCH_TIMEOUT": "7"}
    assert load_settings({}, environ=both).media_fetch_timeout == 7.0


def test_allowed_media_domains_as_a_list_is_normalised():
    for value in ('["Images.Example.com", "*.cdn.example."]', "Images.Example.com , *.cdn.example.,"):
        s = load_settings({"allowed_media_domains": value}, environ={})
        assert s.media_domains() == ("images.example.com", "*.cdn.example")
    assert load_settings({"allowed_media_domains": "*"}, environ={}).media_domains() == ("*",)
    assert load_settings({"allowed_media_domains": " , "}, environ={}).media_domains() == ()


def test_vllms_flags():
    args = build_parser().parse_args(
        ["serve", "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "a.example,b.example"]
    )
    values, sources = flag_values(args)
    s = load_settings(values, environ={}, cli_sources=sources)
    assert s.limit_mm_per_prompt == 2 and s.media_domains() == ("a.example", "b.example")
    assert s.sources["limit_mm_per_prompt"] == "command line --limit-mm-per-prompt"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("limit_mm_per_prompt", "-1", 'an integer >= 0, or JSON such as {"image": 4}'),
        ("limit_mm_per_prompt", '{"imgae": 2}', 'an integer >= 0, or JSON such as {"image": 4}'),
        ("limit_mm_per_prompt", '{"image": 2', 'an integer >= 0, or JSON such as {"image": 4}'),
        ("limit_mm_per_prompt", "four", 'an integer >= 0, or JSON such as {"image": 4}'),
        ("allowed_media_domains", "https://images.example/", "comma-separated host names, *.domain or *"),
        ("allowed_media_domains", "a.example,bad host", "comma-separated host names, *.domain or *"),
        ("allowed_media_domains", "[1, 2]", "comma-separated host names, *.domain or *"),
        ("allowed_media_domains", "**.example", "comma-separated host names, *.domain or *"),
        ("max_image_bytes", "0", "a size >= 1 in bytes"),
        ("max_image_bytes", "huge", "a size >= 1 in bytes"),
        ("max_image_pixels", "0", "an integer >= 1"),
        ("media_fetch_timeout", "0", "a number > 0"),
        ("allow_private_media_urls", "maybe", "true or false"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(key, value, expected):
    with pytest.raises(ConfigError) as info:
        load_settings({key: value}, environ={})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"invalid value {value!r} for option {key!r}: expected {expected}"), message


def test_the_example_file_sets_the_defaults():
    text = (ROOT / "serving.properties.example").read_text()
    lines = [line[1:] for line in text.splitlines() if line.startswith("#") and "=" in line]
    keys = (
        "limit_mm_per_prompt",
        "max_image_bytes",
        "max_image_pixels",
        "allow_private_media_urls",
        "media_fetch_timeout",
    )
    options = dict(line.split("=", 1) for line in lines if line.split("=", 1)[0] in keys)
    assert sorted(options) == sorted(keys)
    assert media_limits(load_settings(options, environ={})) == MediaLimits()
