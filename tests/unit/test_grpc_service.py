"""The gRPC service in process, on a loopback port, over the scripted fake engine (tests/helpers/text_app.py)
and numpy tensor models: the stream's responses and final flag, in-band errors, cancellation, status
codes (never UNKNOWN), the drain, the API key, an LLM's settings as tensors, metadata and the index.
Requests go through tritonclient's stub (its messages, Triton's field numbers). The same on a real
server through the real clients: tests/integration/test_grpc.py."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from helpers.tensor_app import NumpyModel, affine_model
from helpers.text_app import Script, TextApp, text_app
from helpers.waiting import async_wait_until
from lmiserve.core.errors import Overloaded
from lmiserve.core.tensors import ModelSignature, TensorSpec
from lmiserve.server.app import grpc_services
from lmiserve.server.grpc_server import GrpcServer

FOX = " the quick brown fox jumps"
PIECES = [" the", " quick", " brown", " fox", " jumps"]


@contextlib.asynccontextmanager
async def grpc_stub(served: TextApp) -> AsyncIterator[Any]:
    """A stub of the app's models served on a free loopback port (`grpc_port` 0: the system picks one)."""
    state = served.app.state
    settings = state.settings.model_copy(update={"host": "127.0.0.1", "grpc_port": 0})
    server = GrpcServer(settings, state.registry, state.drain, grpc_services())
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
        finally:
            await server.stop(0)


def llm_request(prompt: str = "Once upon a time", request_id: str = "", **parameters: Any) -> Any:
    request = pb.ModelInferRequest(model_name="tiny", id=request_id)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(prompt.encode())
    for key, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = value
    return request


def text_of(response: Any) -> str:
    """The one text_output element of a ModelInferResponse (raw or typed)."""
    if response.raw_output_contents:
        return response.raw_output_contents[0][4:].decode()
    return response.outputs[0].contents.bytes_contents[0].decode()


def final(response: Any) -> bool:
    return response.parameters["triton_final_response"].bool_param


async def answers(call: Any, count: int) -> list[Any]:
    """The next `count` stream responses."""
    return [await call.read() for _ in range(count)]


@pytest.fixture
def served() -> TextApp:
    served = text_app(others={"affine": affine_model()})
    served.fake.reply(Script(text=FOX))
    return served


# ---- ModelStreamInfer ------------------------------------------------------------------------------------


async def test_a_stream_answers_each_piece_and_flags_the_last(served: TextApp):
    async with grpc_stub(served) as stub:
        call = stub.ModelStreamInfer()
        await call.write(llm_request(request_id="s-1", max_tokens=8))  # EOS after the fox: a last "" piece
        eos = await answers(call, 6)
        await call.write(llm_request(max_tokens=3))  # length: the last piece is final
        length = await answers(call, 3)
        prompt = llm_request(max_tokens=2)
        flag = prompt.inputs.add(name="exclude_input_in_output", datatype="BOOL", shape=[1])
        flag.contents.bool_contents.append(False)
        await call.write(prompt)
        full = await answers(call, 3)
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert [(r.error_message, text_of(r.infer_response), final(r.infer_response)) for r in eos] == [
        *(("", p, False) for p in PIECES),
        ("", "", True),
    ]
    first = eos[0].infer_response
    assert (first.id, first.model_name, first.model_version) == ("s-1", "tiny", "1")
    assert (first.outputs[0].name, first.outputs[0].datatype, list(first.outputs[0].shape)) == (
        "text_output",
        "BYTES",
        [1],
    )
    assert [(text_of(r.infer_response), final(r.infer_response)) for r in length] == [
        (" the", False),
        (" quick", False),
        (" brown", True),
    ]
    assert [text_of(r.infer_response) for r in full] == ["Once upon a time", " the", " quick"]
    assert [r.params.max_new_tokens for r in served.fake.requests] == [8, 3, 2]


