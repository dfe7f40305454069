"""A chat request with images runs the model's processor (resize, normalize, patching: the expensive part)
once: the protocol counts the prompt's tokens through the engine's image codec (`Served.encode_with_images`
-> `core.image_prompt.encoder`), and the engine's encoding of the same prompt in that request (`prepare`,
then `generate`) reuses its output. Through the real path: the app's routes (OpenAI chat, TGI's generate
with a markdown image, Anthropic messages) over the real engine of a tiny random VLM (helpers/tiny_vlm.py)."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from helpers.tiny_vlm import tiny_image
from helpers.vlm_serving import config, image_of, prompt_of
from lmiserve.config import Settings
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.tokenizer import tokenizing
from lmiserve.engine.factory import create_engine
from lmiserve.models.load import load_causal_lm
from lmiserve.models.service import ModelService
from lmiserve.protocols.textgen.served import Served
from lmiserve.server.app import create_app

FAMILIES = ("qwen2_vl", "gemma3", "llava")


def data_url(seed: int) -> str:
    out = io.BytesIO()
    tiny_image(seed).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class VlmApp:
    """A tiny VLM served by the app over its real engine; `calls`: the processor's calls (`__call__`)."""

    def __init__(self, app: Any, service: ModelService, calls: list[int]) -> None:
        self.app, self.service, self.calls = app, service, calls

    async def post(self, path: str, body: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            return await http.post(path, json=body)


@pytest.fixture(params=FAMILIES)
async def served(request, tiny_vlm_dir, monkeypatch) -> AsyncIterator[VlmApp]:
    loaded = load_causal_lm(tiny_vlm_dir(request.param), dtype="fp32", device="cpu")
    processor = loaded.processor
    assert processor is not None
    calls: list[int] = []
    original = type(processor).__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(processor), "__call__", counted)
    settings = Settings.from_options({})
    service = ModelService(settings, name="vlm", kind="llm")
    app = create_app(settings, services=[service])
    engine = create_engine(loaded, config())
    service.attach_llm(loaded, engine)  # what `ModelService.load` does once the model is in memory
    engine.start()
    service.status = ModelService.READY
    try:
        yield VlmApp(app, service, calls)
    finally:
        await engine.stop()


def openai_chat(seed: int) -> dict:
    image = {"type": "image_url", "image_url": {"url": data_url(seed)}}
    content = [image, {"type": "text", "text": "Describe the picture."}]
    return {"model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": 3}


async def test_an_openai_chat_request_with_an_image_runs_the_processor_once(served):
    r = await served.post("/v1/chat/completions", openai_chat(1))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0
    assert len(served.calls) == 1
    r = await served.post("/v1/chat/completions", {**openai_chat(2), "stream": True})
    assert r.status_code == 200, r.text
    assert len(served.calls) == 2


async def test_tgi_and_anthropic_requests_with_an_image_run_the_processor_once(served):
    r = await served.post(
        "/generate", {"inputs": f"![]({data_url(3)})What is this?", "parameters": {"max_new_tokens": 3}}
    )
    assert r.status_code == 200, r.text
    assert len(served.calls) == 1
    source = {"type": "base64", "media_type": "image/png", "data": data_url(4).split(",", 1)[1]}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "What is this?"}]
    body = {"model": "vlm", "max_tokens": 3, "messages": [{"role": "user", "content": content}]}
    r = await served.post("/v1/messages", body)
    assert r.status_code == 200, r.text
    assert len(served.calls) == 2


async def test_concurrent_requests_run_it_once_each(served):
    """More requests at once than the codec keeps prompts of across requests: each request keeps its own."""
    answers = await asyncio.gather(*(served.post("/v1/chat/completions", openai_chat(10 + i)) for i in range(12)))
    assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers if r.status_code != 200]
    assert len(served.calls) == 12


async def test_the_counted_prompt_is_the_engines(served):
    """The protocol's count (`Served.counter`) is the length of the prompt the engine runs; counted, then
    encoded by `prepare` and `generate`, the prompt went through the processor once."""
    model = Served.of(served.service)
    loaded = served.service.ready_llm()
    prompt = prompt_of(loaded, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}])
    images = (image_of(30),)
    counted = await tokenizing(model.counter(images), prompt)
    request = GenerationRequest(prompt, SamplingParams(max_new_tokens=2), images=images)
    await model.engine.prepare(request)
    events = [e async for e in model.engine.generate(request)]
    finish = events[-1].finish
    assert finish is not None and finish.error is None
    assert counted == finish.prompt_tokens
    assert len(served.calls) == 1
