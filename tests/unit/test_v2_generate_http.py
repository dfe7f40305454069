"""Triton's generate extension over HTTP, in process, on a scripted engine: the exact bytes and statuses
of /generate and /generate_stream, failures before the first event (JSON errors), after it (a last
`data: {"error": ...}` event under 200), and the events of other sequences (ignored)."""

from __future__ import annotations

import asyncio

import pytest

from helpers.tensor_app import affine_model, client
from lmiserve.config import Settings
from lmiserve.core.errors import InvalidRequest, Overloaded, QueueTimeout
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.models.llm_tensor import LlmTensorModel
from lmiserve.models.service import ModelService
from lmiserve.server.app import create_app

SSE = "text/event-stream; charset=utf-8"


def finish(reason=FinishReason.LENGTH, text="", error=None) -> Finish:
    return Finish(reason=reason, generated_text=text, generated_tokens=1, prompt="Hi", prompt_tokens=1, error=error)


def token(text: str, special: bool = False) -> Token:
    return Token(id=5, text=text, logprob=-0.5, special=special)


def failed(error: str | None, index: int = 0) -> StepEvent:
    return StepEvent(None, finish=finish(FinishReason.ERROR, error=error), index=index)


NORMAL = [
    StepEvent(token("Hel")),
    StepEvent(token("</s>", special=True)),
    StepEvent(token("lo é"), finish=finish(text="Hello é")),
]


class ScriptedEngine:
    """`generate` yields the script's events, or raises its exception (before or after a first event)."""

    def __init__(self):
        self.script: list | BaseException = NORMAL
        self.raise_after: BaseException | None = None
        self.closed = 0

    async def generate(self, request):
        if isinstance(self.script, BaseException):
            raise self.script
        try:
            for event in self.script:
                await asyncio.sleep(0)
                yield event
            if self.raise_after is not None:
                raise self.raise_after
        finally:
            self.closed += 1


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def app(engine):
    settings = Settings.from_options({})
    llm = ModelService(settings, name="llm", kind="llm")
    llm.status, llm.engine = ModelService.READY, engine
    llm._tensor_model = LlmTensorModel(engine, llm.limits, "llm")
    affine = ModelService(settings, name="affine", kind="torchscript")
    affine.status, affine._tensor_model = ModelService.READY, affine_model()
    return create_app(settings, services=[llm, affine])


async def post(app, route: str, body: dict):
    async with client(app) as http:
        return await http.post(f"/v2/models/llm/{route}", json=body)


def event(text: str, request_id: str | None = "q") -> bytes:
    prefix = f'"id": "{request_id}", ' if request_id is not None else ""
    return f'data: {{{prefix}"model_name": "llm", "model_version": "1", "text_output": "{text}"}}\n\n'.encode()


async def test_generate_answers_one_object(app):
    r = await post(app, "generate", {"id": "q", "text_input": "Hi", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.content == '{"id": "q", "model_name": "llm", "model_version": "1", "text_output": "Hello é"}'.encode()
    r = await post(app, "generate", {"text_input": "Hi", "return_full_text": True})
    assert r.content == '{"model_name": "llm", "model_version": "1", "text_output": "HiHello é"}'.encode()


async def test_generate_stream_bytes(app, engine):
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200
    assert r.headers["content-type"] == SSE and r.headers["cache-control"] == "no-cache"
    assert r.content == event("Hel") + event("lo é")  # special tokens send nothing
    r = await post(app, "generate_stream", {"text_input": "Hi", "parameters": {"return_full_text": True}})
    assert r.content == event("Hi", None) + event("Hel", None) + event("lo é", None)
    assert engine.closed == 2


@pytest.mark.parametrize(("error", "message"), [("boom", "boom"), (None, "generation failed")])
async def test_error_finish(app, engine, error, message):
    engine.script = [failed(error)]
    r = await post(app, "generate", {"text_input": "Hi"})
    assert r.status_code == 500 and r.content == f'{{"error": "{message}"}}'.encode()
    # the stream's status is decided by the first event: an error finish then is in-band
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200 and r.headers["content-type"] == SSE
    assert r.content == f'data: {{"error": "{message}"}}\n\n'.encode()
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi", "parameters": {"return_full_text": True}})
    assert r.content == event("Hi") + f'data: {{"error": "{message}"}}\n\n'.encode()
    engine.script = [StepEvent(token("<s>", special=True)), failed("late")]
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200 and r.content == b'data: {"error": "late"}\n\n'
    engine.script = [StepEvent(token("a")), failed("later")]
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200 and r.content == event("a") + b'data: {"error": "later"}\n\n'


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidRequest("The prompt is empty after tokenization"), 400),
        (Overloaded("Worker queue capacity exceeded"), 503),
        (QueueTimeout("Time out in: 1s"), 503),
    ],
)
async def test_failures_before_the_first_event_are_json_errors(app, engine, exc, status):
    engine.script = exc
    for route in ("generate", "generate_stream"):
        r = await post(app, route, {"text_input": "Hi"})
        assert r.status_code == status and r.headers["content-type"] == "application/json"
        assert r.content == f'{{"error": "{exc.message}"}}'.encode()


