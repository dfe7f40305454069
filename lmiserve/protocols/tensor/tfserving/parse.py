"""TF Serving REST: path parsing, predict/classify/regress requests -> TensorRequest,
outputs -> `predictions` / `outputs` / `results`, model status and metadata documents.

Every model has one version, "1", and one signature, `serving_default` (method
`tensorflow/serving/predict`; `:classify` works on classifier models, `:regress` on regression models).
An optional top-level `parameters` object (ignored by TF Serving) carries LLM generation parameters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import unquote

import numpy as np

from lmiserve.core.errors import (
    InvalidInput,
    InvalidRequest,
    ModelRequired,
    NotFound,
    SchemaViolation,
)
from lmiserve.core.tensor_io import conform
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.protocols.tensor.codecs import tftensor
from lmiserve.protocols.tensor.codecs.tfjson import document, dump

VERSION = "1"
SIGNATURE = "serving_default"
METHODS = {
    "predict": "tensorflow/serving/predict",
    "classify": "tensorflow/serving/classify",
    "regress": "tensorflow/serving/regress",
}
_PATH = re.compile(
    r"/v1/models/(?P<name>[^/:]+)"
    r"(?:/(?:(?P<vkey>versions)/(?P<version>[^/:]+)|(?P<lkey>labels)/(?P<label>[^/:]+)))?"
    r"(?::(?P<method>[^/:]+)|/(?P<sub>metadata))?",
    re.IGNORECASE,
)
_INT64_MAX = 2**63 - 1


@dataclass
class Target:
    name: str
    version: str | None = None
    label: str | None = None
    method: str | None = None  # predict | classify | regress for POST
    metadata: bool = False


def parse_path(method: str, raw_path: str) -> Target:
    malformed = InvalidRequest(f"Malformed request: {method} {raw_path}")
    match = _PATH.fullmatch(raw_path)
    if raw_path.rstrip("/").lower() == "/v1/models" and method == "GET":
        raise ModelRequired("Missing model name in request.")
    if match is None:
        raise malformed
    target = Target(name=unquote(match["name"]))
    if match["vkey"] is not None:
        target.version = match["version"]
        if not target.version.isdigit() or int(target.version) > _INT64_MAX:
            raise InvalidRequest(f"Failed to convert version: {target.version} to numeric.")
    if match["lkey"] is not None:
        target.label = unquote(match["label"])
    if method == "POST":
        if match["method"] not in METHODS:
            raise malformed
        target.method = match["method"]
    elif method == "GET":
        if match["method"] is not None:
            raise malformed
        target.metadata = match["sub"] == "metadata"  # `/METADATA` is a status request, as in TF Serving
    else:
        raise malformed
    return target


def check_status_version(target: Target) -> None:
    """For a status or metadata request: TF Serving's errors for a version or label this server does not have."""
    if target.label is not None:
        raise InvalidRequest(f"Unrecognized servable version label: {target.label}")
    if target.version is not None and int(target.version) != int(VERSION):
        raise NotFound(f"Could not find version {target.version} of model {target.name}")


def check_version(target: Target) -> None:
    """For an inference request: TF Serving's errors for a version or label this server does not have."""
    if target.label is not None:
        raise InvalidRequest(f"Unrecognized servable version label: {target.label}")
    if target.version is not None and int(target.version) != int(VERSION):
        raise NotFound(f"Servable not found for request: Specific({target.name}, {target.version})")


# ---- predict ------------------------------------------------------------------------------------------


def _top_level(doc: object) -> dict:
    if not isinstance(doc, dict):
        raise SchemaViolation(f"JSON Value: {dump(doc)} Is not object")
    signature = doc.get("signature_name", SIGNATURE)
    if not isinstance(signature, str):
        raise SchemaViolation(
            f"JSON Value: {dump(doc)} not formatted correctly. 'signature_name' key must be a string value."
        )
    if signature not in (SIGNATURE, ""):
        raise InvalidRequest(f'Serving signature name: "{signature}" not found in signature def')
    return doc


def _parameters(doc: dict) -> dict:
    params = doc.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise SchemaViolation("'parameters' must be a JSON object")
    return params


def parse_predict(doc: object, signature: ModelSignature, model: str) -> tuple[TensorRequest, str]:
    """(TensorRequest, response key: "predictions" for instances, "outputs" for inputs)."""
    doc = _top_level(doc)
    has_instances, has_inputs = "instances" in doc, "inputs" in doc
    if has_instances and has_inputs:
        raise SchemaViolation(
            f"JSON Value: {dump(doc)} Not formatted correctly expecting only one of 'inputs' or 'instances' "
            "keys to exist "
        )
    if not has_instances and not has_inputs:
        raise SchemaViolation("Missing 'inputs' or 'instances' key")
    if not signature.inputs:
        raise InvalidInput("Failed to get input map for signature: DEFAULT")
    if has_instances:
        instances = doc["instances"]
        if not isinstance(instances, list):
            raise SchemaViolation(f"JSON Value: {dump(doc)} Expecting 'instances' to be an list/array")
        if not instances:
            raise InvalidInput(f"JSON Value: {dump(doc)} No values in 'instances' array")
        arrays, key = tftensor.decode_instances(instances, signature), "predictions"
    else:
        arrays, key = tftensor.decode_inputs(doc["inputs"], signature), "outputs"
    return TensorRequest(inputs=conform(arrays, signature, model), parameters=_parameters(doc)), key


