"""The adapters named at start: vLLM's `lora_modules` and TGI's `lora_adapters` (`LORA_ADAPTERS`).

`lora_modules` takes vLLM's forms: ``name=path`` items separated by spaces or commas, JSON objects
``{"name": ..., "path": ...}`` (one, several separated by spaces, or a JSON list of them).
`lora_adapters` takes TGI's: comma-separated ``name=path`` or bare ``path`` items (the adapter is then
named after the folder). Both give ``(name, path)`` pairs; an adapter named twice is an error.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePath
from typing import Any

__all__ = ["parse_lora_adapters", "parse_lora_modules"]

_JSON_ITEM = re.compile(r"\{[^{}]*\}")


def _pair(name: Any, path: Any, where: str) -> tuple[str, str]:
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where}: an adapter needs a name and a path")
    return name.strip(), path.strip()


def _from_object(item: Any, where: str) -> tuple[str, str]:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected objects with `name` and `path`, got {json.dumps(item)[:60]}")
    unknown = set(item) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (name, path, base_model_name)")
    return _pair(item.get("name"), item.get("path"), where)


def _unique(pairs: list[tuple[str, str]], where: str) -> list[tuple[str, str]]:
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise ValueError(f"{where}: adapter {name!r} is named twice")
        seen.add(name)
    return pairs


def parse_lora_modules(text: str) -> list[tuple[str, str]]:
    """vLLM's `--lora-modules` value as ``(name, path)`` pairs (ValueError names what is wrong)."""
    text = text.strip()
    where = "lora_modules"
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(items, list):
            raise ValueError(f"{where}: expected a JSON list")
        return _unique([_from_object(item, where) for item in items], where)
    pairs: list[tuple[str, str]] = []
    rest = text
    for match in _JSON_ITEM.finditer(text):
        try:
            pairs.append(_from_object(json.loads(match.group()), where))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        rest = rest.replace(match.group(), " ")
    for item in re.split(r"[\s,]+", rest.strip()):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"{where}: {item!r} is not name=path")
        pairs.append(_pair(name, path, where))
    return _unique(pairs, where)


def parse_lora_adapters(text: str) -> list[tuple[str, str]]:
    """TGI's `--lora-adapters` value as ``(name, path)`` pairs: ``name=path`` or ``path`` (named after its
    folder)."""
    where = "lora_adapters"
    pairs = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep:
            name, path = PurePath(item.rstrip("/")).name, item
        pairs.append(_pair(name, path, where))
    return _unique(pairs, where)
