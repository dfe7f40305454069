"""The Open Inference Protocol over gRPC (`--grpc-port`) on real servers, through real clients:
`tritonclient.grpc` (unmodified; its stub too, for requests its helpers would not build) and KServe's
`InferenceGRPCClient` (in .venv-kserve, tests/helpers/kserve_client.py).

One server for the module (`served`): a store of the LLM (`tiny`: the tiny model with an endless
context, so a generation runs as long as a test needs) and the TorchScript affine model, with an API
key and a small `max_request_size`; its gRPC answers are compared with its REST answers. The drain and
a gRPC port in use need processes of their own (the e2e tier, as tests/integration/test_signals.py).
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from helpers.serve_process import HANG_TIMEOUT, ServeProcess
from helpers.server import REPO_ROOT, free_port, on_a_free_port, run_server
from helpers.tensor_models import affine_reference
from helpers.tiny_model import ENDLESS_CONTEXT
from helpers.waiting import wait_until

KEY = "grpc-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_REQUEST = 64 * 1024  # bytes: max_request_size, grpc's largest message received
PROMPT = "Hello there"
ENDLESS = ENDLESS_CONTEXT - 64  # max_tokens of a generation that runs until its client leaves
TIMEOUT = 60.0  # seconds any one call may take (a hang guard)
KSERVE_PYTHON = REPO_ROOT / ".venv-kserve" / "bin" / "python"
KSERVE_SCRIPT = REPO_ROOT / "tests" / "helpers" / "kserve_client.py"


@dataclass
class Served:
    url: str  # REST
    address: str  # gRPC, host:port
    http: httpx.Client  # REST with the key

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(self.address)

    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(self.address))

    def engine_metrics(self) -> dict[str, float]:
        """The LLM's engine samples on /metrics, by name."""
        response = self.http.get("/metrics")
        assert response.status_code == 200, response.text
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
            if sample.labels == {"model_name": "tiny", "engine": "0"}
        }


@pytest.fixture(scope="module")
def served(
    endless_model_dir: Path, torchscript_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    store = tmp_path_factory.mktemp("grpc-store")
    (store / "tiny").symlink_to(endless_model_dir, target_is_directory=True)
    (store / "affine").symlink_to(torchscript_dir, target_is_directory=True)
    args = ["--model-store", str(store), "--api-key", KEY]
    for option in (f"max_new_tokens_limit={ENDLESS_CONTEXT}", f"max_request_size={MAX_REQUEST}", "kv_cache=paged"):
        args += ["-o", option]
    with contextlib.ExitStack() as stack:
        url, port = on_a_free_port(lambda grpc: stack.enter_context(run_server([*args, "--grpc-port", str(grpc)])))
        http = stack.enter_context(httpx.Client(base_url=url, headers=AUTH, timeout=TIMEOUT, trust_env=False))
        yield Served(url, f"127.0.0.1:{port}", http)


def text_input(*prompts: str) -> triton.InferInput:
    tensor = triton.InferInput("text_input", [len(prompts)], "BYTES")
    tensor.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=object))
    return tensor


def scalar(name: str, value: Any, datatype: str, dtype: Any) -> triton.InferInput:
    tensor = triton.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=dtype))
    return tensor


def rest_generate(served: Served, prompt: str, max_tokens: int) -> str:
    response = served.http.post(
        "/v2/models/tiny/generate", json={"text_input": prompt, "parameters": {"max_tokens": max_tokens}}
    )
    assert response.status_code == 200, response.text
    return response.json()["text_output"]


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status())


# ---- health, metadata, the repository index ----------------------------------------------------------


def test_health_metadata_and_index(served: Served):
    client = served.client()
    assert client.is_server_live() and client.is_server_ready()  # health probes need no key, as REST's
    assert client.is_model_ready("tiny") and client.is_model_ready("affine", "1")
    server = client.get_server_metadata(headers=AUTH)
    assert (server.name, server.version) == ("lmiserve", "0.1.0")
    assert list(server.extensions) == ["binary_tensor_data", "parameters", "generate"]
    meta = client.get_model_metadata("affine", headers=AUTH, as_json=True)
    rest = served.http.get("/v2/models/affine").json()
    assert meta["name"] == rest["name"] == "affine" and meta["platform"] == rest["platform"]
    assert meta["versions"] == rest["versions"] == ["1"]
    for side in ("inputs", "outputs"):  # protobuf's JSON writes int64 as strings
        assert [{**t, "shape": [int(d) for d in t["shape"]]} for t in meta[side]] == rest[side]
    index = client.get_model_repository_index(headers=AUTH, as_json=True)
    assert sorted(m["name"] for m in index["models"]) == ["affine", "tiny"]
    assert {m["state"] for m in index["models"]} == {"READY"}


