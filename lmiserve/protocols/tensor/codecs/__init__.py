"""Tensors <-> wire values for the tensor protocols (no HTTP here).

- `datatypes`: V2 datatype names <-> numpy dtypes, nested/flat `data` <-> arrays, shape checks;
- `binary`: Triton's binary tensor data extension (request split, response layout, BYTES framing);
- `content_types`: MLServer content types (np, str, base64, datetime, pd, pd_json);
- `tfjson` / `tftensor`: TF Serving JSON (NaN/Infinity tokens, float formatting, row/columnar tensors);
- `records`: SageMaker CSV (RFC-4180) and JSON Lines records.

Codecs raise the neutral errors of `lmiserve.core.errors` (InvalidInput, MalformedBody, ...); each
protocol's renderer gives them a status and a body.
"""
