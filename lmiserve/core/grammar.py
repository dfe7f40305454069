"""A constraint on generated text, whatever protocol asked for it (TGI `grammar`, OpenAI
`response_format`, vLLM `guided_*` / `structured_outputs`, tool calls, LMI parameters).

Protocols build a `Grammar`; the engine compiles it for the model's tokenizer and masks the logits of
the sequences that carry one. Protocols never see the structured-generation library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf"]


@dataclass(frozen=True)
class Grammar:
    """`kind` and its `value`:

    - ``json_schema``: a JSON Schema, serialized as JSON text in the client's key order (the order of
      `properties` is the order of the generated object's keys, so keys are NOT sorted; equal texts
      share a compiled grammar);
    - ``json_object``: any JSON object (`value` is ignored, "");
    - ``regex``: a regular expression the whole output must match;
    - ``choice``: one of several strings, `value` a JSON array of them;
    - ``ebnf``: a context-free grammar in the library's EBNF (vLLM's `guided_grammar`).

    `after`: when not empty, the constraint starts only once the generated text contains it (a
    reasoning block's end marker: the model thinks freely, then answers under the constraint); the
    token that completes it is the last unconstrained one.
    """

    kind: GrammarKind
    value: str = ""
    after: str = ""
