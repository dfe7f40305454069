"""SageMaker's /invocations: records in JSON, JSON Lines or CSV, answered in the negotiated type.

`lmiserve.protocols.invocations` decides which /invocations requests are SageMaker's (its media types
and one-shot models; LMI's own payloads stay LMI's) and calls `invoke_llm` or `invoke_tensor` with the
addressed model and the request's `Records`:
- a one-shot model takes JSON records (a list, a scalar, several top-level values, or a TF Serving
  `instances`/`examples` document, run as TF Serving does), JSON Lines and CSV;
- an LLM takes JSON Lines (each line an LMI request, answered by LMI's JSON body) and CSV (each
  record a prompt).
Errors are raised and answered by `errors.RENDERER` (JSON ``{"error": msg}``);
`X-Amzn-SageMaker-Custom-Attributes` is echoed on every answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import AdapterNotFound, GenerationFailed, InvalidRequest
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor import records as tensor_records
from lmiserve.protocols.tensor.sagemaker import parse as sagemaker
from lmiserve.protocols.tensor.sagemaker.errors import echo
from lmiserve.server.responses import raw_response


@dataclass(frozen=True)
class Records:
    """A SageMaker request's body, not decoded yet (its errors are SageMaker's)."""

    body: bytes
    content_type: str | None  # the Content-Type header (or its ContentType spelling)
    attributes: dict[str, str]  # the parsed custom attributes (tfs-model-name, tfs-method, ...)


class LineModel(Protocol):
    """How an LLM answers one JSON Lines line (the dispatcher passes LMI's, protocols/lmi/lines.py)."""

    def parse_line(self, service: ModelService, payload: Any) -> Any: ...  # InvalidRequest if invalid

    def answer_line(self, service: ModelService, call: Any) -> Coroutine[Any, Any, Any]: ...  # GenerationFailed


class TfDocuments(Protocol):
    """TF Serving's document codec (the dispatcher passes protocols/tensor/tfserving/parse.py)."""

    def parse_predict(self, doc: object, signature: ModelSignature, model: str) -> tuple[TensorRequest, str]: ...

    def parse_examples(self, doc: object, method: str, kind: str, signature: ModelSignature) -> TensorRequest: ...

    def classify_body(self, outputs: dict[str, np.ndarray], labels: list[str]) -> bytes: ...

    def regress_body(self, outputs: dict[str, np.ndarray]) -> bytes: ...


async def invoke_llm(request: Request, service: ModelService, records: Records, lines: LineModel) -> Response:
    """JSON Lines: every line an LMI request, answered by LMI's JSON body; CSV: every record a prompt."""
    body, accept = _read(request, records)
    if body.media == sagemaker.CSV:
        preds, objects = await _prompts(service, body)
    else:
        service.ready_engine()
        payloads = sagemaker.json_records(body)[0]
        objects = await _all_or_none([_line(service, p, i, lines) for i, p in enumerate(payloads)])
        preds = [o.get("generated_text", o) if isinstance(o, dict) else o for o in objects]
    return _answer(request, accept, preds, list(objects))


async def invoke_tensor(request: Request, service: ModelService, records: Records, tf: TfDocuments) -> Response:
    """A one-shot model: one prediction per record."""
    body, accept = _read(request, records)
    model = service.tensor_model
    text_input = all(t.datatype == "BYTES" for t in model.signature.inputs)
    if body.media == sagemaker.CSV:
        rows = sagemaker.csv_records(body, text_input)
    else:
        rows, tf_document, _ = sagemaker.json_records(body)
        if tf_document:
            return await _tf_document(request, service, model, rows[0], records.attributes, accept, tf)
    outputs = await model.infer(tensor_records.to_request(rows, model.signature, service.name))
    return _answer(
        request, accept, tensor_records.predictions(outputs, len(rows)), tensor_records.as_objects(outputs, len(rows))
    )


async def execution_parameters(request: Request) -> Response:
    """SageMaker batch transform's optional probe: multi-record batches (the records of one body are
    answered in order) of up to 6 MB."""
    body = {"MaxConcurrentTransforms": 8, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 6}
    return raw_response(json.dumps(body).encode())


def _read(request: Request, records: Records) -> tuple[sagemaker.Body, str]:
    """The body's text in a supported media type, and the response's media type."""
    body = sagemaker.read_body(records.body, records.content_type)
    default_accept = getattr(getattr(request.app.state, "settings", None), "default_invocations_accept", None)
    return body, sagemaker.negotiate(request.headers.get("accept"), body.media, default_accept)


def _answer(request: Request, accept: str, preds: list, objects: list[dict]) -> Response:
    return raw_response(sagemaker.encode(accept, preds, objects), 200, accept, echo(request))


async def _tf_document(
    request: Request,
    service: ModelService,
    model: Any,
    doc: dict,
    attributes: dict[str, str],
    accept: str,
    tf: TfDocuments,
) -> Response:
    """A TF Serving document (`instances` or `examples`), as the TF Serving container forwards it."""
    method = attributes.get("tfs-method", "classify" if "examples" in doc else "predict")
    if method == "predict":
        tensor_request, _ = tf.parse_predict(doc, model.signature, service.name)  # `instances`: one record each
        outputs = await model.infer(tensor_request)
        count = next(iter(outputs.values())).shape[0] if outputs else 0
        return _answer(
            request, accept, tensor_records.predictions(outputs, count), tensor_records.as_objects(outputs, count)
        )
    if method not in ("classify", "regress"):
        raise InvalidRequest(f"unknown tfs-method '{method}': expected predict, classify or regress")
    outputs = await model.infer(tf.parse_examples(doc, method, model.kind, model.signature))
    if method == "classify":
        labels = list(getattr(getattr(model, "runner", None), "labels", None) or [])
        body = tf.classify_body(outputs, labels)
    else:
        body = tf.regress_body(outputs)
    return raw_response(body, 200, sagemaker.JSON, echo(request))


async def _prompts(service: ModelService, body: sagemaker.Body) -> tuple[list, list[dict]]:
    """CSV for an LLM: every record a prompt, answered by its generated text."""
    prompts = sagemaker.csv_records(body, text_input=True)
    model = service.tensor_model
    column = np.empty(len(prompts), dtype=object)
    column[:] = [p.encode("utf-8") for p in prompts]
    outputs = await model.infer(TensorRequest(inputs={model.signature.inputs[0].name: column}))
    texts = [tensor_records.plain(v) for v in outputs[model.signature.outputs[0].name].reshape(-1)]
    return texts, [{"generated_text": t} for t in texts]


async def _line(service: ModelService, payload: Any, index: int, lines: LineModel) -> Any:
    """One JSON Lines line; its errors name the line."""
    try:
        call = lines.parse_line(service, payload)
    except InvalidRequest as exc:
        raise InvalidRequest(f"line {index + 1}: {exc.message}") from None
    except AdapterNotFound as exc:  # a LoRA adapter the line names that is not served: 404
        raise AdapterNotFound(f"line {index + 1}: {exc.message}") from None
    try:
        return await lines.answer_line(service, call)
    except GenerationFailed as exc:
        raise GenerationFailed(f"line {index + 1}: {exc.message}") from None


async def _all_or_none(coros: list) -> list:
    """Run concurrently; the first failure cancels the other lines and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
