"""KServe V2 infer checks every input against the model's metadata (names, datatypes, shapes, binary
sizes) and answers 400 in Triton's words; the same check guards SageMaker records. Driven with the
unmodified tritonclient and raw HTTP against real `lmiserve serve` processes: the affine TorchScript
model (x FP32 [-1, 4]), a two-input TorchScript model (a FP32 [-1, 2], b INT32 [-1]), MiniLM
(text BYTES [-1]) and the tiny LLM (text_input BYTES [-1])."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from helpers.server import run_server
from helpers.tensor_models import build_pair_torchscript_dir

MISSING_B = (
    "expected 2 inputs but got 1 inputs for model 'pair'. Got input(s) ['a'], "
    "but missing required input(s) ['b']. Please provide all required input(s)."
)


@pytest.fixture(scope="module")
def pair_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = build_pair_torchscript_dir(tmp_path_factory.mktemp("pair") / "pair")
    with run_server(["--model-dir", str(model_dir), "-o", "model_name=pair"]) as url:
        yield url


def client_for(url: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=60.0, connection_timeout=10.0)


def tensor(name: str, array: np.ndarray, datatype: str, *, binary: bool = True) -> triton.InferInput:
    inp = triton.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array, binary_data=binary)
    return inp


def refused(url: str, model: str, inputs: list[triton.InferInput]) -> tuple[str, str]:
    """(status, message) of the InferenceServerException tritonclient raises."""
    with pytest.raises(InferenceServerException) as info:
        client_for(url).infer(model, inputs)
    return info.value.status(), info.value.message()


def post_json(url: str, model: str, inputs: list[dict], **extra) -> tuple[int, dict]:
    import httpx

    r = httpx.post(f"{url}/v2/models/{model}/infer", json={"inputs": inputs, **extra}, timeout=60.0, trust_env=False)
    return r.status_code, r.json()


def post_binary(url: str, model: str, inputs: list[dict], tail: bytes) -> tuple[int, dict]:
    import httpx

    head = json.dumps({"inputs": inputs}).encode()
    r = httpx.post(
        f"{url}/v2/models/{model}/infer",
        content=head + tail,
        headers={"Inference-Header-Content-Length": str(len(head)), "content-type": "application/octet-stream"},
        timeout=60.0,
        trust_env=False,
    )
    return r.status_code, r.json()


X = np.array([[1, 2, 3, 4]], dtype=np.float32)


# ---- names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_an_undeclared_input_is_refused_not_taken_as_the_declared_one(affine_server, binary):
    status, message = refused(affine_server.url, "affine", [tensor("z", X, "FP32", binary=binary)])
    assert (status, message) == ("400", "unexpected inference input 'z' for model 'affine'")
    both = [tensor("x", X, "FP32", binary=binary), tensor("z", X, "FP32", binary=binary)]
    assert refused(affine_server.url, "affine", both) == ("400", "unexpected inference input 'z' for model 'affine'")


def test_several_undeclared_inputs_are_all_named(affine_server):
    row = {"datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    status, body = post_json(affine_server.url, "affine", [{"name": "p", **row}, {"name": "q", **row}])
    assert (status, body) == (400, {"error": "unexpected inference inputs ['p','q'] for model 'affine'"})


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_missing_input_is_named(pair_url, binary):
    a = np.array([[1, 2], [3, 4]], dtype=np.float32)
    assert refused(pair_url, "pair", [tensor("a", a, "FP32", binary=binary)]) == ("400", MISSING_B)
    b = np.array([10, 20], dtype=np.int32)
    result = client_for(pair_url).infer("pair", [tensor("a", a, "FP32", binary=binary), tensor("b", b, "INT32")])
    np.testing.assert_allclose(result.as_numpy("total"), [13.0, 27.0])


def test_the_llm_takes_only_text_input(server):
    prompts = np.array([b"Hello"], dtype=object)
    status, message = refused(server.url, server.name, [tensor("prompt", prompts, "BYTES")])
    assert (status, message) == ("400", f"unexpected inference input 'prompt' for model '{server.name}'")
    status, body = post_json(server.url, server.name, [])
    assert (status, body) == (400, {"error": "the inference request needs a non-empty 'inputs' list"})


def test_an_undeclared_input_is_refused_before_its_data_is_read(minilm_server):
    bad_data = {"name": "sentences", "datatype": "BYTES", "shape": [2], "data": ["only one"]}
    status, body = post_json(minilm_server.url, "minilm", [bad_data])
    assert (status, body) == (400, {"error": "unexpected inference input 'sentences' for model 'minilm'"})


def test_a_request_codec_still_names_the_input_freely(minilm_server):
    """MLServer's StringRequestCodec calls its one input `input-1`; the request content type says so."""
    one = {"name": "input-1", "datatype": "BYTES", "shape": [1, 1], "data": ["a sentence"]}
    status, body = post_json(minilm_server.url, "minilm", [one], parameters={"content_type": "str"})
    assert status == 200 and body["outputs"][0]["shape"] == [1, 384]
    status, body = post_json(minilm_server.url, "minilm", [one])
    assert (status, body) == (400, {"error": "unexpected inference input 'input-1' for model 'minilm'"})


