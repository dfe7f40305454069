"""Tool-call parsers, one per model family's format, by vLLM's ``--tool-call-parser`` names (LMI's
``option.tool_call_parser``); `auto` picks one from the chat template (`detect`).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2 Pro, Qwen2.5, Qwen3);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>``;
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3; after ``<|python_tag|>`` too);
- ``pythonic``: ``[f(a=1), g(b="x")]``; ``llama4_pythonic``: the same in ``<|python_start|>…<|python_end|>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` and ``[TOOL_CALLS]NAME[ARGS]{...}``;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json …```…``;
- ``granite``: ``<|tool_call|>[{"name": ..., "arguments": {...}}]``;
- ``openai``: gpt-oss's harmony channels (``<|channel|>commentary to=functions.NAME …<|message|>{...}<|call|>``);
- ``json``: lmiserve's own ``{"name": ..., "parameters": {...}}`` for templates with no tool format, its
  ``required`` and named calls under a JSON-schema grammar (`lmiserve.protocols.textgen.tools.schema`).
"""

from __future__ import annotations

import importlib
from typing import Any

from lmiserve.protocols.textgen.tools.parsers.base import CallReader, Parsed, PartialCall, ToolParser, text_literal

__all__ = ["CallReader", "NAMES", "Parsed", "PartialCall", "ToolParser", "detect", "tool_parser", "text_literal"]

# name -> (module, class); `auto` tries them in this order (the more specific markers first)
_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderParser"),
    "hermes": ("hermes", "HermesParser"),
    "llama4_pythonic": ("pythonic", "Llama4PythonicParser"),
    "llama3_json": ("llama", "Llama3JsonParser"),
    "mistral": ("mistral", "MistralParser"),
    "deepseek_v3": ("deepseek", "DeepSeekV3Parser"),
    "granite": ("granite", "GraniteParser"),
    "openai": ("harmony", "HarmonyParser"),
    "pythonic": ("pythonic", "PythonicParser"),
    "json": ("json_calls", "JsonParser"),
}
NAMES = (*_PARSERS, "auto")


def tool_parser(name: str) -> ToolParser:
    """The parser named `name` (one of `NAMES` but ``auto``)."""
    module, cls = _PARSERS[name]
    parser: Any = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    return parser()  # type: ignore[no-any-return]


def detect(template: str | None) -> str:
    """The parser whose markers the chat template's source shows (``json`` when none does)."""
    for name in _PARSERS:
        if name != "json" and any(marker in (template or "") for marker in tool_parser(name).template_markers):
            return name
    return "json"
