"""MLServer's request codecs (NumpyRequestCodec, StringRequestCodec, PandasCodec), unmodified, encode
requests for real `lmiserve serve` processes and decode the responses back. mlserver lives in
.venv-mlserver (`make install-mlserver`); tests/helpers/mlserver_codec.py runs there as a subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers.tensor_models import affine_reference

pytestmark = pytest.mark.e2e  # the slowest tier: MLServer's codecs run in their own venv

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-mlserver" / "bin" / "python"
SCRIPT = REPO / "tests" / "helpers" / "mlserver_codec.py"


def codec(action: str, kind: str, payload: str) -> dict | list:
    if not PYTHON.is_file():
        raise RuntimeError(f"{PYTHON} is missing: run `make install-mlserver`")
    args = [str(PYTHON), str(SCRIPT), action, kind] + ([payload] if action == "encode" else [])
    done = subprocess.run(
        args, input=payload if action == "decode" else None, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def infer(server, model: str, request: dict):
    response = server.post(request, path=f"/v2/models/{model}/infer")
    assert response.status_code == 200, response.text
    return response


def test_numpy_request_codec_round_trip(affine_server):
    x = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 2.0, 0.0]]
    request = codec("encode", "numpy", json.dumps({"data": x, "dtype": "float32"}))
    assert request["inputs"][0]["name"] == "input-1"
    response = infer(affine_server, "affine", request)
    assert response.json()["parameters"] == {"content_type": "np"}
    # NumpyRequestCodec decodes the response's single output: ask for `y` only
    only_y = {**request, "outputs": [{"name": "y"}]}
    decoded = codec("decode", "numpy", infer(affine_server, "affine", only_y).text)
    assert decoded["dtype"] == "float32" and decoded["shape"] == [2, 2]
    np.testing.assert_allclose(decoded["data"], affine_reference(np.array(x))[0], rtol=1e-6)


def test_numpy_codec_float64_is_cast_for_the_model(affine_server):
    request = codec("encode", "numpy", json.dumps({"data": [[1, 2, 3, 4]], "dtype": "float64"}))
    request["outputs"] = [{"name": "best"}]
    decoded = codec("decode", "numpy", infer(affine_server, "affine", request).text)
    assert decoded == {"dtype": "int64", "shape": [1], "data": [1]}


def test_string_request_codec_to_the_llm(server):
    prompts = ["Hello there", "Once upon a time"]
    request = codec("encode", "string", json.dumps(prompts))
    request["parameters"]["max_new_tokens"] = 4
    decoded = codec("decode", "string", infer(server, server.name, request).text)
    assert decoded == [server.generate(p, max_new_tokens=4)["generated_text"] for p in prompts]


def test_string_codec_in_numpy_codec_out_for_embeddings(minilm_server):
    request = codec("encode", "string", json.dumps(["first sentence", "second one"]))
    decoded = codec("decode", "numpy", infer(minilm_server, "minilm", request).text)
    assert decoded["dtype"] == "float32" and decoded["shape"] == [2, 384]
    np.testing.assert_allclose(np.linalg.norm(np.array(decoded["data"]), axis=1), 1.0, atol=1e-4)


def test_pandas_codec_round_trip(affine_server, minilm_server):
    frame = {"a": [1.0, 5.0], "b": [2.0, 6.0], "c": [3.0, 7.0], "d": [4.0, 8.0]}
    request = codec("encode", "pandas", json.dumps(frame))
    decoded = codec("decode", "pandas", infer(affine_server, "affine", request).text)
    assert decoded["columns"] == ["y", "best"]
    y, best = affine_reference(np.array(list(frame.values())).T)
    assert [row[1] for row in decoded["rows"]] == best.tolist()
    np.testing.assert_allclose([row[0] for row in decoded["rows"]], y, rtol=1e-6)  # pd_json rows decode to lists
    text = codec("encode", "pandas", json.dumps({"text": ["a cat", "a dog"]}))
    decoded = codec("decode", "pandas", infer(minilm_server, "minilm", text).text)
    assert decoded["columns"] == ["embedding"] and len(decoded["rows"][0][0]) == 384
