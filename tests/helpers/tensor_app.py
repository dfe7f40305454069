"""An in-process lmiserve app serving small numpy `TensorModel`s, for testing the tensor protocols'
HTTP layer without loading weights (the integration tests use real models on a real server).

    app = tensor_app({"affine": affine_model(), "text": text_model()})
    async with client(app) as http: ...
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np

from lmiserve.config import Settings
from lmiserve.core.tensor_io import select_outputs, text_rows
from lmiserve.core.tensors import ModelSignature, TensorRequest, TensorSpec
from lmiserve.models.service import ModelService
from lmiserve.server.app import create_app

WEIGHT = np.array([[1.0, -1.0], [2.0, 0.5], [0.0, 1.0], [-1.0, 3.0]], dtype=np.float32)
BIAS = np.array([0.5, -0.25], dtype=np.float32)


class NumpyModel:
    """A TensorModel computing `fn(**inputs)` with a declared signature (a test double for protocols)."""

    def __init__(self, kind: str, signature: ModelSignature, fn: Callable[..., dict[str, np.ndarray]], labels=None):
        self.kind = kind
        self.signature = signature
        self.fn = fn
        self.seen: list[TensorRequest] = []
        if labels is not None:
            self.runner = type("Runner", (), {"labels": labels})()

    async def infer(self, request: TensorRequest) -> dict[str, np.ndarray]:
        self.seen.append(request)
        return select_outputs(self.fn(**request.inputs), request, self.signature)


def affine_model() -> NumpyModel:
    """x FP32 [-1, 4] -> y = x @ W + b FP32 [-1, 2], best INT64 [-1] (the TorchScript fixture's maths)."""
    signature = ModelSignature(
        inputs=(TensorSpec("x", "FP32", (-1, 4)),),
        outputs=(TensorSpec("y", "FP32", (-1, 2)), TensorSpec("best", "INT64", (-1,))),
    )

    def fn(x):
        y = x.astype(np.float32) @ WEIGHT + BIAS
        return {"y": y, "best": y.argmax(axis=1).astype(np.int64)}

    return NumpyModel("torchscript", signature, fn)


def echo_model(datatype: str) -> NumpyModel:
    """x of `datatype` [-1, -1] -> y, the same tensor."""
    signature = ModelSignature(
        inputs=(TensorSpec("x", datatype, (-1, -1)),), outputs=(TensorSpec("y", datatype, (-1, -1)),)
    )
    return NumpyModel("torchscript", signature, lambda x: {"y": x})


def text_model() -> NumpyModel:
    """text BYTES [-1] -> upper BYTES [-1], length INT32 [-1]."""
    signature = ModelSignature(
        inputs=(TensorSpec("text", "BYTES", (-1,)),),
        outputs=(TensorSpec("upper", "BYTES", (-1,)), TensorSpec("length", "INT32", (-1,))),
    )

    def fn(text):
        rows = text_rows(text, "text")  # InvalidRequest for non-UTF-8 bytes, as the real text models
        upper = np.empty(len(rows), dtype=object)
        upper[:] = [r.upper().encode("utf-8") for r in rows]
        return {"upper": upper, "length": np.array([len(r) for r in rows], dtype=np.int32)}

    return NumpyModel("text", signature, fn)  # a kind of its own: LMI answers it with every output by name


def classifier_model() -> NumpyModel:
    """text BYTES [-1] -> label BYTES [-1], probabilities FP32 [-1, 2] (positive when the text has 'good')."""
    signature = ModelSignature(
        inputs=(TensorSpec("text", "BYTES", (-1,)),),
        outputs=(TensorSpec("label", "BYTES", (-1,)), TensorSpec("probabilities", "FP32", (-1, 2))),
    )

    def fn(text):
        good = np.array([b"good" in bytes(t) for t in text.reshape(-1)])
        probs = np.where(good[:, None], [[0.25, 0.75]], [[0.75, 0.25]]).astype(np.float32)
        label = np.empty(len(good), dtype=object)
        label[:] = [b"positive" if g else b"negative" for g in good]
        return {"label": label, "probabilities": probs}

    return NumpyModel("classifier", signature, fn, labels=["negative", "positive"])


def two_input_model() -> NumpyModel:
    """a FP64 [-1, 2], b INT32 [-1] -> total FP64 [-1] = sum(a) + b."""
    signature = ModelSignature(
        inputs=(TensorSpec("a", "FP64", (-1, 2)), TensorSpec("b", "INT32", (-1,))),
        outputs=(TensorSpec("total", "FP64", (-1,)),),
    )
    return NumpyModel("torchscript", signature, lambda a, b: {"total": a.sum(axis=1) + b})


def tensor_app(models: dict[str, NumpyModel], *, pending: tuple[str, ...] = (), **options):
    settings = Settings.from_options(options)
    services = []
    for name, model in models.items():
        service = ModelService(settings, name=name, kind=model.kind)
        service.status = ModelService.PENDING if name in pending else ModelService.READY
        service._tensor_model = model
        services.append(service)
    return create_app(settings, services=services)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
