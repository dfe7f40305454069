"""Settings fields in words: what a field accepts (``allowed_values``), its default (``default_text``),
its description as plain text (``plain_text``); and pydantic validation errors on settings turned into
one readable ``ConfigError`` message (``describe_errors``)."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails


def allowed_values(field: FieldInfo) -> str:
    """What a field accepts, e.g. ``one of auto, fp32, fp16, bf16`` or ``an integer >= 1``.

    A field may state it itself with ``json_schema_extra={"allowed": "..."}``.
    """
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "allowed" in extra:
        return str(extra["allowed"])
    base, optional = unwrap_optional(field.annotation)
    if typing.get_origin(base) is Literal:
        text = "one of " + ", ".join(str(arg) for arg in typing.get_args(base))
    elif base is bool:
        text = "true or false"
    elif base is int:
        text = "an integer" + _bounds(field.metadata)
    elif base is float:
        text = "a number" + _bounds(field.metadata)
    else:
        text = "a string"
    return text + (" (or empty for unset)" if optional else "")


def default_text(field: FieldInfo) -> str:
    """The default as a user writes it: ``unset``, ``true``, ``512MiB``, ``120``, ``0.0.0.0``."""
    default = field.get_default(call_default_factory=True)
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, ByteSize):
        return _size(int(default))
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def plain_text(description: str) -> str:
    """A description (whose code is in backticks, for the Markdown reference) as plain text."""
    return description.replace("`", "")


def describe_errors(errors: list[ErrorDetails], fields: Mapping[str, FieldInfo], where: Mapping[str, str]) -> str:
    """One line per error: ``invalid value 'fp64' for option 'dtype': expected one of ...``."""
    return "\n".join(_describe(error, fields, where) for error in errors)


def _describe(error: ErrorDetails, fields: Mapping[str, FieldInfo], where: Mapping[str, str]) -> str:
    loc = error.get("loc") or ()
    key = str(loc[0]) if loc else ""
    if key not in fields:  # a cross-field check raised ValueError(message)
        cause = error.get("ctx", {}).get("error")
        return f"invalid configuration: {cause if cause is not None else error['msg']}"
    suffix = f" (from {where[key]})" if key in where else ""
    base, _ = unwrap_optional(fields[key].annotation)
    if isinstance(base, type) and issubclass(base, BaseModel):  # an object option: what in it is wrong
        inner = ".".join(str(part) for part in loc[1:])
        message = str(error["msg"]).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "unknown key"
        detail = f"{inner}: {message}" if inner else message
        return f"invalid value {error.get('input')!r} for option {key!r}: {detail}{suffix}"
    expected = allowed_values(fields[key])
    return f"invalid value {error.get('input')!r} for option {key!r}: expected {expected}{suffix}"


def unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    args = typing.get_args(annotation)
    if type(None) not in args:
        return annotation, False
    rest = [arg for arg in args if arg is not type(None)]
    return (rest[0] if len(rest) == 1 else annotation), True


def _bounds(metadata: list[Any]) -> str:
    low = next((f">= {m.ge}" for m in metadata if isinstance(m, annotated_types.Ge)), None)
    low = low or next((f"> {m.gt}" for m in metadata if isinstance(m, annotated_types.Gt)), None)
    high = next((m.le for m in metadata if isinstance(m, annotated_types.Le)), None)
    if high is not None and low is not None and low.startswith(">= "):
        return f" from {low[3:]} to {high}"
    parts = [part for part in (low, None if high is None else f"<= {high}") if part]
    return (" " + " and ".join(parts)) if parts else ""


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)
