"""Inference on one model, whatever the transport: REST's `/v2/models/{m}/infer` (routes.py) and gRPC's
`ModelInfer` / `ModelStreamInfer` (grpc/) hand over the request as a document (parse.py) and encode the
outputs their own way.

On an LLM the generation settings may come as `parameters` or as input tensors beside `text_input`
(generate.SETTING_INPUTS: TensorRT-LLM's and litellm's way); both are mapped as `/generate` maps its
parameters (generate.infer_parameters), so `max_tokens` is honoured whichever way it came, and a
setting that cannot be honoured is refused naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmiserve.core.tensors import TensorRequest
from lmiserve.protocols.tensor.kserve import generate
from lmiserve.protocols.tensor.kserve import parse as kserve


def parse(doc: dict, tail: bytes, name: str, model: Any, route: str) -> tuple[TensorRequest, kserve.OutputPlan]:
    """The request for `model` (served as `name`) and how to answer it; `route` names the route or RPC
    in an LLM's refusals."""
    llm = model.kind == "llm"
    settings = generate.SETTING_INPUTS if llm else frozenset()
    request, plan, tensors = kserve.parse_infer(doc, tail, name, model.signature, settings)
    if llm:
        request.parameters = generate.infer_parameters(request.parameters, tensors, route)
    return request, plan


async def infer(
    doc: dict, tail: bytes, name: str, model: Any, route: str
) -> tuple[dict[str, np.ndarray], kserve.OutputPlan]:
    """The model's outputs for the request, and how to answer them."""
    request, plan = parse(doc, tail, name, model, route)
    return await model.infer(request), plan
