"""SageMaker /invocations content handling: Content-Type parsing, Accept negotiation, records from
JSON / JSON Lines / CSV bodies, responses in the negotiated type, custom attributes.

Supported media types: application/json (also several top-level values = JSON Lines),
application/jsonlines (alias application/jsons), text/csv. A missing Content-Type is JSON. A missing
or `*/*` Accept is SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT when set, else the request's own type (JSON
Lines in = JSON Lines out). Multi-record rule: the n-th output record answers the n-th input record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lmiserve.core.errors import MalformedBody, NotAcceptable, UnsupportedMediaType
from lmiserve.protocols.tensor.codecs import records

JSON, JSONLINES, CSV = "application/json", "application/jsonlines", "text/csv"
SUPPORTED = (JSON, JSONLINES, CSV)
_ALIASES = {"application/jsons": JSONLINES, "application/x-jsonlines": JSONLINES, "application/json-lines": JSONLINES}
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"


@dataclass
class Body:
    media: str  # one of SUPPORTED
    params: dict[str, str]
    text: str


def content_type(header: str | None) -> tuple[str, dict[str, str]]:
    media, params = records.parse_media_type(header)
    media = _ALIASES.get(media, media) or JSON
    return media, params


def read_body(raw: bytes, header: str | None) -> Body:
    media, params = content_type(header)
    if media not in SUPPORTED:
        raise UnsupportedMediaType(f"Unsupported Media Type: {header}. Supported content types: {', '.join(SUPPORTED)}")
    text = records.decode_text(raw, params)
    if not text.strip():
        raise MalformedBody("the request body is empty")
    return Body(media, params, text)


def negotiate(accept: str | None, request_media: str, default: str | None) -> str:
    """The response type: the first supported entry of Accept (parameters and q-values ignored)."""
    if not accept or accept.strip() in ("*/*", ""):
        accept = default or request_media
    for entry in accept.replace(" ", "").split(","):
        media = _ALIASES.get(entry.split(";")[0].lower(), entry.split(";")[0].lower())
        if media in SUPPORTED:
            return media
        if media == "*/*":
            return default if default in SUPPORTED else request_media
    raise NotAcceptable(f"Accept type {accept} is not supported. Please use supported accept types: {list(SUPPORTED)}.")


def custom_attributes(header: str | None) -> dict[str, str]:
    """`tfs-model-name=m,tfs-method=predict` -> {"tfs-model-name": "m", "tfs-method": "predict"}."""
    found = {}
    for part in (header or "").split(","):
        key, sep, value = part.strip().partition("=")
        if sep and key:
            found[key.strip().lower()] = value.strip()
    return found


def is_lmi_document(doc: Any) -> bool:
    """A JSON object with `inputs` (and no TF Serving `instances`/`examples`): LMI's request, LMI's route."""
    return isinstance(doc, dict) and "inputs" in doc and "instances" not in doc and "examples" not in doc


def json_records(body: Body) -> tuple[list, bool, dict]:
    """(records, came as a TF Serving `instances`/`examples` document, parameters) of a JSON or JSON Lines body."""
    values = records.parse_json_values(body.text)
    if len(values) == 1 and body.media == JSON:
        doc = values[0]
        if isinstance(doc, dict) and ("instances" in doc or "examples" in doc):
            return [doc], True, {}
        return (doc if isinstance(doc, list) else [doc]), False, {}
    return values, False, {}


def csv_records(body: Body, text_input: bool) -> list:
    """CSV rows; for a text model each row is its text (a one-column row is the string itself)."""
    rows = records.parse_csv(body.text, records.label_size(body.params), typed=not text_input)
    if text_input:
        return [row[0] if len(row) == 1 else ",".join(row) for row in rows]
    return [row[0] if len(row) == 1 else row for row in rows]


def encode(media: str, preds: list, objects: list[dict]) -> bytes:
    """`preds`: one value per record; `objects`: the same as {output: value} objects (JSON Lines)."""
    if media == JSON:
        return json.dumps({"predictions": preds}, ensure_ascii=False, allow_nan=False).encode("utf-8")
    if media == JSONLINES:
        return records.to_jsonlines(objects)
    return records.to_csv([_csv_row(p) for p in preds])


def _csv_row(prediction: object) -> object:
    if isinstance(prediction, dict):
        row = []
        for value in prediction.values():
            row.extend(_flat(value))
        return row
    return _flat(prediction) if isinstance(prediction, list) else prediction


def _flat(value: object) -> list:
    if isinstance(value, list):
        out = []
        for v in value:
            out.extend(_flat(v))
        return out
    return [value]
