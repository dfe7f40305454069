"""SageMaker content types on /invocations (reference §5), hooked into the LMI route.

On `/invocations` only, `handle` answers what LMI does not: JSON records (a list, a scalar, several
top-level values, a TF Serving `instances`/`examples` document), JSON Lines and CSV bodies for a non-LLM
model, and JSON Lines or CSV bodies for an LLM (each JSON Lines line an LMI request -> one output line;
each CSV record a prompt). It returns None for LMI's own payloads (a JSON object with `inputs`,
text/plain), which keep LMI semantics whatever the model kind, and for DJL's `/predictions/{m}` and
`/models/{m}/invoke`. The model is the `tfs-model-name` custom attribute, else the `model_name` query
parameter or header, else the default model.
`X-Amzn-SageMaker-Custom-Attributes` is echoed on the answer. Errors are JSON `{"error": msg}`.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.protocols.lmi import parse as lmi
from lmiserve.protocols.tensor.sagemaker import parse as sagemaker
from lmiserve.protocols.tensor import records as tensor_records
from lmiserve.protocols.tensor.tfserving import parse as tfserving
from lmiserve.protocols.tensor.codecs.errors import TensorError, protocol_status
from lmiserve.core.errors import GenerationFailed, LmiServeError
from lmiserve.core.tensors import TensorRequest
from lmiserve.protocols.lmi.formatters import error_message, get_formatter, is_error_finish
from lmiserve.server.responses import raw_response
from lmiserve.models.service import ModelService, model_service

_LLM_TYPES = (sagemaker.JSONLINES, sagemaker.CSV)


def _error(message: str, status: int, headers: dict) -> Response:
    return raw_response(json.dumps({"error": message}, ensure_ascii=False).encode("utf-8"), status, headers=headers)


def _model_name(request: Request, attributes: dict[str, str]) -> str | None:
    return (
        attributes.get("tfs-model-name")
        or request.path_params.get("model_name")
        or request.query_params.get("model_name")
        or request.headers.get("model_name")
    )


async def handle(request: Request) -> Response | None:
    if request.url.path != "/invocations":
        return None  # DJL's /predictions/{m} and /models/{m}/invoke keep LMI semantics only
    raw_attributes = request.headers.get(sagemaker.CUSTOM_ATTRIBUTES)
    echo = {sagemaker.CUSTOM_ATTRIBUTES: raw_attributes} if raw_attributes is not None else {}
    attributes = sagemaker.custom_attributes(raw_attributes)
    try:
        svc = model_service(request, _model_name(request, attributes))
    except LmiServeError:
        return None  # LMI answers unknown models in its own shape
    header = request.headers.get("content-type") or request.headers.get("contenttype")
    media, _ = sagemaker.content_type(header)
    if svc.kind == "llm" and (media not in _LLM_TYPES or await _lmi_stream(request, media)):
        return None
    if media == "text/plain" or (media == sagemaker.JSON and sagemaker.is_lmi_payload(await request.body())):
        return None  # LMI's own payloads stay LMI's, whatever the model kind
    default_accept = getattr(getattr(request.app.state, "settings", None), "default_invocations_accept", None)
    try:
        body = sagemaker.read_body(await request.body(), header)
        accept = sagemaker.negotiate(request.headers.get("accept"), body.media, default_accept)
        if svc.kind == "llm":
            preds, objects = await _llm(svc, body)
            return raw_response(sagemaker.encode(accept, preds, objects), 200, accept, echo)
        return await _tensor(svc, body, accept, attributes, echo)
    except LmiServeError as exc:
        return _error(exc.message, protocol_status(exc), echo)


async def execution_parameters(request: Request) -> Response:
    """SageMaker batch transform's optional probe: multi-record batches (the records of one body are
    answered in order) of up to 6 MB."""
    body = {"MaxConcurrentTransforms": 8, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 6}
    return raw_response(json.dumps(body).encode())


async def _lmi_stream(request: Request, media: str) -> bool:
    """A one-line JSON Lines body asking to stream is an LMI streaming request (LMI reads the body as JSON)."""
    if media != sagemaker.JSONLINES:
        return False
    try:
        payload = json.loads(await request.body())
    except (ValueError, RecursionError):
        return False
    return isinstance(payload, dict) and payload.get("stream") is True


async def _tensor(svc: ModelService, body: sagemaker.Body, accept: str, attributes: dict, echo: dict) -> Response:
    model = svc.tensor_model
    text_input = all(t.datatype == "BYTES" for t in model.signature.inputs)
    if body.media == sagemaker.CSV:
        records = sagemaker.csv_records(body, text_input)
    else:
        records, tf_document, _ = sagemaker.json_records(body)
        if tf_document:
            return await _tf_document(svc, model, records[0], attributes, accept, echo)
    request = tensor_records.to_request(records, model.signature, svc.name)
    outputs = await model.infer(request)
    preds = tensor_records.predictions(outputs, len(records))
    objects = tensor_records.as_objects(outputs, len(records))
    return raw_response(sagemaker.encode(accept, preds, objects), 200, accept, echo)


async def _tf_document(svc, model, doc: dict, attributes: dict, accept: str, echo: dict) -> Response:
    """A TF Serving document (`instances` or `examples`), as the TF Serving container forwards it."""
    method = attributes.get("tfs-method", "classify" if "examples" in doc else "predict")
    if method == "predict":
        request, _ = tfserving.parse_predict(doc, model.signature, svc.name)  # `instances`: one record each
        outputs = await model.infer(request)
        count = next(iter(outputs.values())).shape[0] if outputs else 0
        preds, objects = tensor_records.predictions(outputs, count), tensor_records.as_objects(outputs, count)
        return raw_response(sagemaker.encode(accept, preds, objects), 200, accept, echo)
    if method not in ("classify", "regress"):
        raise TensorError(f"unknown tfs-method '{method}': expected predict, classify or regress")
    request = tfserving.parse_examples(doc, method, model.kind, model.signature)
    outputs = await model.infer(request)
    if method == "classify":
        labels = list(getattr(getattr(model, "runner", None), "labels", None) or [])
        return raw_response(tfserving.classify_body(outputs, labels), 200, sagemaker.JSON, echo)
    return raw_response(tfserving.regress_body(outputs), 200, sagemaker.JSON, echo)


async def _llm(svc: ModelService, body: sagemaker.Body) -> tuple[list, list[dict]]:
    """JSON Lines: every line an LMI request, answered by LMI's JSON body; CSV: every record a prompt."""
    if body.media == sagemaker.CSV:
        prompts = sagemaker.csv_records(body, text_input=True)
        model = svc.tensor_model
        column = np.empty(len(prompts), dtype=object)
        column[:] = [p.encode("utf-8") for p in prompts]
        outputs = await model.infer(TensorRequest(inputs={model.signature.inputs[0].name: column}))
        texts = [tensor_records.plain(v) for v in outputs[model.signature.outputs[0].name].reshape(-1)]
        return texts, [{"generated_text": t} for t in texts]
    engine = svc.ready_engine()
    lines = sagemaker.json_records(body)[0]
    objects = await _all_or_none([_lmi_line(engine, svc, line, i) for i, line in enumerate(lines)])
    return [o.get("generated_text", o) if isinstance(o, dict) else o for o in objects], list(objects)


async def _all_or_none(coros: list) -> list:
    """Run concurrently; the first failure cancels the other lines and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _lmi_line(engine, svc: ModelService, payload: object, index: int) -> dict:
    if isinstance(payload, dict):
        payload = {k: v for k, v in payload.items() if k != "stream"}
    try:
        call = lmi.parse(payload, svc.limits)
    except LmiServeError as exc:
        raise TensorError(f"line {index + 1}: {exc.message}") from None
    fmt = get_formatter("json", call.options)  # one JSON document per line, whatever the server default
    chunks = []
    async with aclosing(engine.generate(call.requests[0])) as events:  # closing aborts the sequence
        async for event in events:
            if is_error_finish(event):
                raise GenerationFailed(f"line {index + 1}: {error_message(event)}")
            chunks.append(fmt.on_event(event) or b"")
    chunks.append(fmt.close() or b"")
    return json.loads(b"".join(chunks))
