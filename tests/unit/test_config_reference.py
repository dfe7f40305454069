"""The configuration reference generated from the code (lmiserve/config/reference.py): docs/configuration.md
is what the generator writes, and what the page says about a setting is what the code does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmiserve.config import Settings, load_settings
from lmiserve.config.flags import SETTING_FLAGS
from lmiserve.config.reference import (
    GROUPS,
    PAGE,
    REGENERATE,
    main,
    option_docs,
    render_markdown,
    render_text,
    search,
)
from lmiserve.config.settings import KEY_ALIASES
from lmiserve.config.sources import environment_names

ROOT = Path(__file__).resolve().parents[2]
PAGE_TEXT = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


def test_docs_configuration_md_is_what_the_code_generates() -> None:
    assert PAGE == ROOT / "docs" / "configuration.md"
    assert render_markdown() == PAGE_TEXT, (
        f"docs/configuration.md is out of date with lmiserve/config: regenerate it with `{REGENERATE}`"
    )


def test_check_mode_names_the_command_that_regenerates_the_page(tmp_path: Path, capsys) -> None:
    page = tmp_path / "configuration.md"
    page.write_text("# Configuration\n\nhand-edited\n")
    assert main(["--check", "--output", str(page)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--output", str(page)]) == 0
    assert page.read_text() == render_markdown()
    assert main(["--check", "--output", str(page)]) == 0


def test_every_setting_is_in_exactly_one_group_and_one_table_row() -> None:
    grouped = [key for _, _, keys in GROUPS for key in keys]
    assert sorted(grouped) == sorted(Settings.option_keys())
    for key in Settings.option_keys():
        rows = [line for line in PAGE_TEXT.splitlines() if line.startswith(f"| `{key}`")]
        assert len(rows) == 1, key


def test_every_setting_has_a_description_sentence() -> None:
    for key in Settings.option_keys():
        description = Settings.model_fields[key].description or ""
        assert description.endswith("."), key
        assert description[0].isupper() or description[0] == "`", key
        assert description.count("`") % 2 == 0, f"{key}: unbalanced backticks"
        assert "|" not in description, f"{key}: a '|' would break the Markdown table"


def test_table_rows_have_four_cells_whatever_the_description_holds() -> None:
    """Markup in descriptions (``<key>``, ``*``, ``|``) is escaped or in code: every row keeps its cells."""
    keys = set(Settings.option_keys())
    rows = [line for line in PAGE_TEXT.splitlines() if line.startswith("| `") and line[3 : line.index("`", 3)] in keys]
    assert len(rows) == len(keys)
    for row in rows:  # | key | default | environment | meaning |
        assert len(re.split(r"(?<!\\)\|", re.sub(r"`[^`]*`", "code", row))) == 6, row
    assert "`Authorization: Bearer <key>`" in PAGE_TEXT  # inside code: left as it is
    assert "/v1/endpoints/\\*/deployedModels" not in PAGE_TEXT  # inside code: not escaped
    assert "Q4\\_1" in PAGE_TEXT  # outside code: escaped for Markdown


def test_the_page_states_defaults_values_and_sources_from_the_code() -> None:
    docs = {doc.key: doc for doc in option_docs()}
    assert (docs["max_rolling_batch_size"].default, docs["max_rolling_batch_size"].values) == ("32", "an integer >= 1")
    assert docs["port"].values == "an integer from 1 to 65535"
    assert docs["prefix_cache_size"].default == "512MiB"
    assert docs["predict_timeout"].default == "120"
    assert docs["model_id"].default == "unset"
    assert docs["enable_prefix_caching"].default == "true"
    assert docs["batch_size"].aliases == ("max_dynamic_batch_size",)
    assert docs["max_rolling_batch_size"].flags == ("--max-rolling-batch-size", "--max-num-seqs")
    assert docs["max_total_tokens"].flags == ("--max-model-len", "--max-total-tokens")
    row = next(line for line in PAGE_TEXT.splitlines() if line.startswith("| `port`"))
    assert "`SAGEMAKER_BIND_TO_PORT`, `AIP_HTTP_PORT`" in row and "| `8080` |" in row
    # the two old tables disagreed; the code decides: 431 in the protocol's shape, and int4 exists
    assert "get 431 in the protocol's shape" in PAGE_TEXT and "`int4`" in PAGE_TEXT
    assert "| `metrics_port`" in PAGE_TEXT and "| `drain_timeout`" in PAGE_TEXT


def test_the_generated_examples_are_what_the_server_prints() -> None:
    assert (
        "lmiserve: configuration error: unknown option 'max_rolling_batch_sise' "
        "(did you mean 'max_rolling_batch_size'?)"
    ) in PAGE_TEXT
    assert (
        "lmiserve: configuration error: invalid value 'fp64' for option 'dtype': "
        "expected one of auto, fp32, fp16, bf16, int8, int4 (from command line --dtype)"
    ) in PAGE_TEXT


@pytest.mark.parametrize(
    "key", ["port", "predict_timeout", "api_key", "batch_size", "max_rolling_batch_size", "max_total_tokens"]
)
def test_environment_variables_are_listed_winner_first(key: str) -> None:
    """The page's Environment cell is in precedence order: set them all, the first listed wins; drop
    it, the next one wins, and so on."""
    names = environment_names(key)
    assert names[:2] == [f"OPTION_{key.upper()}", f"SERVING_{key.upper()}"]
    values = {name: str(100 + i) for i, name in enumerate(names)}
    for i, name in enumerate(names):
        env = {n: values[n] for n in names[i:]}
        settings = load_settings({}, environ=env)
        assert str(getattr(settings, key)).removesuffix(".0") == values[name], (key, name)
        assert settings.sources[key] == f"environment {name}"


def test_aliases_are_listed_and_work() -> None:
    for alias, key in KEY_ALIASES.items():
        assert f"`{alias}`" in PAGE_TEXT
        # tensor_parallel_size=7: seven ranks (the model and the devices are checked at load); a word for a word
        value = {"quantize": "awq"}.get(key, "7")
        assert str(getattr(load_settings({alias: value}, environ={}), key)) == value


def test_every_flag_in_the_table_is_a_flag_of_serve() -> None:
    from lmiserve.cli import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    known = {name for action in serve._actions for name in action.option_strings}
    for flag in SETTING_FLAGS:
        for name in flag.names:
            assert name in known and f"`{name}`" in PAGE_TEXT


def test_search_matches_keys_descriptions_variables_and_flags() -> None:
    docs = option_docs()
    assert [d.key for d in search(docs, "HF_MODEL_ID")] == ["model_id"]
    assert [d.key for d in search(docs, "--max-num-seqs")] == ["max_rolling_batch_size"]
    batch = [d.key for d in search(docs, "BATCH")]
    assert "max_rolling_batch_size" in batch and "batch_size" in batch and "host" not in batch
    assert search(docs, "no-such-word") == []


def test_text_table_has_every_key_on_its_own_line_within_the_width() -> None:
    text = render_text(width=100)
    lines = text.splitlines()
    assert lines[0].split() == ["KEY", "DEFAULT", "MEANING"]
    titles = {f"{title}:" for title, _, _ in GROUPS}
    assert titles <= set(lines)
    starts = [line.split()[0] for line in lines[1:] if line and not line[0].isspace() and line not in titles]
    assert starts == [key for _, _, keys in GROUPS for key in keys]
    assert max(len(line) for line in lines) <= 100
    model_id = next(line for line in lines if line.startswith("model_id "))
    assert model_id.split()[1] == "unset"
