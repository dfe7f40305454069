"""Request fields the OpenAI routes accept and ignore, named in the answer's `warnings` header (or refused
with a 400 under `strict_openai_fields`) rather than only logged.

A field is *ignored* when the request gives it a value and the server does nothing with it:

- a key the request schema does not know (OpenAI's `store`, `metadata`, `service_tier`, `prediction`,
  `audio`, `modalities`, `functions`, ... or any other), and a key of `stream_options` other than
  `include_usage` (named ``stream_options.KEY``);
- a known field that is accepted and not used: `user`; chat's `top_logprobs` without `logprobs: true`.

Not named: a ``null`` value (absent, as OpenAI reads it), and the values in `NO_OP` (OpenAI's own
defaults, which ask for what the server does anyway: ``"store": false``, ...).

The header holds one warning value in the form of HTTP's `Warning` header (RFC 7234: code 299, no agent,
a quoted text)::

    warnings: 299 - "ignored fields: metadata, user"

Each name is cut at 40 characters and escaped as a JSON string is (non-ASCII, quotes and control
characters); at most 20 names, then ``and N more``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

HEADER = "warnings"
WARN_CODE = "299"  # RFC 7234's "Miscellaneous persistent warning"
NAME_LIMIT = 40  # characters of each name in the header
SHOWN = 20  # names in the header, then "and N more"

# Values of fields the schema does not know that ask for what the server does anyway (OpenAI's defaults).
NO_OP: dict[str, tuple[Any, ...]] = {
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "stream_options.include_obfuscation": (False,),  # OpenAI's stream padding (true is its default)
    "stream_options.continuous_usage_stats": (False,),  # vLLM's usage in every chunk
}
STREAM_OPTIONS = frozenset({"include_usage"})  # the keys of `stream_options` the routes read


def _asks(name: str, value: Any) -> bool:
    """Whether an unknown key `name` given `value` asks for something (not null, not a no-op value)."""
    return value is not None and not any(value == v and type(value) is type(v) for v in NO_OP.get(name, ()))


def unknown_fields(data: Mapping[Any, Any], known: Iterable[str]) -> list[str]:
    """The keys of a request body (`data`) outside `known` that ask for something, in the body's order,
    with the unknown keys of its `stream_options` object as ``stream_options.KEY``."""
    known = set(known)
    names: list[str] = []
    for name, value in data.items():
        if not isinstance(name, str):
            continue
        if name not in known and _asks(name, value):
            names.append(name)
        elif name == "stream_options" and isinstance(value, Mapping):
            names.extend(
                f"stream_options.{key}"
                for key, option in value.items()
                if isinstance(key, str) and key not in STREAM_OPTIONS and _asks(f"stream_options.{key}", option)
            )
    return names


def _shown(name: str) -> str:
    cut = name if len(name) <= NAME_LIMIT else name[:NAME_LIMIT] + "..."
    return json.dumps(cut, ensure_ascii=True)[1:-1]  # ASCII; quotes, backslashes, controls escaped


def warning(names: list[str]) -> str:
    """The `warnings` header's value naming the ignored fields `names` (not empty)."""
    listed = ", ".join(_shown(name) for name in names[:SHOWN])
    if len(names) > SHOWN:
        listed += f" and {len(names) - SHOWN} more"
    return f'{WARN_CODE} - "ignored fields: {listed}"'


def headers(names: list[str]) -> dict[str, str]:
    """The `warnings` header when any field was ignored, else none."""
    return {HEADER: warning(names)} if names else {}
