"""The OpenAI-compatible routes' error answers. Before a stream starts they are TGI's (see
`lmiserve.server.textgen.errors`), plus three situations of the completions route that TGI reports
with their own ``error_type``. Once a stream started, an error is
``data: {"error":{"message":"...","http_status_code":422}}`` (the status is always 422) followed by
``data: [DONE]``.
"""

from __future__ import annotations

from typing import ClassVar

from lmiserve.core.errors import InvalidRequest, LmiServeError, Unsupported
from lmiserve.server import sse
from lmiserve.server.textgen.errors import SHAPES, Shape, TextGenRenderer
from lmiserve.server.textgen.wire import dumps

DONE = b"data: [DONE]\n\n"  # the last event of every OpenAI stream


class EmptyPrompt(InvalidRequest):
    """A completions request whose prompt is an empty array."""


class TooManyPrompts(InvalidRequest):
    """More prompts in one completions request than max_client_batch_size."""


class SuffixUnsupported(Unsupported):
    """A completions request with a `suffix`."""


class OpenAIRenderer(TextGenRenderer):
    protocol = "openai"
    shapes: ClassVar[dict[type[LmiServeError], Shape]] = {
        **SHAPES,
        EmptyPrompt: Shape(422, "validation"),
        TooManyPrompts: Shape(422, "batch size exceeded"),
        SuffixUnsupported: Shape(422, "suffix not supported"),
    }

    def in_band(self, exc: LmiServeError) -> bytes:
        return sse.event(dumps({"error": {"message": self.message(exc), "http_status_code": 422}})) + DONE


RENDERER = OpenAIRenderer()
