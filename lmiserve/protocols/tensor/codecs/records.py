"""SageMaker record formats: RFC-4180 CSV (with `label_size`), JSON Lines, JSON bodies holding several
top-level values; and the encoders back to CSV / JSON Lines / JSON.

CSV: `\\r` stripped, empty lines skipped, `"` quoting with `""` escapes, the first `label_size` columns
dropped, empty fields -> NaN; a record whose fields are all numbers is numeric, otherwise text.
"""

from __future__ import annotations

import csv
import io
import json
import math

from lmiserve.core import jsondoc
from lmiserve.core.errors import InvalidInput, InvalidRequest, MalformedBody


def parse_media_type(header: str | None) -> tuple[str, dict[str, str]]:
    """`text/csv; label_size=1; charset=utf-8` -> ("text/csv", {"label_size": "1", "charset": "utf-8"})."""
    if not header:
        return "", {}
    media, *params = header.split(";")
    parsed = {}
    for param in params:
        key, _, value = param.partition("=")
        if key.strip():
            parsed[key.strip().lower()] = value.strip().strip('"')
    return media.strip().lower(), parsed


def decode_text(body: bytes, params: dict[str, str]) -> str:
    charset = params.get("charset", "utf-8")
    try:
        return jsondoc.text_of(body.decode(charset))
    except (LookupError, ValueError) as exc:  # an unknown codec, bytes it cannot decode, lone surrogates
        raise MalformedBody(f"the request body is not valid {charset} text: {exc}") from None


def parse_csv(text: str, label_size: int = 0, typed: bool = True) -> list[list]:
    """CSV records: lists of floats (or of strings when a field is not a number, or `typed` is False)."""
    lines = [line for line in text.replace("\r", "").split("\n") if line.strip()]
    try:
        rows = list(csv.reader(lines, strict=True))
    except csv.Error as exc:
        raise MalformedBody(f"invalid CSV: {exc}") from None
    records = []
    for row in rows:
        fields = row[label_size:]
        if not fields:
            raise InvalidInput(f"CSV record has no feature columns after dropping label_size={label_size} columns")
        records.append(_typed(fields) if typed else fields)
    if not records:
        raise InvalidInput("the CSV body holds no records")
    return records


def _typed(fields: list[str]) -> list:
    numbers = []
    for field in fields:
        text = field.strip()
        if not text:
            numbers.append(math.nan)
            continue
        try:
            numbers.append(float(text))
        except ValueError:
            return fields
    return numbers


def label_size(params: dict[str, str]) -> int:
    raw = params.get("label_size", "0")
    if not raw.isdigit():
        raise InvalidRequest(f"invalid label_size parameter: {raw!r} (expected a non-negative integer)")
    return int(raw)


def parse_json_values(text: str) -> list:
    """All top-level JSON values of a body (one for plain JSON, several for JSON Lines)."""
    try:
        values = jsondoc.all_values(text)
    except jsondoc.JsonSyntaxError as exc:
        raise MalformedBody(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except jsondoc.JsonError as exc:
        raise MalformedBody(f"invalid JSON: {exc}") from None
    if not values:
        raise MalformedBody("the request body is empty")
    return values


def _csv_value(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def to_csv(records: list) -> bytes:
    """One line per record: a list -> its fields, a scalar -> one field; RFC-4180 quoting, `\\n` endings."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for record in records:
        if isinstance(record, dict):
            record = list(record.values())
        fields = record if isinstance(record, list) else [record]
        writer.writerow([_csv_value(v) for v in fields])
    return out.getvalue().encode("utf-8")


def to_jsonlines(records: list) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n" for r in records)
