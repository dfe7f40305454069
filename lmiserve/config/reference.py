"""The configuration reference, generated from the code: docs/configuration.md and `lmiserve options`.

Everything about a setting comes from where the code defines it: its description, default, type and
bounds from ``Settings.model_fields`` (settings.py), its environment variables from sources.py, its
aliases from ``KEY_ALIASES``, its flags from flags.py. The page's prose (how the sources merge) and the
groups of its settings tables live in reference_text.py (``INTRO``, the section texts, ``GROUPS``), never
in the page itself. Regenerate the page with

    python scripts/gen_config_reference.py        (or: python -m lmiserve.config.reference)

and check it is current with ``--check`` (tests/unit/test_config_reference.py does).
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmiserve.config.errors import ConfigError
from lmiserve.config.flags import SETTING_FLAGS, flags_of
from lmiserve.config.messages import allowed_values, default_text, plain_text, unwrap_optional
from lmiserve.config.reference_text import ENVIRONMENT, EXAMPLES, FLAGS, GROUPS, INTRO, STARTUP, UNKNOWN_KEYS
from lmiserve.config.settings import Settings, unknown_options_warning
from lmiserve.config.sources import ENV_SHORTCUTS, environment_names, load_settings
from lmiserve.config.spellings import KEY_ALIASES, LMI_IGNORED_KEYS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python scripts/gen_config_reference.py"


@dataclass(frozen=True)
class OptionDoc:
    """One setting as the reference shows it."""

    key: str
    group: str
    description: str  # with `code` in backticks
    default: str
    values: str
    environment: tuple[str, ...]
    aliases: tuple[str, ...]
    flags: tuple[str, ...]

    def text(self) -> str:
        """Everything searchable about the setting, as plain text."""
        return " ".join([self.key, plain_text(self.description), *self.environment, *self.aliases, *self.flags])


def group_of(key: str) -> str:
    """The title of the group ``key`` is in."""
    for title, _, keys in GROUPS:
        if key in keys:
            return title
    raise KeyError(f"setting {key!r} is in no group of lmiserve.config.reference_text.GROUPS: add it to one")


def option_docs() -> list[OptionDoc]:
    """Every setting, in ``GROUPS`` order; raises if a setting is in no group or in two."""
    grouped = [key for _, _, keys in GROUPS for key in keys]
    options = Settings.option_keys()
    missing = sorted(set(options) - set(grouped))
    twice = sorted({key for key in grouped if grouped.count(key) > 1})
    stale = sorted(set(grouped) - set(options))
    if missing or twice or stale:
        raise ValueError(
            "lmiserve.config.reference_text.GROUPS must list every setting once: "
            f"missing {missing}, listed twice {twice}, not settings {stale}"
        )
    docs = []
    for title, _, keys in GROUPS:
        for key in keys:
            field = Settings.model_fields[key]
            docs.append(
                OptionDoc(
                    key=key,
                    group=title,
                    description=field.description or "",
                    default=default_text(field),
                    values=allowed_values(field),
                    environment=tuple(environment_names(key)),
                    aliases=tuple(alias for alias, target in KEY_ALIASES.items() if target == key),
                    flags=tuple(flags_of(key)),
                )
            )
    return docs


def search(docs: Sequence[OptionDoc], word: str) -> list[OptionDoc]:
    """The settings whose key, description, variables, aliases or flags contain ``word`` (any case)."""
    needle = word.lower()
    return [doc for doc in docs if needle in doc.text().lower()]


# ---------------------------------------------------------------------------------------------- Markdown


def render_markdown(docs: Sequence[OptionDoc] | None = None, page: bool = True) -> str:
    """The whole page, with ``docs``' settings only if given; ``page=False``: only the settings' tables."""
    shown = option_docs() if docs is None else list(docs)
    if not page:
        return "\n\n".join(_settings_sections(shown)) + "\n"
    parts = [
        "# Configuration",
        f"<!-- Generated from lmiserve/config by `{REGENERATE}`: edit the code, not this page. -->",
        INTRO.format(bad_value=_example_bad_value()),
        "## Unknown keys",
        UNKNOWN_KEYS.format(
            unknown_cli=_example_unknown_cli(),
            unknown_files=_example_unknown_files(),
            lmi_keys=", ".join(f"`{key}`" for key in sorted(LMI_IGNORED_KEYS, key=str.lower)),
        ),
        "## Environment variables",
        ENVIRONMENT.format(shortcuts=_shortcut_table(), shortcut_order=_shortcut_order()),
        "## Command-line flags",
        FLAGS.format(flags=_flag_table()),
        "## Start-up log",
        STARTUP,
        "## Settings",
        "Default *unset* means the setting has no value; its description says what applies then.",
        *_settings_sections(shown),
        "## Example files",
        EXAMPLES,
    ]
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"


def _settings_sections(docs: Sequence[OptionDoc]) -> list[str]:
    parts = []
    for title, about, _ in GROUPS:
        rows = [doc for doc in docs if doc.group == title]
        if rows:
            parts += [f"### {title}", _md(about), _settings_table(rows)]
    return parts


def _settings_table(rows: Sequence[OptionDoc]) -> str:
    lines = ["| Key | Default | Environment | Meaning |", "|---|---|---|---|"]
    for doc in rows:
        names = [f"`{doc.key}`"]
        extras = []
        if doc.flags:
            extras.append(("flags " if len(doc.flags) > 1 else "flag ") + ", ".join(f"`{f}`" for f in doc.flags))
        if doc.aliases:
            extras.append(("aliases " if len(doc.aliases) > 1 else "alias ") + ", ".join(f"`{a}`" for a in doc.aliases))
        key_cell = names[0] + (f" ({'; '.join(extras)})" if extras else "")
        meaning = _md(doc.description)
        if not doc.values.startswith("a string"):
            meaning += f" Values: {_md(doc.values)}."
        env = ", ".join(f"`{name}`" for name in doc.environment)
        lines.append(f"| {key_cell} | {_md_default(doc.default)} | {env} | {meaning} |")
    return "\n".join(lines)


def _shortcut_table() -> str:
    lines = ["| Variable | Key |", "|---|---|"]
    lines += [f"| `{var}` | `{key}` |" for var, key in ENV_SHORTCUTS]
    return "\n".join(lines)


def _shortcut_order() -> str:
    """``PREDICT_TIMEOUT` before `SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS`` for keys with several shortcuts."""
    by_key: dict[str, list[str]] = {}
    for var, key in reversed(ENV_SHORTCUTS):
        by_key.setdefault(key, []).append(var)
    orders = [" before ".join(f"`{var}`" for var in names) for names in by_key.values() if len(names) > 1]
    return "; ".join(orders)


def _flag_table() -> str:
    lines = ["| Flag | Key | Default |", "|---|---|---|"]
    for flag in SETTING_FLAGS:
        field = Settings.model_fields[flag.key]
        names = ", ".join(f"`{name}`" for name in flag.names)
        if unwrap_optional(field.annotation)[0] is bool:  # a switch (flags.py `_Switch`)
            names += ", " + ", ".join(f"`--no-{name[2:]}`" for name in flag.names)
        key = f"[`{flag.key}`](#{_anchor(group_of(flag.key))})"
        lines.append(f"| {names} | {key} | {_md_default(default_text(field))} |")
    return "\n".join(lines)


def _md_default(default: str) -> str:
    return "*unset*" if default == "unset" else f"`{default}`"


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _md(text: str) -> str:
    """Plain text with `code` spans as Markdown: outside the spans, what Markdown would read as markup
    (``<tag>``, ``*``, ``_``, a table's ``|``) is escaped."""
    pieces = _CODE_SPAN.split(text)
    for i in range(0, len(pieces), 2):
        piece = html.escape(pieces[i], quote=False).replace("&gt;", ">")
        pieces[i] = piece.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")
    return "".join(pieces)


def _example_bad_value() -> str:
    try:
        load_settings({"dtype": "fp64"}, environ={}, cli_sources={"dtype": "command line --dtype"})
    except ConfigError as exc:
        return f"lmiserve: configuration error: {exc}"
    raise AssertionError("dtype=fp64 was accepted")


def _example_unknown_cli() -> str:
    try:
        load_settings({"max_rolling_batch_sise": "64"}, environ={})
    except ConfigError as exc:
        return f"$ lmiserve serve -o max_rolling_batch_sise=64\nlmiserve: configuration error: {exc}"
    raise AssertionError("an unknown key was accepted")


def _example_unknown_files() -> str:
    where = {
        "engine": "properties file /opt/ml/model/serving.properties",
        "mpi_mode": "properties file /opt/ml/model/serving.properties",
        "max_new_token": "environment OPTION_MAX_NEW_TOKEN",
    }
    line = unknown_options_warning(dict.fromkeys(where, ""), where)
    return f"WARNING lmiserve.config.settings: {line}"


# ---------------------------------------------------------------------------------------------- text


def render_text(docs: Sequence[OptionDoc] | None = None, width: int = 100) -> str:
    """A plain-text table: KEY, DEFAULT, MEANING (wrapped), the settings under their group titles."""
    shown = option_docs() if docs is None else list(docs)
    key_width = max([len("KEY"), *(len(doc.key) for doc in shown)]) + 2
    default_width = min(max([len("DEFAULT"), *(len(doc.default) for doc in shown)]), 14) + 2
    indent = key_width + default_width
    wrap = max(width - indent, 30)
    lines = [f"{'KEY':<{key_width}}{'DEFAULT':<{default_width}}MEANING"]
    for title, _, _ in GROUPS:
        rows = [doc for doc in shown if doc.group == title]
        if not rows:
            continue
        lines += ["", f"{title}:"]
        for doc in rows:
            meaning = re.sub(r"([<>]=?) ", "\\1\0", _text_meaning(doc))  # keep ">= 1" on one line
            wrapped = [line.replace("\0", " ") for line in textwrap.wrap(meaning, wrap, break_on_hyphens=False)]
            wrapped = wrapped or [""]
            default = doc.default if len(doc.default) < default_width else doc.default + "\n" + " " * indent
            lines.append(f"{doc.key:<{key_width}}{default:<{default_width}}{wrapped[0]}")
            lines += [" " * indent + line for line in wrapped[1:]]
    return "\n".join(lines) + "\n"


def _text_meaning(doc: OptionDoc) -> str:
    parts = [plain_text(doc.description)]
    if not doc.values.startswith("a string"):
        parts.append(f"Values: {doc.values}.")
    if doc.aliases:
        parts.append(f"{'Aliases' if len(doc.aliases) > 1 else 'Alias'}: {', '.join(doc.aliases)}.")
    if doc.flags:
        parts.append(f"{'Flags' if len(doc.flags) > 1 else 'Flag'}: {', '.join(doc.flags)}.")
    shortcuts = [name for name in doc.environment if not name.startswith("SERVING_") and name != doc.environment[0]]
    parts.append(f"Env: {', '.join([doc.environment[0], *shortcuts])}.")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------- command


def main(argv: Sequence[str] | None = None) -> int:
    """Write docs/configuration.md (or ``--output``); ``--check`` only compares and fails if it differs."""
    parser = argparse.ArgumentParser(prog="gen_config_reference", description=main.__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not what the code generates")
    parser.add_argument("--output", type=Path, default=PAGE, help=f"the page to write (default {PAGE})")
    args = parser.parse_args(argv)
    page = render_markdown()
    path: Path = args.output
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current != page:
            print(f"{path} is out of date: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    path.write_text(page, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
