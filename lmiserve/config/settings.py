"""Typed server settings: every key with its default, meaning and validation.

Build a ``Settings`` from string options (properties file, environment, ``-o key=value``) with
``Settings.from_options``: it coerces strings, keeps unknown keys in ``extra`` (with one warning line
naming them all) and turns every validation failure into a ``ConfigError`` naming the key, the value
and what is allowed.
``lmiserve.config.sources.load_settings`` merges the sources and calls it.

The keys live in field groups, one concern each: settings_model.py (the model, its loading and kind),
settings_parallel.py (tensor parallelism, speculative decoding, LoRA), settings_engine.py (batching and
the engine's caches), settings_server.py (listening, logs, security, management), settings_routes.py
(the protocols' output and limits); settings_checks.py checks them across groups, settings_types.py
holds their value types and spellings.py the other spellings of keys and words.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping

from pydantic import ValidationError

from lmiserve.config.errors import ConfigError
from lmiserve.config.messages import describe_errors
from lmiserve.config.settings_checks import CheckedSettings
from lmiserve.config.settings_types import (
    REASONING_EFFORTS,
    REASONING_PRESETS,
    Dtype,
    KvCacheLayout,
    LoadFormat,
    LogFormat,
    LogLevel,
    ModelKind,
    OtlpProtocol,
    OutputFormatter,
    ReasoningParser,
    RollingBatch,
    ToolCallParser,
    parse_effort_budgets,
)
from lmiserve.config.spellings import (
    KEY_ALIASES,
    LMI_ENGINE_NAMES,
    LMI_IGNORED_KEYS,
    LMI_SPECULATIVE_LENGTH,
    canonical_key,
)

# names other modules import from here (their homes are the modules above)
__all__ = [
    "KEY_ALIASES",
    "LMI_ENGINE_NAMES",
    "LMI_IGNORED_KEYS",
    "LMI_SPECULATIVE_LENGTH",
    "REASONING_EFFORTS",
    "REASONING_PRESETS",
    "Dtype",
    "KvCacheLayout",
    "LoadFormat",
    "LogFormat",
    "LogLevel",
    "ModelKind",
    "OtlpProtocol",
    "OutputFormatter",
    "ReasoningParser",
    "RollingBatch",
    "Settings",
    "ToolCallParser",
    "canonical_key",
    "close_key",
    "parse_effort_budgets",
    "unknown_key_note",
    "unknown_option_error",
    "unknown_options_warning",
]

logger = logging.getLogger(__name__)

_META_FIELDS = frozenset({"extra", "sources"})


class Settings(CheckedSettings):
    """Effective server configuration. Build it with ``from_options`` or ``load_settings``."""

    # ------------------------------------------------------------------ construction

    @classmethod
    def option_keys(cls) -> list[str]:
        """The configuration keys: every field except the bookkeeping ``extra`` and ``sources``."""
        return [name for name in cls.model_fields if name not in _META_FIELDS]

    @classmethod
    def from_options(cls, options: Mapping[str, object], sources: Mapping[str, str] | None = None) -> Settings:
        """Validate string (or typed) options; raise ``ConfigError`` on any bad value.

        Keys may carry ``option.`` or be LMI aliases. An empty value means "use the default".
        Unknown keys go to ``extra`` with a warning. ``sources`` maps keys to where they came from.
        """
        known = set(cls.option_keys())
        where = {canonical_key(key): source for key, source in (sources or {}).items()}
        values: dict[str, object] = {}
        extra: dict[str, str] = {}
        for raw_key, value in options.items():
            key = canonical_key(raw_key)
            if key not in known:
                extra[key] = str(value)
            elif value is None or (isinstance(value, str) and not value.strip()):
                values.pop(key, None)
            else:
                values[key] = value.strip() if isinstance(value, str) else value
        if extra:
            logger.warning(unknown_options_warning(extra, where))
        used = {key: where[key] for key in [*values, *extra] if key in where}
        try:
            return cls.model_validate({**values, "extra": extra, "sources": used})
        except ValidationError as exc:
            raise ConfigError(describe_errors(exc.errors(), cls.model_fields, where)) from None

    # ------------------------------------------------------------------ the start-up log

    def summary(self) -> list[str]:
        """``key=value (from <source>)`` or ``key=value (default)`` per key: the start-up log at debug level."""
        lines = []
        for key in self.option_keys():
            source = self.sources.get(key)
            origin = f"from {source}" if source else "default"
            lines.append(f"{key}={self._shown(key)} ({origin})")
        for key, value in self.extra.items():
            lines.append(f"{key}={value} (ignored{_from(self.sources.get(key))})")
        return lines

    def changed(self) -> list[str]:
        """``key=value (<source>)`` for every key whose value is not its default: the start-up log."""
        lines = []
        for key in self.option_keys():
            field = type(self).model_fields[key]
            if getattr(self, key) == field.get_default(call_default_factory=True):
                continue
            lines.append(f"{key}={self._shown(key)} ({self.sources.get(key, 'set')})")
        return lines

    def _shown(self, key: str) -> object:
        return "<hidden>" if key == "api_key" and self.api_key else getattr(self, key)


# ---------------------------------------------------------------------------------------------- unknown keys


def close_key(key: str) -> str | None:
    """The valid key or alias ``key`` was probably meant to be (``max_rolling_batch_sise`` ->
    ``max_rolling_batch_size``, ``max-new-tokens`` -> ``max_new_tokens``), or None."""
    valid = [*Settings.option_keys(), *KEY_ALIASES]
    word = key.strip().lower().replace("-", "_")
    if word in valid:
        return word
    matches = difflib.get_close_matches(word, valid, n=1, cutoff=0.75)
    return matches[0] if matches else None


def unknown_key_note(key: str) -> str:
    """Why ``key`` is not used: an LMI key lmiserve ignores, or a did-you-mean, or nothing."""
    if key in LMI_IGNORED_KEYS:
        return "an LMI option lmiserve does not use"
    suggestion = close_key(key)
    return f"did you mean {suggestion!r}?" if suggestion else ""


def unknown_option_error(keys: Iterable[str], source: str = "") -> str:
    """The error of unknown command-line keys: ``unknown option 'x' (did you mean 'y'?)``, one per key."""
    parts = []
    for key in keys:
        note = unknown_key_note(key)
        if key in LMI_IGNORED_KEYS:
            note += "; it is ignored in serving.properties and OPTION_* variables, not accepted here"
        elif not note:
            note = "`lmiserve options` lists every option"
        parts.append(f"unknown option {key!r}{source} ({note})")
    return "; ".join(parts)


def unknown_options_warning(extra: Mapping[str, str], where: Mapping[str, str]) -> str:
    """One line naming every unknown key, where it came from, and what it may have meant."""
    parts = []
    for key in extra:
        notes = [note for note in (unknown_key_note(key), _from(where.get(key)).strip()) if note]
        parts.append(f"{key!r} ({'; '.join(notes)})" if notes else repr(key))
    if len(parts) == 1:
        return f"ignoring unknown option {parts[0]}"
    return f"ignoring {len(parts)} unknown options: {', '.join(parts)}"


def _from(source: str | None) -> str:
    return f" from {source}" if source else ""
