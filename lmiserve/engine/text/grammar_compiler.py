"""Grammars compiled for one tokenizer (llguidance), and the per-sequence matcher that follows one.

`GrammarCompiler.compile` turns a protocol-neutral `Grammar` into a `CompiledGrammar` (cached by
grammar, in a compiler that belongs to one tokenizer: the cache key is (tokenizer, grammar)) or raises
`InvalidRequest` with the library's reason (a malformed schema, an invalid regex). `compile_async`
does it on the compiler's own thread, never the engine's or the torch thread's, so compiling never
stalls running streams. Each sequence gets its own `GrammarMatcher` (a copy of the compiled one).

Why llguidance: benchmarks/README.md ("structured output libraries") has the measurements.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.grammar import Grammar

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase

# JSON is generated compact (`{"a":1,"b":[2,3]}`): flexible whitespace lets a weak model loop on
# newlines until max_new_tokens.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")
CACHE_SIZE = 256  # compiled grammars kept per tokenizer (least recently used dropped)


class GrammarMatcher:
    """The state of one sequence in its grammar. Pure Python over llguidance (no torch)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill_mask(self, data_ptr: int, nbytes: int) -> None:
        """Write the allowed next tokens as a bitmask (bit i of the int32 words = token i) at `data_ptr`."""
        self._m.unsafe_compute_mask_ptr(data_ptr, nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher is then stuck)."""
        return bool(self._m.consume_token(token_id))

    @property
    def is_complete(self) -> bool:
        """The text so far is a whole match: ending here (EOS) is allowed."""
        return bool(self._m.is_accepting())

    @property
    def is_stopped(self) -> bool:
        """Nothing can follow (the match is complete and cannot be extended, or EOS was accepted)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error()) if self._m.is_error() else ""


class CompiledGrammar:
    """A grammar compiled for one tokenizer; `matcher()` starts a sequence in it."""

    def __init__(self, grammar: Grammar, template: llguidance.LLMatcher) -> None:
        self.grammar = grammar
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles grammars for one tokenizer; the llguidance tokenizer is built on first use (~0.5 s
    for a 50k vocabulary), so a server whose requests never carry a grammar never pays for it."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, *, vocab_size: int, eos_token_ids: Iterable[int]):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(i for i in eos_token_ids if 0 <= i < vocab_size)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Grammar, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    # ---- compiling -------------------------------------------------------------------------------
    def cached(self, grammar: Grammar) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
            return compiled

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """The compiled grammar (cached); `InvalidRequest` when the library rejects it."""
        compiled = self.cached(grammar)
        if compiled is not None:
            return compiled
        import llguidance

        source = _source(grammar)
        template = llguidance.LLMatcher(self._llg_tokenizer(), source, log_level=0)
        if template.is_error():
            raise InvalidRequest(f"invalid {_what(grammar)}: {_first_line(template.get_error())}")
        compiled = CompiledGrammar(grammar, template)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    async def compile_async(self, grammar: Grammar) -> CompiledGrammar:
        """`compile` on the compiler's own thread (a cache hit answers at once)."""
        compiled = self.cached(grammar)
        if compiled is not None:
            return compiled
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmiserve-grammar")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.compile, grammar)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        cast(Any, self._hf), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                    )
                except ValueError as exc:  # e.g. a slow (Python) tokenizer
                    raise InvalidRequest(f"structured output is not supported for this model: {exc}") from None
            return self._tokenizer


def _source(grammar: Grammar) -> str:
    """The llguidance grammar of `grammar`; `InvalidRequest` when its value is malformed. A grammar that
    starts after a reasoning block (`Grammar.after`) allows whitespace first (models put a blank line
    after the block's end marker)."""
    source = _constraint(grammar)
    return _after_whitespace(source) if grammar.after else source


def _after_whitespace(source: str) -> str:
    """`source` (a top-level JSON grammar or Lark text) behind optional whitespace, as a nested grammar."""
    try:
        top = json.loads(source)
    except ValueError:
        top = {"grammars": [{"lark_grammar": source}]}
    first = {**top["grammars"][0], "name": "lmiserve_answer"}
    outer = {"lark_grammar": "start: /[ \\t\\r\\n]*/ @lmiserve_answer"}
    return json.dumps({"grammars": [outer, first, *top["grammars"][1:]]})


def _constraint(grammar: Grammar) -> str:
    import llguidance

    kind, value = grammar.kind, grammar.value
    try:
        if kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS))
        if kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS))
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(value))
        if kind == "choice":
            return str(llguidance.LLMatcher.grammar_from_regex(_choice_regex(value)))
        if kind == "ebnf":
            return str(llguidance.LLMatcher.grammar_from_lark(_lark(value)))
    except ValueError as exc:
        raise InvalidRequest(f"invalid {_what(grammar)}: {_first_line(str(exc))}") from None
    raise InvalidRequest(f"unknown grammar kind {kind!r}")


def _choice_regex(value: str) -> str:
    try:
        choices = json.loads(value)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequest("a choice must be a non-empty list of strings")
    return "|".join("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices)


def _lark(value: str) -> str:
    """Lark as is; a GBNF grammar (llama.cpp's, `root ::= ...`) converted to Lark."""
    if "::=" not in value:
        return value
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return str(gbnf_to_lark(value))
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted errors on bad input
        raise InvalidRequest(f"invalid grammar: {_first_line(str(exc))}") from None


def _what(grammar: Grammar) -> str:
    return {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar"}.get(grammar.kind, "grammar")


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:4])[:500] if lines else "rejected"
