"""tritonclient.http, unmodified, against real `lmiserve serve` processes: FP32 / INT64 / BYTES inputs in
binary and JSON modes, outputs in both modes, metadata, readiness, and errors raised as the client's
InferenceServerException (every non-200 is JSON with an `error`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from helpers.int_model import build_int_torchscript_dir
from helpers.server import run_server
from helpers.tensor_models import affine_reference


def client_for(url: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=60.0, connection_timeout=10.0)


@pytest.fixture(scope="module")
def int_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = build_int_torchscript_dir(tmp_path_factory.mktemp("doubler") / "doubler")
    with run_server(["--model-dir", str(model_dir), "-o", "model_name=doubler"]) as url:
        yield url


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_fp32_in_fp32_and_int64_out(affine_server, binary):
    client = client_for(affine_server.url)
    x = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [-1, 0.5, 0, 2]], dtype=np.float32)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [
        triton.InferRequestedOutput("best", binary_data=binary),
        triton.InferRequestedOutput("y", binary_data=binary),
    ]
    result = client.infer("affine", [inp], outputs=outputs, request_id="r-1")
    y, best = affine_reference(x)
    np.testing.assert_allclose(result.as_numpy("y"), y, rtol=1e-6)
    assert result.as_numpy("best").dtype == np.int64
    np.testing.assert_array_equal(result.as_numpy("best"), best)
    response = result.get_response()
    assert response["id"] == "r-1" and [o["name"] for o in response["outputs"]] == ["best", "y"]


def test_no_requested_outputs_means_all_binary(affine_server):
    client = client_for(affine_server.url)
    x = np.ones((1, 4), dtype=np.float32)
    inp = triton.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("affine", [inp])
    assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
    np.testing.assert_allclose(result.as_numpy("y"), affine_reference(x)[0], rtol=1e-6)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_int64_input(int_url, binary):
    client = client_for(int_url)
    ids = np.array([[1, -2, 3], [2**40, 0, 7]], dtype=np.int64)
    inp = triton.InferInput("ids", list(ids.shape), "INT64")
    inp.set_data_from_numpy(ids, binary_data=binary)
    outputs = [
        triton.InferRequestedOutput("doubled", binary_data=binary),
        triton.InferRequestedOutput("total", binary_data=binary),
    ]
    result = client.infer("doubler", [inp], outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("doubled"), ids * 2)
    np.testing.assert_allclose(result.as_numpy("total"), ids.sum(axis=1).astype(np.float64))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_embeddings(minilm_server, binary):
    client = client_for(minilm_server.url)
    texts = np.array(
        ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply today."], dtype=object
    )
    inp = triton.InferInput("text", [3], "BYTES")
    inp.set_data_from_numpy(texts, binary_data=binary)
    result = client.infer("minilm", [inp], outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)])
    emb = result.as_numpy("embedding")
    assert emb.shape == (3, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)  # normalized, as its config says
    similar, unrelated = float(emb[0] @ emb[1]), float(emb[0] @ emb[2])
    assert similar > unrelated + 0.3


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_prompts_to_the_llm(server, binary):
    client = client_for(server.url)
    prompts = np.array([b"Hello there", b"The quick brown fox"], dtype=object)
    inp = triton.InferInput("text_input", [2], "BYTES")
    inp.set_data_from_numpy(prompts, binary_data=binary)
    params = {"max_new_tokens": 5}
    result = client.infer(
        server.name, [inp], outputs=[triton.InferRequestedOutput("text_output", binary_data=binary)], parameters=params
    )
    texts = result.as_numpy("text_output")
    assert texts.shape == (2,)
    expected = [
        server.generate(p.decode(), max_new_tokens=5)["generated_text"] for p in prompts
    ]  # greedy: same text as LMI
    assert [t.decode() if isinstance(t, bytes) else t for t in texts] == expected


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(affine_server, algorithm):
    client = client_for(affine_server.url)
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    inp = triton.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(
        "affine", [inp], request_compression_algorithm=algorithm, response_compression_algorithm=algorithm
    )
    np.testing.assert_allclose(result.as_numpy("y"), affine_reference(x)[0], rtol=1e-6)


def test_metadata_and_readiness(affine_server, minilm_server):
    client = client_for(affine_server.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("affine") and client.is_model_ready("affine", "1")
    assert not client.is_model_ready("nope")
    meta = client.get_model_metadata("affine")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert [o["name"] for o in meta["outputs"]] == ["y", "best"]
    assert client.get_server_metadata()["name"] == "lmiserve"
    assert client.get_model_repository_index() == [{"name": "affine", "version": "1", "state": "READY", "reason": ""}]
    emb = client_for(minilm_server.url).get_model_metadata("minilm")
    assert emb["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert emb["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]


def test_errors_reach_the_client(affine_server):
    client = client_for(affine_server.url)
    inp = triton.InferInput("x", [1, 3], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("affine", [inp])
    assert info.value.status() == "400"
    assert info.value.message() == "unexpected shape for input 'x' for model 'affine'. Expected [-1,4], got [1,3]"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "404"
    wrong = triton.InferInput("x", [1, 4], "FP64")
    wrong.set_data_from_numpy(np.zeros((1, 4), dtype=np.float64))
    with pytest.raises(InferenceServerException, match="data-type is 'FP64', but model 'affine' expects 'FP32'"):
        client.infer("affine", [wrong])
    with pytest.raises(InferenceServerException, match="unexpected inference output 'z'"):
        good = triton.InferInput("x", [1, 4], "FP32")
        good.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
        client.infer("affine", [good], outputs=[triton.InferRequestedOutput("z")])