# ---- ModelInfer ----------------------------------------------------------------------------------------


def test_infer_on_the_llm_matches_rest(served: Served):
    """Binary (raw) BYTES prompts in and out; max_tokens as a parameter or as an INT32 input tensor
    (TensorRT-LLM's and litellm's way), honoured both ways: the texts of REST's greedy generate."""
    client = served.client()
    prompts = (PROMPT, "The quick brown fox")
    expected = [rest_generate(served, p, 6) for p in prompts]
    result = client.infer("tiny", [text_input(*prompts)], parameters={"max_tokens": 6}, headers=AUTH)
    assert [t.decode() for t in result.as_numpy("text_output")] == expected
    assert result.get_response().raw_output_contents  # answered raw, as asked
    tensors = [
        text_input(*prompts),
        scalar("max_tokens", 6, "INT32", np.int32),
        scalar("temperature", 0.0, "FP32", np.float32),
    ]
    result = client.infer("tiny", tensors, headers=AUTH, outputs=[triton.InferRequestedOutput("text_output")])
    assert [t.decode() for t in result.as_numpy("text_output")] == expected


def test_infer_on_a_tensor_model(served: Served):
    client = served.client()
    x = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [-1, 0.5, 0, 2]], dtype=np.float32)
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    outputs = [triton.InferRequestedOutput("best"), triton.InferRequestedOutput("y")]
    result = client.infer("affine", [tensor], outputs=outputs, request_id="r-1", headers=AUTH)
    y, best = affine_reference(x)
    np.testing.assert_allclose(result.as_numpy("y"), y, rtol=1e-6)
    assert result.as_numpy("best").dtype == np.int64
    np.testing.assert_array_equal(result.as_numpy("best"), best)
    response = result.get_response()
    assert response.id == "r-1" and [o.name for o in response.outputs] == ["best", "y"]


def test_typed_contents_in_typed_contents_out(served: Served):
    """KServe's typed contents (no raw_input_contents) are answered in typed contents."""
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    request = pb.ModelInferRequest(model_name="affine", id="t-1")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(x.reshape(-1).tolist())
    response = served.stub().ModelInfer(request, metadata=list(AUTH.items()), timeout=TIMEOUT)
    assert not response.raw_output_contents
    by_name = {o.name: o for o in response.outputs}
    y, best = affine_reference(x)
    np.testing.assert_allclose(by_name["y"].contents.fp32_contents, y.reshape(-1), rtol=1e-6)
    assert list(by_name["best"].contents.int64_contents) == best.tolist()
    assert (by_name["y"].datatype, list(by_name["y"].shape)) == ("FP32", [1, 2])


# ---- ModelStreamInfer ------------------------------------------------------------------------------------


