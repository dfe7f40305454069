"""Tool-call parsers, one per model family's format, by vLLM's ``--tool-call-parser`` names (LMI's
``option.tool_call_parser``); `auto` picks one from the chat template (`detect`).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2 Pro, Qwen2.5, Qwen3);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>``;
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3; after ``<|python_tag|>`` too);
- ``pythonic``: ``[f(a=1), g(b="x")]``; ``llama4_pythonic``: the same in ``<|python_start|>…<|python_end|>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` and ``[TOOL_CALLS]NAME[ARGS]{...}``;
- ``deepseek_v3``: DeepSeek V3's ``tool▁calls▁begin`` / ``tool▁call▁begin`` / ``tool▁sep`` markers, the
  arguments in a json code block (V3) or bare (V3.1);
- ``granite``: ``<|tool_call|>[{"name": ..., "arguments": {...}}]``;
- ``openai``: gpt-oss's harmony channels (``<|channel|>commentary to=functions.NAME …<|message|>{...}<|call|>``);
- ``json``: lmiserve's own ``{"name": ..., "parameters": {...}}`` for templates with no tool format, its
  ``required`` and named calls under a JSON-schema grammar (`lmiserve.protocols.textgen.tools.schema`).
"""

from __future__ import annotations

import importlib
import logging
import weakref
from typing import Any

from lmiserve.protocols.textgen.tools.parsers.base import (
    CallReader,
    Literal_,
    Parsed,
    PartialCall,
    ToolParser,
    text_literal,
)

__all__ = [
    "NAMES",
    "CallReader",
    "Parsed",
    "PartialCall",
    "ToolParser",
    "detect",
    "for_tokenizer",
    "text_literal",
    "tool_parser",
]
log = logging.getLogger(__name__)

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
    parser: type[ToolParser] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    return parser()


def detect(template: str | None) -> str:
    """The parser whose markers the chat template's source shows (``json`` when none does)."""
    for name in _PARSERS:
        if name != "json" and any(marker in (template or "") for marker in tool_parser(name).template_markers):
            return name
    return "json"


def template_source(tokenizer: Any) -> str:
    """The chat template's Jinja source (all of them, for a tokenizer with named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return str(template or "")


def token_literal(tokenizer: Any) -> Literal_:
    """`ToolParser.lit` for `tokenizer`: a marker that is one added token (a special one, such as
    ``[TOOL_CALLS]``, or not, such as Qwen's ``<tool_call>``) is matched as that token, anything else as
    text."""
    added: dict[str, int] = dict(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else {}

    def lit(text: str) -> str:
        token = added.get(text)
        return f"<[{token}]>" if token is not None else text_literal(text)

    return lit


_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, dict[str, ToolParser]] = weakref.WeakKeyDictionary()


def for_tokenizer(setting: str, tokenizer: Any, model: str = "") -> ToolParser:
    """The parser a model's answers are read with: the `tool_call_parser` setting, or with ``auto`` the one
    its chat template's markers show (``json`` when none); logged once per tokenizer."""
    try:
        known = _BY_TOKENIZER.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: resolved each time
        known = {}
    if setting in known:
        return known[setting]
    name = detect(template_source(tokenizer)) if setting == "auto" else setting
    parser = known[setting] = tool_parser(name)
    parser.lit = token_literal(tokenizer)
    how = "picked from the chat template's markers" if setting == "auto" else "the tool_call_parser setting"
    log.info("tool calls of %s are read as %s (%s)", model or "the model", name, how)
    return parser
