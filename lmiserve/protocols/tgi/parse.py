"""A TGI generate request -> one validated engine call (TGI's checks, in its order, with its
messages: `lmiserve.protocols.textgen.validation`)."""

from __future__ import annotations

from collections.abc import Callable

from lmiserve.core.limits import TextGenLimits
from lmiserve.core.media import Image
from lmiserve.protocols.textgen.validation import TextGenCall, check
from lmiserve.protocols.tgi.schema import GenerateRequest


def validate(
    req: GenerateRequest,
    limits: TextGenLimits,
    count_tokens: Callable[[str], int],
    *,
    stream: bool,
    adapter: str | None = None,
    prompt: str | None = None,
    images: tuple[Image, ...] = (),
) -> TextGenCall:
    """`InvalidRequest` for the first check that fails; streaming allows neither best_of > 1 nor
    decoder_input_details. `adapter`: the LoRA adapter that answers (None: the base model); `prompt`: the
    text the engine runs instead of `inputs` (a vision model's: its markdown images as image
    placeholders), `images` their images, in order (`count_tokens` counts their tokens)."""
    inputs = req.inputs if prompt is None else prompt
    checked = check(inputs, req.effective_parameters(), limits, count_tokens, stream=stream)
    return checked.call(adapter=adapter, images=images)
