"""Structured output in `lmiserve bench --json-schema`: the schema every constrained request carries,
the constrained/unconstrained comparison of the same run, and the grammar figures measured in this
process with the engine's own code (`GrammarCompiler`, `TokenMask`) on the served model's tokenizer:

- compile times: building the library's tokenizer (once per model), a cold compile of the schema
  (a fresh compiler, tokenizer built) and a cached one (the cache hit plus the sequence's matcher copy);
- the per-step mask cost at each concurrency: `B` matchers walk the schema together, each step does
  what a runner does for `B` constrained rows (copy the rows, fill one bitmask, mask in place) on
  random logits, the argmax of each masked row advancing its matcher.

The builtin schema (a list of records: integers, bounded numbers, enums, booleans, bounded strings)
needs more than N tokens to complete (`minItems` = N / 4 + 1 records of at least ~20 tokens each),
so constrained requests stream exactly N tokens, like the unconstrained ones, and the two phases
compare the same amount of work.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmiserve.bench.stats import ratio

Json = dict[str, Any]
Log = Callable[[str], None]

BUILTIN = "builtin"
TARGET_CONCURRENCY = 32
TARGET_RATIO = 0.9


class SchemaError(ValueError):
    """The --json-schema argument is not `builtin` or a file holding a JSON object."""


def builtin_schema(max_new_tokens: int) -> Json:
    """The builtin schema: cannot complete within `max_new_tokens` tokens (see the module docstring)."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "score", "active"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"records": {"type": "array", "items": record, "minItems": max_new_tokens // 4 + 1}},
        "required": ["records"],
        "additionalProperties": False,
    }


def load_schema(spec: str, max_new_tokens: int) -> Json:
    """`builtin` or the JSON object in file `spec`."""
    if spec == BUILTIN:
        return builtin_schema(max_new_tokens)
    try:
        schema = json.loads(Path(spec).read_text())
    except OSError as exc:
        raise SchemaError(f"cannot read the JSON schema file {spec}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{spec} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise SchemaError(f"{spec} must hold a JSON object (a JSON schema)")
    return schema


def compare_levels(unconstrained: Sequence[Json], constrained: Sequence[Json]) -> list[Json]:
    """Per concurrency: constrained tokens/s over unconstrained tokens/s of the same run."""
    by_c = {lv["concurrency"]: lv for lv in unconstrained}
    out = []
    for level in constrained:
        c = level["concurrency"]
        plain = by_c.get(c, {}).get("output_tokens_per_s")
        rate = level["output_tokens_per_s"]
        out.append(
            {
                "concurrency": c,
                "unconstrained_tokens_per_s": plain,
                "constrained_tokens_per_s": rate,
                "constrained_over_unconstrained": ratio(rate, plain),
            }
        )
    return out


def structured_target(structured: Json | None) -> Json | None:
    """The issue's target (concurrency 32: constrained >= 0.9 x unconstrained), None without --json-schema."""
    if not structured:
        return None
    rows = {r["concurrency"]: r for r in structured.get("comparison", ())}
    value = rows.get(TARGET_CONCURRENCY, {}).get("constrained_over_unconstrained")
    target: Json = {
        "id": "c32_constrained",
        "description": "concurrency 32: constrained (JSON schema) tokens/s >= 0.9 x unconstrained, same run",
        "threshold": TARGET_RATIO,
        "value": value,
        "passed": None if value is None else value >= TARGET_RATIO,
    }
    if value is None:
        target["note"] = f"not measured (needs concurrency {TARGET_CONCURRENCY})"
    return target


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def measure_grammar(
    overrides: Mapping[str, Any], schema: Json, batch_sizes: Sequence[int], steps: int, log: Log
) -> Json:
    """Compile times and per-step mask cost of `schema` on the served model's tokenizer (see the
    module docstring). Loads the model as the server does (for its tokenizer, vocabulary and EOS)."""
    import torch

    from lmiserve.bench.baselines import load_like_server
    from lmiserve.core.grammar import Grammar
    from lmiserve.engine.grammar_compiler import GrammarCompiler
    from lmiserve.engine.token_mask import TokenMask

    loaded = load_like_server(overrides)
    vocab = int(getattr(loaded.model.config, "vocab_size", None) or len(loaded.tokenizer))
    eos = sorted(loaded.eos_token_ids)
    grammar = Grammar("json_schema", json.dumps(schema, ensure_ascii=False))
    del loaded.model  # only the tokenizer is needed from here

    compiler = GrammarCompiler(loaded.tokenizer, vocab_size=vocab, eos_token_ids=eos)
    t0 = time.perf_counter()
    compiler._llg_tokenizer()  # noqa: SLF001 - timed apart: paid once per model, not per schema
    t1 = time.perf_counter()
    compiled = compiler.compile(grammar)
    t2 = time.perf_counter()
    first = TokenMask(vocab, eos)
    first.fill([compiled.matcher()])  # the library finishes some of the compile work lazily
    t3 = time.perf_counter()
    cached = []
    for _ in range(20):
        start = time.perf_counter()
        compiler.compile(grammar).matcher()
        cached.append(time.perf_counter() - start)
    compile_figures = {
        "tokenizer_build_ms": _ms(t1 - t0),
        "cold_compile_ms": _ms(t2 - t1),
        "cold_first_mask_ms": _ms(t3 - t2),
        "cached_compile_ms": _ms(statistics.median(cached)),
    }
    log(
        f"  grammar: tokenizer {compile_figures['tokenizer_build_ms']} ms (once per model), cold compile "
        f"{compile_figures['cold_compile_ms']} ms + first mask {compile_figures['cold_first_mask_ms']} ms, "
        f"cached {compile_figures['cached_compile_ms']} ms"
    )

    mask_rows = []
    generator = torch.Generator().manual_seed(0)
    for batch in batch_sizes:
        mask = TokenMask(vocab, eos)
        matchers = [compiled.matcher() for _ in range(batch)]
        fills, applies = [], []
        for _ in range(steps):
            logits = torch.randn((batch, vocab), generator=generator)
            start = time.perf_counter()
            mask.fill(matchers)
            filled = time.perf_counter()
            copies = logits[list(range(batch))]  # what `ModelRunner._mask_rows` does: copy the rows, mask them
            mask.apply(copies, matchers)
            applies.append(time.perf_counter() - filled)
            fills.append(filled - start)
            for row, token in enumerate(copies.argmax(-1).tolist()):
                if not matchers[row].accept(token) or matchers[row].is_stopped:
                    matchers[row] = compiled.matcher()  # completed (a user schema): start a new sequence
        fill, apply = statistics.median(fills), statistics.median(applies)
        mask_rows.append(
            {
                "batch_size": batch,
                "steps": steps,
                "fill_ms": _ms(fill),
                "step_mask_ms": _ms(apply),
                "per_row_us": round(apply / batch * 1e6, 1),
            }
        )
        log(f"  mask at batch {batch}: {_ms(apply)} ms a step (bitmask fill alone {_ms(fill)} ms)")
    compiler.close()
    return {"compile": compile_figures, "mask": mask_rows, "vocab_size": vocab}