async def test_a_failure_after_the_first_event_is_in_band(app, engine):
    engine.script, engine.raise_after = [StepEvent(token("a"))], QueueTimeout("later")
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200 and r.content == event("a") + b'data: {"error": "later"}\n\n'


async def test_streams_without_an_end(app, engine):
    engine.script = []
    r = await post(app, "generate", {"text_input": "Hi"})
    assert r.status_code == 500 and r.content == b'{"error": "the generation ended without a final event"}'
    r = await post(app, "generate_stream", {"text_input": "Hi"})
    assert r.status_code == 500 and r.content == b'{"error": "the generation ended without events"}'
    engine.script = [StepEvent(token("a"))]
    r = await post(app, "generate", {"text_input": "Hi"})
    assert r.status_code == 500 and r.content == b'{"error": "the generation ended without a final event"}'
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200 and r.content == event("a")


async def test_only_the_first_sequence_is_answered(app, engine):
    engine.script = [
        StepEvent(token("a")),
        StepEvent(token("zz"), index=1),
        failed("other", index=1),
        StepEvent(token("b"), finish=finish(text="ab")),
    ]
    r = await post(app, "generate", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200 and r.json()["text_output"] == "ab"
    r = await post(app, "generate_stream", {"id": "q", "text_input": "Hi"})
    assert r.status_code == 200 and r.content == event("a") + event("b")


async def test_an_adapter_is_selected_or_refused_never_answered_by_the_base_model(app, engine):
    """`adapter_id` (or the vLLM backend's `lora_name`) selects a LoRA adapter of the model; one that is
    not served is a 404, never the base model's answer."""
    engine.requests = []
    generate = engine.generate

    async def recording(request):
        engine.requests.append(request)
        async for event in generate(request):
            yield event

    engine.generate = recording
    for route in ("generate", "generate_stream"):
        for key in ("adapter_id", "lora_name"):
            r = await post(app, route, {"text_input": "Hi", "parameters": {key: "my-lora"}})
            message = "`adapter_id` names adapter `my-lora`, which is not served (this model serves no LoRA adapters)"
            assert (r.status_code, r.json()) == (404, {"error": message})
    assert engine.requests == []
    engine.adapters = {"alpha"}
    for route in ("generate", "generate_stream"):
        for key in ("adapter_id", "lora_name"):
            r = await post(app, route, {"text_input": "Hi", "parameters": {key: "alpha"}})
            assert r.status_code == 200 and engine.requests[-1].adapter == "alpha"
        r = await post(app, route, {"text_input": "Hi", "parameters": {"adapter_id": "llm"}})  # the model itself
        assert r.status_code == 200 and engine.requests[-1].adapter is None


async def test_request_errors(app):
    async with client(app) as http:
        for route in ("generate", "generate_stream"):
            r = await http.post(f"/v2/models/llm/{route}", content=b"{")
            assert r.status_code == 400 and r.json()["error"].startswith("failed to parse the request JSON: ")
            r = await http.post(f"/v2/models/llm/{route}", json={"text_input": "x", "id": 3})
            assert r.status_code == 400 and r.content == b'{"error": "\'id\' must be a string"}'
            r = await http.post(f"/v2/models/llm/{route}", json={"text_input": "x", "parameters": 3})
            assert r.status_code == 400 and r.content == b'{"error": "\'parameters\' must be a JSON object"}'
            r = await http.post(f"/v2/models/llm/versions/2/{route}", json={"text_input": "x"})
            assert r.status_code == 404 and r.content == b'{"error": "Model llm with version 2 not found"}'
            r = await http.post(f"/v2/models/nope/{route}", json={"text_input": "x"})
            assert r.status_code == 404 and r.content == b'{"error": "Model nope not found"}'
            r = await http.post(f"/v2/models/affine/{route}", json={"text_input": "x"})
            assert r.status_code == 400 and r.json() == {
                "error": "model 'affine' is a torchscript model: generate needs an LLM; use /v2/models/affine/infer"
            }
            r = await http.get(f"/v2/models/llm/{route}")
            assert r.status_code == 405 and r.content == b'{"error": "Method Not Allowed"}'
