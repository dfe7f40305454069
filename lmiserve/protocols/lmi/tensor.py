"""LMI's JSON (`/invocations`, `/predictions/{m}`, `/models/{m}/invoke`) for one-shot tensor models.

Request: `{"inputs": "text" | ["text", ...], "parameters": {...}}` for text models (embedding,
classifier, regression); for a TorchScript model `{"inputs": <nested list>}` (its single input) or
`{"inputs": {"<input name>": <nested list>, ...}}`.

Answer, one entry per input row:
- embedding: `[[float, ...], ...]`;
- classifier: `[{"label": "positive", "score": 0.93}, ...]` (score = the label's probability);
- regression: `[{"score": 0.12}, ...]`;
- torchscript: `{"<output name>": <nested list>, ...}`.
"""

from __future__ import annotations

import numpy as np

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.tensors import TensorRequest

PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "


def to_tensor_request(payload, model) -> TensorRequest:
    """An LMI payload -> the TensorRequest of `model` (a TensorModel); InvalidRequest (424) if malformed."""
    if not isinstance(payload, dict) or payload.get("inputs") is None:
        raise InvalidRequest(PREFIX + "Request payload should be a json object specifying the 'inputs' field.")
    parameters = payload.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidRequest(PREFIX + "'parameters' must be provided as an object of key-value pairs.")
    inputs = payload["inputs"]
    if model.kind == "torchscript":
        return TensorRequest(_numeric_inputs(inputs, model), parameters=parameters)
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise InvalidRequest(PREFIX + "The 'inputs' field must be a non-empty string or a list of non-empty strings.")
    column = np.empty(len(texts), dtype=object)
    column[:] = [t.encode("utf-8") for t in texts]
    return TensorRequest({model.signature.inputs[0].name: column}, parameters=parameters)


def to_json(kind: str, outputs: dict[str, np.ndarray]):
    """The model's output tensors -> LMI's JSON answer for its kind (see the module docstring)."""
    if kind == "embedding":
        return outputs["embedding"].tolist()
    if kind == "classifier":
        probs = outputs["probabilities"]
        return [
            {"label": label.decode("utf-8"), "score": float(row.max())} for label, row in zip(outputs["label"], probs)
        ]
    if kind == "regression":
        return [{"score": float(s)} for s in outputs["score"]]
    return {name: _plain(value) for name, value in outputs.items()}


def _numeric_inputs(inputs, model) -> dict[str, np.ndarray]:
    specs = {s.name: s for s in model.signature.inputs}
    named = inputs if isinstance(inputs, dict) else {model.signature.inputs[0].name: inputs}
    out = {}
    for name, value in named.items():
        if name not in specs:
            raise InvalidRequest(PREFIX + f"unknown input '{name}': this model takes {', '.join(specs)}")
        try:
            array = np.array(value)
        except ValueError:
            raise InvalidRequest(PREFIX + f"input '{name}' is not a rectangular array (ragged nested lists)") from None
        if array.dtype == object or array.dtype.kind not in "biuf":
            raise InvalidRequest(PREFIX + f"input '{name}' must be numbers in (nested) lists")
        out[name] = array
    return out


def _plain(value: np.ndarray):
    if value.dtype == object:
        return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value.reshape(-1)]
    return value.tolist()
