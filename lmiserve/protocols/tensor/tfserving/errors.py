"""TF Serving errors: ``{"error": msg}`` pretty-printed with a 4-space indent (as TF Serving's REST
layer writes it), with the tensor protocols' statuses (TF's INVALID_ARGUMENT 400, NOT_FOUND 404,
UNIMPLEMENTED 501, UNAVAILABLE 503, INTERNAL 500)."""

from __future__ import annotations

from lmiserve.core.errors import LmiServeError
from lmiserve.protocols.tensor.codecs.tfjson import error_body
from lmiserve.protocols.tensor.errors import JsonErrorRenderer


class TfServingErrorRenderer(JsonErrorRenderer):
    protocol = "tfserving"

    def body(self, exc: LmiServeError) -> bytes:
        return error_body(exc.message)


RENDERER = TfServingErrorRenderer()
