"""A TGI generate request -> one validated engine call (TGI's checks, in its order, with its
messages: `lmiserve.protocols.textgen.validation`)."""

from __future__ import annotations

from collections.abc import Callable

from lmiserve.core.limits import TextGenLimits
from lmiserve.protocols.textgen.validation import TextGenCall, build
from lmiserve.protocols.tgi.schema import GenerateRequest


def validate(
    req: GenerateRequest,
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    *,
    stream: bool,
    adapter: str | None = None,
) -> TextGenCall:
    """`InvalidRequest` for the first check that fails; streaming allows neither best_of > 1 nor
    decoder_input_details. `adapter`: the LoRA adapter that answers (None: the base model)."""
    return build(req.inputs, req.effective_parameters(), limits, count_tokens, stream=stream, adapter=adapter)