async def test_stream_false_answers_the_whole_text_once(served: TextApp):
    async with grpc_stub(served) as stub:
        call = stub.ModelStreamInfer()
        await call.write(llm_request(max_tokens=3, stream=False))
        [response] = await answers(call, 1)
        await call.done_writing()
    assert (text_of(response.infer_response), final(response.infer_response)) == (" the quick brown", True)


async def test_a_request_error_is_in_band_and_the_stream_goes_on(served: TextApp):
    served.fake.reply_once(Script(text=FOX, failure="the model step failed", failure_after=2))
    async with grpc_stub(served) as stub:
        call = stub.ModelStreamInfer()
        await call.write(llm_request(request_id="bad"))
        broken = await answers(call, 3)
        await call.write(llm_request(request_id="ok", max_tokens=1))
        [fine] = await answers(call, 1)
        await call.write(llm_request(request_id="neg", temperature="hot"))
        [refused] = await answers(call, 1)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    assert [text_of(r.infer_response) for r in broken[:2]] == [" the", " quick"]
    assert (broken[2].error_message, broken[2].infer_response.id) == ("the model step failed", "bad")
    assert (text_of(fine.infer_response), final(fine.infer_response)) == (" the", True)
    assert refused.error_message.startswith("Invalid value 'hot' for parameter 'temperature'")


async def test_cancelling_the_stream_aborts_the_generation(served: TextApp):
    served.fake.reply(Script(text=FOX, hold_after=2))
    async with grpc_stub(served) as stub:
        call = stub.ModelStreamInfer()
        await call.write(llm_request())
        await answers(call, 2)
        call.cancel()
        await async_wait_until(lambda: len(served.fake.aborted) == 1, "the generation is aborted")
    served.fake.release()


async def test_a_stream_on_a_tensor_model_answers_once(served: TextApp):
    request = pb.ModelInferRequest(model_name="affine", id="t")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1, 2, 3, 4])
    async with grpc_stub(served) as stub:
        call = stub.ModelStreamInfer()
        await call.write(request)
        [response] = await answers(call, 1)
        await call.done_writing()
    out = response.infer_response
    assert final(out) and out.id == "t" and [o.name for o in out.outputs] == ["y", "best"]
    assert list(out.outputs[1].contents.int64_contents) == [1]


# ---- ModelInfer: settings, codes -------------------------------------------------------------------------


async def test_an_llm_takes_its_settings_as_tensors_or_parameters(served: TextApp):
    request = llm_request()
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1]).contents.int_contents.append(4)
    request.inputs.add(name="stop_words", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"fox")
    request.inputs.add(name="bad_words", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"")
    request.inputs.add(name="temperature", datatype="FP32", shape=[1]).contents.fp32_contents.append(0.5)
    async with grpc_stub(served) as stub:
        response = await stub.ModelInfer(request)
        by_parameter = await stub.ModelInfer(llm_request(max_tokens=2, random_seed=7))
    assert text_of(response) == " the quick brown " and not response.raw_output_contents  # stopped at "fox"
    assert text_of(by_parameter) == " the quick"
    first, second = (r.params for r in served.fake.requests)
    assert (first.max_new_tokens, first.stop_sequences, first.temperature) == (4, ["fox"], 0.5)
    assert (second.max_new_tokens, second.seed) == (2, 7)


def _failing(exc: Exception) -> NumpyModel:
    signature = ModelSignature(inputs=(TensorSpec("x", "FP32", (-1,)),), outputs=(TensorSpec("y", "FP32", (-1,)),))

    def fn(x):
        raise exc

    return NumpyModel("torchscript", signature, fn)


