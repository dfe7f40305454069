"""MLServer's request codecs, run with .venv-mlserver's python (mlserver cannot live in lmiserve's venv).

    python mlserver_codec.py encode numpy  '{"data": [[1, 2, 3, 4]], "dtype": "float32"}'  -> request JSON
    python mlserver_codec.py encode string '["hello", "world"]'                          -> request JSON
    python mlserver_codec.py encode pandas '{"text": ["a", "b"]}'                          -> request JSON
    python mlserver_codec.py decode numpy|string|pandas  < response JSON                   -> decoded JSON

Decoded values: numpy -> {"dtype", "shape", "data"}; string -> list of str; pandas -> {"columns":
[...], "dtypes": [...], "rows": [[...], ...]} (NaN -> null).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pandas as pd
from mlserver.codecs import NumpyRequestCodec, PandasCodec, StringRequestCodec
from mlserver.types import InferenceResponse

CODECS = {"numpy": NumpyRequestCodec, "string": StringRequestCodec, "pandas": PandasCodec}


def encode(kind: str, payload: str) -> str:
    value = json.loads(payload)
    if kind == "numpy":
        request = NumpyRequestCodec.encode_request(np.array(value["data"], dtype=value["dtype"]))
    elif kind == "string":
        request = StringRequestCodec.encode_request(value, use_bytes=False)
    else:
        request = PandasCodec.encode_request(pd.DataFrame(value), use_bytes=False)
    return request.model_dump_json(exclude_none=True)


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def decode(kind: str, response: str) -> str:
    decoded = CODECS[kind].decode_response(InferenceResponse.model_validate_json(response))
    if kind == "numpy":
        out = {"dtype": str(decoded.dtype), "shape": list(decoded.shape), "data": _plain(decoded)}
    elif kind == "string":
        out = _plain(decoded)
    else:
        out = {
            "columns": list(decoded.columns),
            "dtypes": [str(t) for t in decoded.dtypes],
            "rows": _plain(decoded.values.tolist()),
        }
    return json.dumps(out)


if __name__ == "__main__":
    action, kind = sys.argv[1], sys.argv[2]
    if action == "encode":
        print(encode(kind, sys.argv[3]))
    else:
        print(decode(kind, sys.stdin.read()))