class Stream:
    """A tritonclient stream whose callback results land in a queue."""

    def __init__(self, client: triton.InferenceServerClient, headers: dict[str, str] | None = AUTH):
        self.client = client
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(lambda result, error: self.results.put((result, error)), headers=headers)

    def next(self) -> tuple[Any, Any]:
        return self.results.get(timeout=TIMEOUT)

    def pieces(self) -> list[str]:
        """The text of one request's responses up to its final one (failing on an error)."""
        out = []
        while True:
            result, error = self.next()
            assert error is None, error
            response = result.get_response()
            out.append(result.as_numpy("text_output")[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                return out


def test_streamed_generation_matches_rest_generate_stream(served: Served):
    response = served.http.post("/v2/models/tiny/generate_stream", json={"text_input": PROMPT, "max_tokens": 12})
    assert response.status_code == 200, response.text
    rest = [json.loads(line[len("data: ") :])["text_output"] for line in response.text.split("\n\n") if line]
    client = served.client()
    stream = Stream(client)
    try:
        stream.client.async_stream_infer(
            "tiny", [text_input(PROMPT), scalar("max_tokens", 12, "INT32", np.int32)], request_id="g-1"
        )
        pieces = stream.pieces()
        # the same settings as parameters, and the whole text at once with stream: false
        client.async_stream_infer("tiny", [text_input(PROMPT)], parameters={"max_tokens": 12, "stream": False})
        whole = stream.pieces()
    finally:
        client.stop_stream()
    assert pieces[:-1] + ([pieces[-1]] if pieces[-1] else []) == rest  # the last may be "" (a token without text)
    assert whole == ["".join(rest)]


def test_a_cancelled_stream_frees_its_kv_blocks(served: Served):
    client = served.client()
    stream = Stream(client)
    settings = [scalar("max_tokens", ENDLESS, "INT32", np.int32), scalar("ignore_eos", True, "BOOL", np.bool_)]
    client.async_stream_infer("tiny", [text_input(PROMPT), *settings])
    for _ in range(3):  # it generates
        _, error = stream.next()
        assert error is None, error
    running = served.engine_metrics()
    assert running["vllm:num_requests_running"] == 1 and running["vllm:kv_cache_usage_perc"] > 0, running
    client.stop_stream(cancel_requests=True)
    wait_until(
        lambda: (m := served.engine_metrics())["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0,
        "the cancelled generation leaves the batch and frees its blocks",
        timeout=TIMEOUT,
    )


# ---- the API key, sizes, malformed requests --------------------------------------------------------------


@pytest.mark.parametrize(
    "headers", [None, {"authorization": "Bearer wrong"}, {"authorization": KEY}], ids=["none", "wrong", "no-bearer"]
)
def test_the_api_key(served: Served, headers):
    client = served.client()
    calls = {
        "ServerMetadata": lambda: client.get_server_metadata(headers=headers),
        "ModelMetadata": lambda: client.get_model_metadata("tiny", headers=headers),
        "RepositoryIndex": lambda: client.get_model_repository_index(headers=headers),
        "ModelInfer": lambda: client.infer("tiny", [text_input(PROMPT)], headers=headers),
    }
    for name, call in calls.items():
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert code_of(refused.value) == "StatusCode.UNAUTHENTICATED", name
        assert "missing or wrong API key" in refused.value.message(), name
    stream = Stream(client, headers)  # the whole stream is refused at once, before any request
    try:
        result, error = stream.next()
        assert result is None and code_of(error) == "StatusCode.UNAUTHENTICATED", error
    finally:
        client.stop_stream()
    assert client.is_server_live(headers=headers) and client.is_model_ready("tiny", headers=headers)


def test_an_oversize_message_is_resource_exhausted(served: Served):
    client = served.client()
    x = np.zeros((MAX_REQUEST // 16 + 1, 4), dtype=np.float32)  # just over max_request_size
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("affine", [tensor], headers=AUTH)
    assert code_of(refused.value) == "StatusCode.RESOURCE_EXHAUSTED", refused.value
    fits = np.zeros((8, 4), dtype=np.float32)
    tensor = triton.InferInput("x", list(fits.shape), "FP32")
    tensor.set_data_from_numpy(fits)
    assert client.infer("affine", [tensor], headers=AUTH).as_numpy("y").shape == (8, 2)


def _infer_request(model: str = "affine", **fields: Any) -> Any:
    request = pb.ModelInferRequest(model_name=model, **fields)
    return request


def _fp32_input(request: Any, name: str = "x", shape: tuple[int, ...] = (1, 4), values: int = 4) -> None:
    request.inputs.add(name=name, datatype="FP32", shape=list(shape)).contents.fp32_contents.extend([1.0] * values)


def _malformed_infer_requests() -> list[tuple[str, Any, str, str]]:
    """(case, request, status code, the message or its start): REST's words for REST's checks."""
    cases = []
    r = _infer_request()
    r.inputs.add(name="x", datatype="FP99", shape=[1, 4])
    cases.append(("datatype", r, "INVALID_ARGUMENT", "invalid datatype for input x"))
    r = _infer_request()
    _fp32_input(r, values=3)
    cases.append(
        (
            "count",
            r,
            "INVALID_ARGUMENT",
            "shape does not match data for input 'x': shape [1, 4] needs 4 elements, got 3",
        )
    )
    r = _infer_request()
    _fp32_input(r, name="z")
    cases.append(("undeclared", r, "INVALID_ARGUMENT", "unexpected inference input 'z' for model 'affine'"))
    r = _infer_request()
    cases.append(("no-inputs", r, "INVALID_ARGUMENT", "the inference request needs a non-empty 'inputs' list"))
    r = _infer_request()
    r.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.int_contents.extend([1, 2, 3, 4])
    cases.append(
        ("field", r, "INVALID_ARGUMENT", "input 'x' is FP32: its elements go in 'fp32_contents', not 'int_contents'")
    )
    r = _infer_request()
    r.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    r.raw_input_contents.extend([b"\0" * 16, b"\0" * 16])
    cases.append(
        (
            "raw-count",
            r,
            "INVALID_ARGUMENT",
            "expected 1 elements in raw_input_contents (one per input) but got 2 for model 'affine'",
        )
    )
    r = _infer_request()
    r.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    r.raw_input_contents.append(b"\0" * 12)
    cases.append(
        (
            "raw-size",
            r,
            "INVALID_ARGUMENT",
            "input byte size mismatch for input 'x' for model 'affine'. Expected 16, got 12",
        )
    )
    r = _infer_request()
    _fp32_input(r)
    r.outputs.add(name="nope")
    cases.append(("output", r, "INVALID_ARGUMENT", "unexpected inference output 'nope' for model 'affine'"))
    r = _infer_request(model="nope")
    cases.append(("model", r, "NOT_FOUND", "Model nope not found"))
    r = _infer_request(model_version="7")
    cases.append(("version", r, "NOT_FOUND", "Model affine with version 7 not found"))
    r = _infer_request(model="tiny")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"Hi")
    r.parameters["maxtokens"].int64_param = 3
    cases.append(("unknown-parameter", r, "INVALID_ARGUMENT", "unknown parameter: maxtokens"))
    r = _infer_request(model="tiny")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"Hi")
    r.inputs.add(name="beam_width", datatype="INT32", shape=[1]).contents.int_contents.append(4)
    cases.append(
        (
            "unsupported-tensor",
            r,
            "INVALID_ARGUMENT",
            "parameter 'beam_width' is not supported: beam search is not supported (beam_width 1 only)",
        )
    )
    r = _infer_request(model="tiny")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"Hi")
    r.parameters["temperature"].string_param = "hot"
    cases.append(("parameter-type", r, "INVALID_ARGUMENT", "Invalid value 'hot' for parameter 'temperature'"))
    r = _infer_request(model="tiny")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"Hi")
    r.parameters["max_tokens"].SetInParent()
    cases.append(("parameter-no-value", r, "INVALID_ARGUMENT", "parameter 'max_tokens' has no value"))
    return cases


MALFORMED = _malformed_infer_requests()


@pytest.mark.parametrize(("request_", "code", "message"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_infer_requests(served: Served, request_, code, message):
    with pytest.raises(grpc.RpcError) as refused:
        served.stub().ModelInfer(request_, metadata=list(AUTH.items()), timeout=TIMEOUT)
    assert refused.value.code().name == code, refused.value
    assert refused.value.details().startswith(message), refused.value.details()


def test_malformed_requests_of_every_other_service(served: Served):
    stub, metadata = served.stub(), list(AUTH.items())
    refusals = [
        (lambda: stub.ModelReady(pb.ModelReadyRequest(name="nope")), "NOT_FOUND", "Model nope not found"),
        (
            lambda: stub.ModelReady(pb.ModelReadyRequest(name="tiny", version="2")),
            "NOT_FOUND",
            "Model tiny with version 2 not found",
        ),
        (lambda: stub.ModelReady(pb.ModelReadyRequest()), "INVALID_ARGUMENT", "the request needs a model name"),
        (
            lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"), metadata=metadata),
            "NOT_FOUND",
            "Model nope not found",
        ),
        (
            lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest(repository_name="other"), metadata=metadata),
            "NOT_FOUND",
            "Repository other not found",
        ),
        (lambda: stub.ModelConfig(pb.ModelConfigRequest(name="tiny"), metadata=metadata), "UNIMPLEMENTED", ""),
    ]
    for call, code, message in refusals:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code().name == code, refused.value
        assert refused.value.details().startswith(message), refused.value.details()


def test_a_streamed_request_gets_its_error_in_band_and_the_stream_goes_on(served: Served):
    client = served.client()
    stream = Stream(client)
    try:
        client.async_stream_infer("nope", [text_input(PROMPT)], request_id="e-1")
        client.async_stream_infer("tiny", [text_input(PROMPT, PROMPT)], request_id="e-2")
        client.async_stream_infer("tiny", [text_input(PROMPT)], parameters={"n": 2}, request_id="e-3")
        errors = {}
        for _ in range(3):
            result, error = stream.next()
            assert result is None and error is not None
            errors[error.message()] = error
        assert sorted(errors) == [
            "Model nope not found",
            "ModelStreamInfer streams the generation of one prompt: input 'text_input' holds 2",
            "parameter 'n' is not supported: ModelStreamInfer answers one sequence (n 1 only)",
        ]
        client.async_stream_infer("tiny", [text_input(PROMPT)], parameters={"max_tokens": 3})
        assert "".join(stream.pieces()) == rest_generate(served, PROMPT, 3)
    finally:
        client.stop_stream()


# ---- KServe's InferenceGRPCClient ------------------------------------------------------------------------


@pytest.mark.e2e  # KServe's client runs in its own venv (the slowest tier)
def test_kserve_grpc_client(served: Served):
    if not KSERVE_PYTHON.is_file():
        raise RuntimeError(f"{KSERVE_PYTHON} is missing: run `make install-kserve`")
    done = subprocess.run(
        [str(KSERVE_PYTHON), str(KSERVE_SCRIPT), "grpc", served.address, KEY, "tiny", "affine"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    x = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], dtype=np.float32)
    y, best = affine_reference(x)
    for mode in ("typed", "raw"):
        answer = out.pop(mode)
        assert answer["id"] == f"{mode}-1"
        assert answer["outputs"]["best"] == ["INT64", [2], best.tolist()]
        datatype, shape, values = answer["outputs"]["y"]
        assert (datatype, shape) == ("FP32", [2, 2])
        np.testing.assert_allclose(values, y, rtol=1e-6)
    assert out == {
        "live": True,
        "ready": True,
        "model_ready": True,
        "unknown_model_ready": "NOT_FOUND",
        "llm": rest_generate(served, PROMPT, 5),
        "no_key": "UNAUTHENTICATED",
    }


# ---- the drain, the port (processes of their own) --------------------------------------------------------


@pytest.mark.e2e  # a signal to a real process
def test_sigterm_drains_the_grpc_port(endless_model_dir: Path):
    """In-flight generations run on while new calls get UNAVAILABLE (ServerLive still answers); at
    drain_timeout the engines stop: the open stream gets its error, ends UNAVAILABLE, the process exits 0."""
    port = free_port()
    args = ["--model-id", str(endless_model_dir), "--grpc-port", str(port)]
    args += ["-o", f"max_new_tokens_limit={ENDLESS_CONTEXT}", "-o", "drain_timeout=3"]
    with ServeProcess(args) as server:
        server.wait_healthy()
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        stream = Stream(client, None)
        settings = [scalar("max_tokens", ENDLESS, "INT32", np.int32), scalar("ignore_eos", True, "BOOL", np.bool_)]
        client.async_stream_infer(endless_model_dir.name, [text_input(PROMPT), *settings], request_id="long")
        assert stream.next()[1] is None
        server.send(signal.SIGTERM)
        server.wait_stderr("stopping: received SIGTERM")
        before = stream.results.qsize()
        wait_until(lambda: stream.results.qsize() > before + 2, "the stream in flight goes on", timeout=HANG_TIMEOUT)
        assert client.is_server_live()
        for call in (client.is_server_ready, lambda: client.infer(endless_model_dir.name, [text_input(PROMPT)])):
            with pytest.raises(InferenceServerException) as refused:
                call()
            assert code_of(refused.value) == "StatusCode.UNAVAILABLE", refused.value
            assert "The server is shutting down" in refused.value.message()
        client.async_stream_infer(endless_model_dir.name, [text_input(PROMPT)], request_id="late")
        errors = []
        while len(errors) < 3:  # the late request's error, the long one's at drain_timeout, the stream's end
            _, error = stream.next()
            if error is not None:
                errors.append(error)
        assert [e.message() for e in errors[:2]] == ["The server is shutting down"] * 2
        assert code_of(errors[2]) == "StatusCode.UNAVAILABLE", errors[2]
        assert server.wait_exit() == 0, server.describe()
        client.stop_stream()
        assert "Traceback" not in server.stderr(), server.describe()


@pytest.mark.e2e  # the exit status of a real process
def test_a_grpc_port_in_use_exits_3_with_one_line_before_loading_anything(tiny_model_dir: Path):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        with ServeProcess(["--model-id", str(tiny_model_dir), "--grpc-port", str(port)]) as server:
            assert server.wait_exit() == 3, server.describe()
            failures = [line for line in server.stderr_lines() if line.startswith("lmiserve: ")]
            assert failures == [
                f"lmiserve: cannot listen on 127.0.0.1:{port} (gRPC, grpc_port): Address already in use"
            ]
            assert "Started server process" not in server.stderr()  # nothing started, no model loaded
            assert "Traceback" not in server.stderr() and "Failed to add port" not in server.stderr()