def predict_body(outputs: dict[str, np.ndarray], key: str) -> bytes:
    rendered = tftensor.render_rows(outputs) if key == "predictions" else tftensor.render_columns(outputs)
    return document(key, rendered)


# ---- classify / regress --------------------------------------------------------------------------------


def parse_examples(doc: object, method: str, kind: str, signature: ModelSignature) -> TensorRequest:
    """`examples` (+ optional `context`) to the model's single text input: one row per example.

    Each example's features (merged over the context) must name the model's input; its value is the
    text (a string or `{"b64": ...}`), or a list holding one string.
    """
    doc = _top_level(doc)
    wanted = "classifier" if method == "classify" else "regression"
    if kind != wanted:
        raise InvalidRequest(
            f"Expected {'classification' if method == 'classify' else 'regression'} signature method_name to be "
            f"{METHODS[method]}. Was: {METHODS[method_of(kind)]}"
        )
    if "examples" not in doc:
        raise SchemaViolation(
            f"JSON Value: {dump(doc)} When method is {method}, key 'examples' is expected and was not found"
        )
    examples = doc["examples"]
    if not isinstance(examples, list):
        raise SchemaViolation(f"JSON Value: {dump(doc)} Expecting 'examples' value to be an list/array")
    if not examples:
        raise InvalidInput(f"JSON Value: {dump(doc)} 'examples' value is an empty array")
    context = doc.get("context", {})
    for item in [context, *examples]:
        if not isinstance(item, dict):
            raise InvalidInput(f"Example must be JSON object but got JSON {_json_kind(item)}")
    name = signature.inputs[0].name
    texts = np.empty(len(examples), dtype=object)
    for i, example in enumerate(examples):
        features = {**context, **example}
        if name not in features:
            raise InvalidInput(f"Example {i} has no feature '{name}' (the model's text input)")
        value = features[name]
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not isinstance(value, str) and not tftensor.is_b64(value):
            raise InvalidInput(f"Feature: {name} must hold one string (bytes) value in example {i}")
        texts[i] = tftensor.decode_inputs(value, ModelSignature(inputs=(signature.inputs[0],), outputs=()))[name].item()
    return TensorRequest(inputs={name: texts}, parameters=_parameters(doc))


def _json_kind(value: object) -> str:
    return {list: "Array", str: "String", bool: "True" if value else "False", type(None): "Null"}.get(
        type(value), "Number"
    )


def classify_body(outputs: dict[str, np.ndarray], labels: list[str]) -> bytes:
    probs = np.asarray(outputs["probabilities"], dtype=np.float32)
    if probs.size == 0:
        raise InvalidInput("Cannot convert empty ClassificationResults to JSON")
    results = [[[labels[j] if j < len(labels) else "", float(p)] for j, p in enumerate(row)] for row in probs.tolist()]
    return json.dumps({"results": results}, ensure_ascii=False).encode("utf-8")


def regress_body(outputs: dict[str, np.ndarray]) -> bytes:
    scores = np.asarray(outputs["score"], dtype=np.float32).reshape(-1)
    if scores.size == 0:
        raise InvalidInput("Cannot convert empty RegressionResults to JSON")
    return json.dumps({"results": [float(s) for s in scores.tolist()]}).encode("utf-8")


# ---- status and metadata ----------------------------------------------------------------------------------


def status_body(state: str, error: str | None = None) -> bytes:
    """`state` is AVAILABLE, LOADING or END (a failed load, with its error)."""
    status = {"error_code": "OK" if error is None else "UNKNOWN", "error_message": error or ""}
    body = {"model_version_status": [{"version": VERSION, "state": state, "status": status}]}
    return json.dumps(body, indent=1, ensure_ascii=False).encode("utf-8")


def method_of(kind: str) -> str:
    """The TF method of a model kind's `serving_default` signature."""
    return {"classifier": "classify", "regression": "regress"}.get(kind, "predict")


def metadata_body(name: str, signature: ModelSignature, kind: str) -> bytes:
    method = method_of(kind)

    def tensors(specs):
        return {
            t.name: {
                "dtype": tftensor.TF_DTYPES[t.datatype],
                "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in t.shape], "unknown_rank": False},
                "name": f"{t.name}:0",
            }
            for t in specs
        }

    signature_def = {
        "signature_def": {
            SIGNATURE: {
                "inputs": tensors(signature.inputs),
                "outputs": tensors(signature.outputs),
                "method_name": METHODS[method],
                "defaults": {},
            }
        }
    }
    spec = json.dumps({"name": name, "signature_name": "", "version": VERSION}, indent=1, ensure_ascii=False)
    inner = json.dumps(signature_def, indent=1, ensure_ascii=False)
    return ('{\n"model_spec":' + spec + ',\n"metadata": {"signature_def": ' + inner + "}\n}").encode("utf-8")