# ---- datatypes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_wrong_datatype_names_input_expected_and_given(pair_url, server, minilm_server, binary):
    a = np.zeros((1, 2), dtype=np.float32)
    inputs = [tensor("a", a, "FP32", binary=binary), tensor("b", np.array([1], dtype=np.int64), "INT64", binary=binary)]
    expected = "inference input 'b' data-type is 'INT64', but model 'pair' expects 'INT32'"
    assert refused(pair_url, "pair", inputs) == ("400", expected)
    numbers = [tensor("text_input", np.array([1.0], dtype=np.float32), "FP32", binary=binary)]
    expected = f"inference input 'text_input' data-type is 'FP32', but model '{server.name}' expects 'BYTES'"
    assert refused(server.url, server.name, numbers) == ("400", expected)
    ints = [tensor("text", np.array([1, 2], dtype=np.int32), "INT32", binary=binary)]
    expected = "inference input 'text' data-type is 'INT32', but model 'minilm' expects 'BYTES'"
    assert refused(minilm_server.url, "minilm", ints) == ("400", expected)


def test_an_mlserver_content_type_allows_a_numeric_cast_but_not_text(affine_server):
    typed = {
        "name": "x",
        "datatype": "FP64",
        "shape": [1, 4],
        "data": [1, 2, 3, 4],
        "parameters": {"content_type": "np"},
    }
    status, body = post_json(affine_server.url, "affine", [typed])
    assert status == 200, body
    text = {"name": "x", "datatype": "BYTES", "shape": [1], "data": ["1"], "parameters": {"content_type": "str"}}
    status, body = post_json(affine_server.url, "affine", [text])
    assert (status, body) == (
        400,
        {"error": "inference input 'x' data-type is 'BYTES', but model 'affine' expects 'FP32'"},
    )


# ---- shapes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "given"),
    [((4,), "[4]"), ((1, 1, 4), "[1,1,4]"), ((2, 3), "[2,3]"), ((1, 8), "[1,8]")],
    ids=["rank-1", "rank-3", "dim-3", "dim-8"],
)
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_wrong_rank_or_dim_names_both_shapes(affine_server, shape, given, binary):
    x = np.zeros(shape, dtype=np.float32)
    expected = f"unexpected shape for input 'x' for model 'affine'. Expected [-1,4], got {given}"
    assert refused(affine_server.url, "affine", [tensor("x", x, "FP32", binary=binary)]) == ("400", expected)


def test_a_wrong_shape_of_the_second_input(pair_url):
    inputs = [tensor("a", np.zeros((1, 3), np.float32), "FP32"), tensor("b", np.zeros(1, np.int32), "INT32")]
    expected = "unexpected shape for input 'a' for model 'pair'. Expected [-1,2], got [1,3]"
    assert refused(pair_url, "pair", inputs) == ("400", expected)


def test_n_and_n_by_1_are_the_same_rows(minilm_server):
    column = {"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": ["a cat", "a dog"]}
    status, body = post_json(minilm_server.url, "minilm", [column])
    assert status == 200 and body["outputs"][0]["shape"] == [2, 384]


def test_json_data_must_fill_the_shape(affine_server):
    short = {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [1, 2, 3, 4]}
    status, body = post_json(affine_server.url, "affine", [short])
    expected = "shape does not match data for input 'x': shape [2, 4] needs 8 elements, got 4"
    assert (status, body) == (400, {"error": expected})


# ---- binary tensor data extension --------------------------------------------------------------------


def test_a_binary_size_that_does_not_fit_the_shape(affine_server):
    declared = {"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 12}}
    status, body = post_binary(affine_server.url, "affine", [declared], b"\x00" * 12)
    expected = "input byte size mismatch for input 'x' for model 'affine'. Expected 16, got 12"
    assert (status, body) == (400, {"error": expected})


def test_a_binary_size_beyond_the_body(affine_server):
    declared = {"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}
    status, body = post_binary(affine_server.url, "affine", [declared], b"\x00" * 10)
    expected = "unexpected size for input 'x', expecting 6 additional bytes for model 'affine'"
    assert (status, body) == (400, {"error": expected})


def test_binary_bytes_with_fewer_elements_than_the_shape(minilm_server):
    raw = struct.pack("<I", 5) + b"hello"
    declared = {"name": "text", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(raw)}}
    status, body = post_binary(minilm_server.url, "minilm", [declared], raw)
    expected = "unexpected number of string elements 1 for inference input 'text' for model 'minilm', expecting 2"
    assert (status, body) == (400, {"error": expected})


def test_binary_bytes_left_unclaimed(affine_server):
    declared = {"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}
    status, body = post_binary(affine_server.url, "affine", [declared], b"\x00" * 20)
    expected = (
        "unexpected additional input data for model 'affine': 4 bytes are not claimed by any input's 'binary_data_size'"
    )
    assert (status, body) == (400, {"error": expected})


# ---- metadata agrees with the checks ---------------------------------------------------------------------


def test_metadata_is_what_the_checks_enforce(pair_url, server):
    meta = client_for(pair_url).get_model_metadata("pair")
    assert meta["inputs"] == [
        {"name": "a", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "b", "datatype": "INT32", "shape": [-1]},
    ]
    llm = client_for(server.url).get_model_metadata(server.name)
    assert llm["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]


# ---- the same check on the other tensor protocols -------------------------------------------------------


def test_sagemaker_records_refuse_an_undeclared_key(affine_server):
    r = affine_server.post([{"bogus": [1, 2, 3, 4]}])
    assert r.status_code == 400
    assert r.json() == {"error": "unexpected inference input 'bogus' for model 'affine'"}
    tf = affine_server.post({"instances": [{"bogus": [1, 2, 3, 4]}]})  # a TF Serving document: its words
    assert tf.status_code == 400
    assert tf.json() == {
        "error": "Failed to process element: 0 key: bogus of 'instances' list. "
        "Error: INVALID_ARGUMENT: JSON object: does not have named input: bogus"
    }
    ok = affine_server.post([{"x": [1, 2, 3, 4]}, {"features": [1, 2, 3, 4]}])
    assert ok.status_code == 200, ok.text
