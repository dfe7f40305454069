"""The tensor protocols' routes, appended after the LMI/TGI/OpenAI table (so exact routes such as the
OpenAI `GET /v1/models` win): SageMaker's batch probe, Vertex AI (its routes come from settings), then
KServe V2 under /v2 and TF Serving under /v1/models/."""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from lmiserve.protocols.tensor.kserve import routes as v2_routes
from lmiserve.protocols.tensor.sagemaker import routes as sagemaker
from lmiserve.protocols.tensor.sagemaker.errors import RENDERER as SAGEMAKER_ERRORS
from lmiserve.protocols.tensor.sagemaker.schema import ExecutionParameters
from lmiserve.protocols.tensor.tfserving import routes as tfserving_routes
from lmiserve.protocols.tensor.vertex import routes as vertex_routes
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes


def configured_routes(settings) -> list[BaseRoute]:
    """Routes whose paths come from the environment ($AIP_*); they go before every other route."""
    return vertex_routes.configured_routes(settings)


def routes() -> list[BaseRoute]:
    return [
        *protocol_routes(
            SAGEMAKER_ERRORS,
            [
                apidoc.document(
                    Route("/execution-parameters", sagemaker.execution_parameters, methods=["GET"]),
                    apidoc.Operation(
                        "SageMaker batch transform's execution parameters",
                        "SageMaker",
                        apidoc.ok("The parameters", apidoc.json(ExecutionParameters)),
                    ),
                )
            ],
        ),
        *vertex_routes.routes(),
        *v2_routes.routes(),
        *tfserving_routes.routes(),
    ]
