"""SageMaker's errors on /invocations: the tensor protocols' JSON ``{"error": "<message>"}`` and
statuses (415 unsupported Content-Type, 406 unacceptable Accept, 400 invalid records, 500 a failure
inside the model, 503 not ready / overloaded), with `X-Amzn-SageMaker-Custom-Attributes` echoed as on
every SageMaker answer."""

from __future__ import annotations

from starlette.requests import Request

from lmiserve.core.errors import LmiServeError
from lmiserve.protocols.tensor.errors import JsonErrorRenderer
from lmiserve.protocols.tensor.sagemaker.parse import CUSTOM_ATTRIBUTES


def echo(request: Request) -> dict[str, str]:
    """The custom-attributes header to send back (none when the request had none)."""
    value = request.headers.get(CUSTOM_ATTRIBUTES)
    return {CUSTOM_ATTRIBUTES: value} if value is not None else {}


class SageMakerErrors(JsonErrorRenderer):
    protocol = "sagemaker"

    def headers(self, exc: LmiServeError, request: Request) -> dict[str, str]:
        return echo(request)


RENDERER = SageMakerErrors()
