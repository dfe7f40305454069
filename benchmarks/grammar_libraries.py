"""Compare structured-generation libraries on the bundled model's tokenizer (SmolLM2-135M, 49 152 tokens).

For xgrammar, llguidance and outlines-core this measures:

- compile time of a realistic JSON schema, cold (first time in the process) and cached (what a server
  pays for a schema it has seen: a cache hit plus making a fresh per-sequence matcher),
- compile time of a regex (cold),
- per decode step, at batch 1, 8 and 32: filling the token bitmask of every row ("fill") and advancing
  each row's matcher by its token ("advance"); and applying the bitmask to the float32 logits in place
  ("apply": the same torch code for all three, as lmiserve does it, so it is listed once).

Each row of the batch walks a valid JSON document token by token (the tokenizer's own encoding of it),
so every step is a real mid-structure state. Run it alone (the machine has 2 cores):

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_libraries.py

It needs all three libraries installed (`pip install xgrammar llguidance outlines-core`); lmiserve
itself depends only on the chosen one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "status": {"enum": ["active", "suspended", "closed"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "paid": {"type": "boolean"}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "maxItems": 10,
        },
    },
    "required": ["id", "name", "status", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "id": 42,
    "name": "Ada Lovelace",
    "email": "ada@example.com",
    "status": "active",
    "score": 99.5,
    "tags": ["math", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "orders": [{"sku": "AE-1", "qty": 2, "paid": True}, {"sku": "DE-2", "qty": 1}],
}
REGEX = r"(\+1 )?\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
BATCHES = (1, 8, 32)
WALKS = 5


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def apply_mask_torch(logits: torch.Tensor, bitmask: torch.Tensor, shifts: torch.Tensor) -> None:
    """The library-independent apply: unpack the int32 bitmask and fill -inf where a bit is 0."""
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


class Candidate:
    name: str

    def compile_schema(self, schema: str) -> Any: ...
    def compile_regex(self, regex: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def advance(self, matcher: Any, token: int) -> None: ...


SHIFTS = torch.arange(32, dtype=torch.int32)


class XGrammar(Candidate):
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile_schema(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def compile_regex(self, regex: str) -> Any:
        return self.compiler.compile_regex(regex)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)


class LLGuidance(Candidate):
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)

    def _build(self, grammar: str) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def compile_schema(self, schema: str) -> Any:
        return self._build(self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))

    def compile_regex(self, regex: str) -> Any:
        return self._build(self.llg.LLMatcher.grammar_from_regex(regex))

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class OutlinesCore(Candidate):
    name = "outlines-core"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_vocabulary(hf_tokenizer)

    def compile_schema(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema, whitespace_pattern="")
        return self.oc.Index(regex, self.vocabulary)

    def compile_regex(self, regex: str) -> Any:
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), 4)

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token)


def outlines_vocabulary(hf_tokenizer: Any) -> Any:
    """outlines-core's Vocabulary from a byte-level BPE tokenizer: each token's bytes -> its ids."""
    import outlines_core

    byte_of = {c: b for b, c in byte_level_alphabet().items()}
    special = set(hf_tokenizer.all_special_ids)
    mapping: dict[bytes, list[int]] = {}
    for token, token_id in hf_tokenizer.get_vocab().items():
        if token_id in special:
            continue
        mapping.setdefault(bytes(byte_of[c] for c in token), []).append(token_id)
    return outlines_core.Vocabulary(hf_tokenizer.eos_token_id, mapping)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: byte -> the printable character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def measure(lib: Candidate, tokens: list[int], vocab_size: int) -> dict[str, float]:
    schema = json.dumps(SCHEMA)
    cold, compiled = timed(lambda: lib.compile_schema(schema))
    # cached: what a server pays for a schema it has compiled before (cache lookup + a fresh matcher)
    cache = {schema: compiled}
    cached = statistics.median(timed(lambda: lib.matcher(cache[schema]))[0] for _ in range(20))
    regex, _ = timed(lambda: lib.compile_regex(REGEX))
    result = {"schema_cold_ms": cold * 1e3, "schema_cached_us": cached * 1e6, "regex_cold_ms": regex * 1e3}
    for batch in BATCHES:
        bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        logits = torch.randn(batch, vocab_size)
        fill, apply, advance = [], [], []
        for _ in range(WALKS):  # fresh matchers each walk; the median step of all walks
            matchers = [lib.matcher(compiled) for _ in range(batch)]
            for token in tokens:
                t0 = time.perf_counter()
                lib.fill(matchers, bitmask)
                t1 = time.perf_counter()
                apply_mask_torch(logits, bitmask, SHIFTS)
                t2 = time.perf_counter()
                for m in matchers:
                    lib.advance(m, token)
                t3 = time.perf_counter()
                fill.append(t1 - t0)
                apply.append(t2 - t1)
                advance.append(t3 - t2)
                assert torch.isfinite(logits[:, token]).all(), f"{lib.name} masked the document's own token {token}"
                logits.normal_()
        result[f"fill_b{batch}_us"] = statistics.median(fill) * 1e6
        result[f"advance_b{batch}_us"] = statistics.median(advance) * 1e6
        result[f"apply_b{batch}_us"] = statistics.median(apply) * 1e6
    return result


def main() -> None:
    from transformers import AutoConfig, AutoTokenizer

    from lmiserve.models.bundled import bundled_model_path

    path = bundled_model_path()
    hf = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    tokens = hf.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    torch.set_num_threads(1)
    print(f"vocab {vocab_size}, document of {len(tokens)} tokens, torch threads 1")
    rows = []
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        setup, lib = timed(lambda cls=cls: cls(hf, vocab_size))  # type: ignore[misc]
        r = measure(lib, tokens, vocab_size)
        r["tokenizer_setup_ms"] = setup * 1e3
        rows.append((lib.name, r))
        print(lib.name, {k: round(v, 1) for k, v in r.items()}, flush=True)
    keys = list(rows[0][1])
    print("\n| library | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, r in rows:
        print(f"| {name} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
