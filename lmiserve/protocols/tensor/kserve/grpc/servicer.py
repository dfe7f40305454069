"""`inference.GRPCInferenceService`: the Open Inference Protocol over gRPC, over the same models and the
same request checks as REST's `/v2` (kserve/routes.py): what REST answers with a status and
``{"error": msg}``, gRPC answers with a status code (grpc/errors.py) and the same message.

- `ServerLive` (no key; answers while the server drains), `ServerReady` and `ModelReady` (no key:
  health probes, as REST's): readiness is ``ready: false`` while a model loads, NOT_FOUND for a model
  that is not served, UNAVAILABLE once the server drains;
- `ServerMetadata`, `ModelMetadata` (the model's tensors, once it is ready), `RepositoryIndex` (every
  model with its state; ``ready: true`` keeps the ready ones);
- `ModelInfer`: typed contents or `raw_input_contents` in, typed contents or `raw_output_contents` out
  (grpc/convert.py), on any model; on an LLM `text_input` -> `text_output`, its settings as parameters
  or input tensors (kserve/infer.py);
- `ModelStreamInfer`: Triton's decoupled streaming (grpc/stream.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

import lmiserve
from lmiserve.core.errors import NotFound
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.kserve import infer as inference
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve.grpc import convert, grpc_service_pb2_grpc
from lmiserve.protocols.tensor.kserve.grpc import oip_pb2 as pb
from lmiserve.protocols.tensor.kserve.grpc.errors import PROTOCOL, code_of
from lmiserve.protocols.tensor.kserve.grpc.stream import StreamInfer
from lmiserve.protocols.tensor.kserve.models import find, ready_in
from lmiserve.protocols.tensor.kserve.routes import EXTENSIONS
from lmiserve.server.grpc_server import Access, Calls, GrpcHost

SERVICE = "inference.GRPCInferenceService"


def method(name: str) -> str:
    """The full method name of an RPC, as the access log and the traces show it."""
    return f"/{SERVICE}/{name}"


PROBES = (method("ServerLive"), method("ServerReady"), method("ModelReady"))
_STATES = {ModelService.READY: "READY", ModelService.PENDING: "LOADING"}


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.registry = calls.registry
        self.stream = StreamInfer(calls, method("ModelStreamInfer"))

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def live() -> Any:
            return pb.ServerLiveResponse(live=True)

        return await self.calls.unary(context, method("ServerLive"), None, live, Access.LIVE)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def ready() -> Any:
            return pb.ServerReadyResponse(ready=len(self.registry) > 0 and self.registry.all_ready)

        return await self.calls.unary(context, method("ServerReady"), None, ready, Access.OPEN)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def ready() -> Any:
            svc = find(self.registry, request.name, request.version)
            return pb.ModelReadyResponse(ready=svc.status == ModelService.READY)

        return await self.calls.unary(context, method("ModelReady"), request.name or None, ready, Access.OPEN)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def metadata() -> Any:
            return pb.ServerMetadataResponse(name="lmiserve", version=lmiserve.__version__, extensions=EXTENSIONS)

        return await self.calls.unary(context, method("ServerMetadata"), None, metadata)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def metadata() -> Any:
            svc, model = ready_in(self.registry, request.name, request.version)
            doc = kserve.metadata(svc.name, model.kind, model.signature)
            response = pb.ModelMetadataResponse(name=doc["name"], versions=doc["versions"], platform=doc["platform"])
            for field in ("inputs", "outputs"):
                for tensor in doc[field]:
                    getattr(response, field).add(
                        name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"]
                    )
            return response

        return await self.calls.unary(context, method("ModelMetadata"), request.name or None, metadata)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def infer() -> Any:
            svc, model = ready_in(self.registry, request.model_name, request.model_version)
            doc, tail = convert.request_document(request, svc.name)
            outputs, plan = await inference.infer(doc, tail, svc.name, model, "ModelInfer")
            return convert.infer_response(svc.name, outputs, plan, convert.wants_raw(request, plan))

        return await self.calls.unary(context, method("ModelInfer"), request.model_name or None, infer)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        async for response in self.stream.run(request_iterator, context):
            yield response

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def index() -> Any:
            if request.repository_name:
                raise NotFound(f"Repository {request.repository_name} not found (lmiserve serves one, named '')")
            response = pb.RepositoryIndexResponse()
            for svc in self.registry:
                state = _STATES.get(svc.status, "UNAVAILABLE")
                if not request.ready or state == "READY":
                    response.models.add(name=svc.name, version=kserve.VERSION, state=state, reason=svc.error or "")
            return response

        return await self.calls.unary(context, method("RepositoryIndex"), None, index)


def add_to_server(server: grpc.aio.Server, host: GrpcHost) -> None:
    """Serve `inference.GRPCInferenceService` on `server`, over the models of `host`."""
    calls = host.calls(PROTOCOL, code_of, PROBES)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(calls), server)