async def test_status_codes_never_unknown():
    served = text_app(others={"broken": _failing(ValueError("kaboom"))})
    served.fake.reply(Script(error=Overloaded("Worker queue capacity exceeded")))
    broken = pb.ModelInferRequest(model_name="broken")
    broken.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    async with grpc_stub(served) as stub:
        for request, code, message in [
            (llm_request(), grpc.StatusCode.RESOURCE_EXHAUSTED, "Worker queue capacity exceeded"),
            (broken, grpc.StatusCode.INTERNAL, "kaboom"),
            (llm_request(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "input 'text_input' holds an empty prompt"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(request)
            assert (refused.value.code(), refused.value.details()) == (code, message)


async def test_a_model_that_loads():
    served = text_app(status="PENDING", others={"affine": affine_model()})
    async with grpc_stub(served) as stub:
        assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="tiny"))).ready
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="affine"))).ready
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(llm_request())
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "Model tiny is not ready yet.",
        )
        everything = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        ready = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
    assert [(m.name, m.version, m.state) for m in everything.models] == [
        ("tiny", "1", "LOADING"),
        ("affine", "1", "READY"),
    ]
    assert [m.name for m in ready.models] == ["affine"]


async def test_the_drain(served: TextApp):
    served.app.state.drain.begin()
    async with grpc_stub(served) as stub:
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live
        for call in (stub.ServerReady(pb.ServerReadyRequest()), stub.ModelInfer(llm_request())):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert (refused.value.code(), refused.value.details()) == (
                grpc.StatusCode.UNAVAILABLE,
                "The server is shutting down",
            )
        stream = stub.ModelStreamInfer()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_api_key():
    served = text_app(api_key="sesame")
    served.fake.reply(Script(text=FOX))
    async with grpc_stub(served) as stub:
        for metadata in [(), (("authorization", "Bearer nope"),)]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(llm_request(), metadata=metadata)
            assert (refused.value.code(), refused.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong API key",
            )
        response = await stub.ModelInfer(llm_request(max_tokens=1), metadata=(("authorization", "bearer SESAME"),))
        assert text_of(response) == " the"
        assert (await stub.ServerReady(pb.ServerReadyRequest())).ready  # probes are open


async def test_metadata_and_the_access_line(served: TextApp, caplog: pytest.LogCaptureFixture):
    async with grpc_stub(served) as stub:
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny"))
        with caplog.at_level(logging.INFO, logger="lmiserve.access"):
            call = stub.ModelInfer(llm_request(max_tokens=1), metadata=(("x-request-id", "id-42"),))
            await call
            assert dict(await call.initial_metadata())["x-request-id"] == "id-42"
    assert (meta.name, list(meta.versions), meta.platform) == ("tiny", ["1"], "lmiserve_llm")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("text_input", "BYTES", [-1])]
    [line] = [r for r in caplog.records if r.name == "lmiserve.access"]
    assert line.request_id == "id-42"
    assert line.access["path"] == "/inference.GRPCInferenceService/ModelInfer"
    assert (line.access["protocol"], line.access["model"], line.access["status"]) == ("kserve-grpc", "tiny", 0)


def test_a_float16_input_has_no_typed_contents():
    from lmiserve.core.errors import InvalidInput
    from lmiserve.protocols.tensor.kserve.grpc.convert import request_document

    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP16", shape=[1])
    with pytest.raises(InvalidInput, match="send its data in raw_input_contents"):
        request_document(request, "m")
    raw = pb.ModelInferRequest(model_name="m", raw_input_contents=[np.float16(1).tobytes()])
    raw.inputs.add(name="x", datatype="FP16", shape=[1]).parameters["binary_data_size"].int64_param = 99
    doc, tail = request_document(raw, "m")
    assert (doc["inputs"][0]["parameters"], tail) == ({"binary_data_size": 2}, np.float16(1).tobytes())


async def test_an_oversize_message_is_resource_exhausted_on_every_rpc():
    served = text_app(max_request_size=4096, others={"affine": affine_model()})
    served.fake.reply(Script(text=FOX))
    big = llm_request(prompt="x" * 5000)
    async with grpc_stub(served) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(big)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call = stub.ModelStreamInfer()
        await call.write(big)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert text_of(await stub.ModelInfer(llm_request(max_tokens=1))) == " the"  # the port serves on
