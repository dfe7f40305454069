"""Structured output in `lmiserve bench --json-schema`: the schema every constrained request carries,
the constrained/unconstrained comparison of the same run, and the target. The grammar figures are
measured in this process with the engine's own code (`GrammarCompiler`, `TokenMask`) on the served
model's tokenizer, by `baselines.measure_grammar` (the one bench module that imports torch):

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
from collections.abc import Callable, Sequence
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
