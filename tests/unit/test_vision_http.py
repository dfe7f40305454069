"""Images through every protocol over HTTP, in process, on a fake vision model (helpers.fake_vision: the
scripted fake engine with the real tiny tokenizer and a fake processor whose ``<image>`` expands to
`IMAGE_EXPANSION` tokens): the image reaches the engine request in the prompt's placeholder order, the
token counts include its tokens, another image gives another prompt; a text model answers 400 naming
the model; hostile images and refused URLs are 4xx in each protocol's own shape, never a 5xx. The real
clients on a real tiny VLM server: tests/integration/test_vision_protocols.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from helpers.fake_vision import (
    BLUE,
    HOSTILE,
    IMAGE_EXPANSION,
    RED,
    TOKENS_PER_IMAGE,
    b64,
    bomb,
    data_url,
    vision_app,
)
from helpers.text_app import TextApp, text_app

NOT_VISION = "The model 'tiny' does not take images"


@pytest.fixture
def vlm() -> TextApp:
    return vision_app(vertex_predict_route="/predict", vertex_health_route="/health")


@pytest.fixture(scope="module")
def text_model() -> TextApp:
    return text_app(vertex_predict_route="/predict", vertex_health_route="/health")


async def post(app: TextApp, path: str, body: Any) -> httpx.Response:
    async with app.client() as http:
        return await http.post(path, json=body)


def image_part(data: bytes = RED) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def chat(*parts: dict, text: str = "What is this?", **more: Any) -> dict:
    return {
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
        "max_tokens": 4,
        **more,
    }


def anthropic_body(data: bytes = RED, media_type: str = "image/png") -> dict:
    block = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}
    return {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": "what"}]}],
    }


def count_body(data: bytes = RED, media_type: str = "image/png") -> dict:
    body = anthropic_body(data, media_type)
    body.pop("max_tokens")
    return body


def responses_body(url: str) -> dict:
    content = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]
    return {"input": [{"role": "user", "content": content}], "max_output_tokens": 4}


def v2_infer(image: str | None, prompt: str = "What is") -> dict:
    inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}]
    if image is not None:
        inputs.append({"name": "image", "datatype": "BYTES", "shape": [1], "data": [image]})
    return {"inputs": inputs, "parameters": {"max_new_tokens": 4}}


def last(app: TextApp):
    return app.fake.requests[-1]


def text_tokens(app: TextApp, prompt: str) -> int:
    return len(app.fake.tokenizer(prompt.replace("<image>", ""))["input_ids"])


# ---- OpenAI chat -----------------------------------------------------------------------------------


async def test_openai_chat_image_reaches_the_engine_and_is_counted(vlm):
    r = await post(vlm, "/v1/chat/completions", chat(image_part(RED)))
    assert r.status_code == 200, r.text
    request = last(vlm)
    assert request.prompt == "<|user|>What is this?<image></s><|assistant|>"
    assert len(request.images) == 1 and request.images[0].size == (16, 16)
    assert r.json()["usage"]["prompt_tokens"] == text_tokens(vlm, request.prompt) + IMAGE_EXPANSION


async def test_openai_chat_other_image_other_answer(vlm):
    answers = []
    for image in (RED, BLUE, RED):
        r = await post(vlm, "/v1/chat/completions", chat(image_part(image), temperature=0))
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[2] != answers[1]
    digests = [req.images[0].digest for req in vlm.fake.requests]
    assert digests[0] == digests[2] != digests[1]


async def test_openai_chat_images_keep_their_order_and_bare_urls(vlm):
    parts = [image_part(BLUE), {"type": "text", "text": " and "}, {"type": "image_url", "image_url": data_url(RED)}]
    r = await post(vlm, "/v1/chat/completions", chat(*parts, text="Compare "))
    assert r.status_code == 200, r.text
    request = last(vlm)
    assert request.prompt == "<|user|>Compare <image> and <image></s><|assistant|>"
    blue, red = (img.pixels.getpixel((0, 0)) for img in request.images)
    assert (blue, red) == ((20, 40, 220), (200, 30, 30))


async def test_openai_chat_text_only_request_to_a_vision_model(vlm):
    r = await post(vlm, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert last(vlm).images == () and last(vlm).prompt == "<|user|>hi</s><|assistant|>"


async def test_openai_chat_stream_with_an_image(vlm):
    r = await post(vlm, "/v1/chat/completions", chat(image_part(), stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert len(last(vlm).images) == 1


async def test_text_model_refuses_images_naming_it(text_model):
    r = await post(text_model, "/v1/chat/completions", chat(image_part()))
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(NOT_VISION)
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_http_images_refused_unless_allowed(vlm):
    body = chat({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}})
    r = await post(vlm, "/v1/chat/completions", body)
    assert r.status_code == 400 and "allowed_media_domains" in r.json()["error"]["message"], r.text


async def test_too_many_images():
    served = vision_app(limit_mm_per_prompt=2)
    r = await post(served, "/v1/chat/completions", chat(image_part(), image_part(), image_part()))
    assert r.status_code == 400 and "limit_mm_per_prompt" in r.json()["error"]["message"], r.text
    assert not served.fake.requests


async def test_prompt_too_long_with_the_image_tokens(vlm):
    # the prompt's text fits; with its image's tokens it does not (max_input_len counts them)
    served = vision_app(max_input_len=8)
    r = await post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] + IMAGE_EXPANSION > 8, r.text
    r = await post(served, "/v1/chat/completions", chat(image_part(), text=""))
    assert r.status_code == 400, r.text
    assert "8" in r.json()["error"]["message"]


# ---- hostile images, every protocol's shape ---------------------------------------------------------

HOSTILE_IMAGES = {**HOSTILE, "bomb": None}  # bomb(): built on first use


def hostile(name: str) -> bytes:
    return bomb() if name == "bomb" else HOSTILE[name]


@pytest.mark.parametrize("name", sorted(HOSTILE_IMAGES))
async def test_hostile_images_are_400_in_each_protocol_shape(vlm, name):
    data = hostile(name)
    media = "image/svg+xml" if name == "svg" else "image/png"
    url = data_url(data, media)
    cases = [
        ("/v1/chat/completions", chat({"type": "image_url", "image_url": {"url": url}}), 400, "openai"),
        ("/v1/responses", responses_body(url), 400, "openai"),
        ("/v1/messages", anthropic_body(data, media), 400, "anthropic"),
        ("/v1/messages/count_tokens", count_body(data, media), 400, "anthropic"),
        ("/generate", {"inputs": f"What is ![]({url})", "parameters": {"max_new_tokens": 3}}, 422, "tgi"),
        ("/generate_stream", {"inputs": f"![]({url})", "parameters": {"max_new_tokens": 3}}, 422, "tgi"),
        ("/invocations", chat({"type": "image_url", "image_url": {"url": url}}), 400, "openai"),
        ("/tokenize", {"messages": chat({"type": "image_url", "image_url": url})["messages"]}, 400, "openai"),
        ("/v2/models/tiny/infer", v2_infer(b64(data)), 400, "kserve"),
        ("/v2/models/tiny/generate", {"text_input": "x", "image": url}, 400, "kserve"),
        ("/predict", {"instances": [{"prompt": "x", "image": b64(data)}]}, 400, "vertex"),
    ]
    for path, body, status, shape in cases:
        r = await post(vlm, path, body)
        if path == "/generate_stream":  # TGI's stream answers its validation errors in band
            assert r.status_code == 200 and r.text.startswith("data: "), r.text
            r = httpx.Response(status, content=r.text.removeprefix("data: ").strip())
        assert r.status_code == status, (path, r.text)
        message = error_message(r.json(), shape)
        assert "image" in message.lower(), (path, message)
        assert "Traceback" not in r.text and "PIL" not in r.text, r.text
    assert not vlm.fake.requests  # nothing reached the engine


def error_message(body: Any, shape: str) -> str:
    if shape == "openai":
        assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    if shape == "tgi":
        assert body["error_type"] == "validation", body
        return body["error"]
    if shape == "kserve":
        assert set(body) == {"error"}, body
        return body["error"]
    assert shape == "vertex"
    return str(body.get("error") or body.get("message") or body)


# ---- the Responses API -------------------------------------------------------------------------------


async def test_responses_input_image(vlm):
    r = await post(vlm, "/v1/responses", responses_body(data_url(BLUE)))
    assert r.status_code == 200, r.text
    assert last(vlm).prompt == "<|user|>What is this?<image></s><|assistant|>"
    assert r.json()["usage"]["input_tokens"] == text_tokens(vlm, last(vlm).prompt) + IMAGE_EXPANSION


async def test_responses_file_id_is_400(vlm):
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}]}
    r = await post(vlm, "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].file_id", r.text


async def test_responses_text_model_refuses(text_model):
    r = await post(text_model, "/v1/responses", responses_body(data_url()))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(NOT_VISION)


# ---- Anthropic -----------------------------------------------------------------------------------------


async def test_anthropic_base64_image_and_count_tokens(vlm):
    r = await post(vlm, "/v1/messages", anthropic_body())
    assert r.status_code == 200, r.text
    assert last(vlm).prompt == "<|user|><image>what</s><|assistant|>" and len(last(vlm).images) == 1
    used = r.json()["usage"]["input_tokens"]
    counted = await post(vlm, "/v1/messages/count_tokens", count_body())
    assert counted.status_code == 200 and counted.json()["input_tokens"] == used
    assert used == text_tokens(vlm, last(vlm).prompt) + IMAGE_EXPANSION


async def test_anthropic_url_source_refused_without_allowed_domains(vlm):
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
    r = await post(vlm, "/v1/messages", body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


async def test_anthropic_text_model_refuses(text_model):
    for path, body in (("/v1/messages", anthropic_body()), ("/v1/messages/count_tokens", count_body())):
        r = await post(text_model, path, body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(NOT_VISION), r.text


# ---- TGI -----------------------------------------------------------------------------------------------


async def test_tgi_markdown_image(vlm):
    r = await post(
        vlm,
        "/generate",
        {"inputs": f"What is ![]({data_url(RED)}) this?", "parameters": {"details": True, "max_new_tokens": 3}},
    )
    assert r.status_code == 200, r.text
    assert last(vlm).prompt == "What is <image> this?" and len(last(vlm).images) == 1
    assert r.headers["x-prompt-tokens"] == str(text_tokens(vlm, "What is <image> this?") + IMAGE_EXPANSION)


async def test_tgi_markdown_is_text_for_a_text_model(text_model):
    inputs = f"What is ![]({data_url(RED)})"
    r = await post(text_model, "/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200 and text_model.fake.requests[-1].prompt == inputs  # TGI's reading


async def test_tgi_tokenize_counts_the_image_tokens(vlm):
    r = await post(vlm, "/tokenize", {"inputs": f"What ![]({data_url(RED)})"})
    assert r.status_code == 200, r.text
    ids = [t["id"] for t in r.json()]
    image_id = vlm.service.loaded.processor.image_token_id
    assert ids.count(image_id) == TOKENS_PER_IMAGE
    assert len(ids) == text_tokens(vlm, "What <image>") + IMAGE_EXPANSION


async def test_tgi_chat_tokenize_counts_the_image_tokens(vlm):
    r = await post(vlm, "/chat_tokenize", chat(image_part()))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["templated_text"] == "<|user|>What is this?<image></s><|assistant|>"
    image_id = vlm.service.loaded.processor.image_token_id
    assert [t["id"] for t in body["tokenize_response"]].count(image_id) == TOKENS_PER_IMAGE


# ---- vLLM's /tokenize ----------------------------------------------------------------------------------


async def test_vllm_tokenize_messages_with_an_image(vlm, text_model):
    body = {"messages": chat(image_part())["messages"]}
    r = await post(vlm, "/tokenize", body)
    assert r.status_code == 200, r.text
    image_id = vlm.service.loaded.processor.image_token_id
    assert r.json()["tokens"].count(image_id) == TOKENS_PER_IMAGE and r.json()["count"] == len(r.json()["tokens"])
    r = await post(text_model, "/tokenize", body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(NOT_VISION)


# ---- LMI and SageMaker: /invocations with messages -----------------------------------------------------


async def test_invocations_messages_with_an_image(vlm, text_model):
    r = await post(vlm, "/invocations", chat(image_part(BLUE)))
    assert r.status_code == 200, r.text
    assert len(last(vlm).images) == 1
    r = await post(text_model, "/invocations", chat(image_part(BLUE)))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(NOT_VISION)


# ---- KServe V2 and Vertex ----------------------------------------------------------------------------


@pytest.mark.parametrize("image", [b64(RED), data_url(RED)])
async def test_kserve_infer_image_input(vlm, image):
    r = await post(vlm, "/v2/models/tiny/infer", v2_infer(image))
    assert r.status_code == 200, r.text
    assert last(vlm).prompt == "<image>What is" and len(last(vlm).images) == 1  # placeholder put first


async def test_kserve_infer_keeps_the_prompts_own_placeholder(vlm):
    r = await post(vlm, "/v2/models/tiny/infer", v2_infer(b64(RED), prompt="USER: <image>\nWhat? ASSISTANT:"))
    assert r.status_code == 200, r.text
    assert last(vlm).prompt == "USER: <image>\nWhat? ASSISTANT:"


async def test_kserve_infer_one_image_per_prompt(vlm):
    body = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]},
            {"name": "image", "datatype": "BYTES", "shape": [2], "data": [b64(RED), b64(BLUE)]},
        ],
        "parameters": {"max_new_tokens": 2},
    }
    r = await post(vlm, "/v2/models/tiny/infer", body)
    assert r.status_code == 200, r.text
    assert sorted(len(req.images) for req in vlm.fake.requests) == [1, 1]
    body["inputs"][1] = {"name": "image", "datatype": "BYTES", "shape": [3], "data": [b64(RED)] * 3}
    r = await post(vlm, "/v2/models/tiny/infer", body)
    assert r.status_code == 400 and "one image per prompt" in r.json()["error"], r.text


async def test_kserve_generate_image(vlm):
    r = await post(
        vlm, "/v2/models/tiny/generate", {"text_input": "What is", "image": [b64(RED), data_url(BLUE)], "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    assert last(vlm).prompt == "<image><image>What is" and len(last(vlm).images) == 2


async def test_kserve_text_model_refuses(text_model):
    r = await post(text_model, "/v2/models/tiny/generate", {"text_input": "x", "image": b64(RED)})
    assert r.status_code == 400 and r.json()["error"].startswith(NOT_VISION), r.text
    r = await post(text_model, "/v2/models/tiny/infer", v2_infer(b64(RED)))
    assert r.status_code == 400 and "'image'" in r.json()["error"] and "'tiny'" in r.json()["error"], r.text


async def test_kserve_metadata_declares_the_optional_image_input(vlm):
    async with vlm.client() as http:
        r = await http.get("/v2/models/tiny")
    inputs = {i["name"]: i for i in r.json()["inputs"]}
    assert set(inputs) == {"text_input", "image"} and inputs["image"]["datatype"] == "BYTES"


async def test_vertex_instances_with_images(vlm):
    body = {"instances": [{"prompt": "What is", "image": b64(RED)}], "parameters": {"max_new_tokens": 3}}
    r = await post(vlm, "/predict", body)
    assert r.status_code == 200, r.text
    assert last(vlm).prompt == "<image>What is" and len(last(vlm).images) == 1
    r = await post(vlm, "/predict", {"instances": ["plain", {"prompt": "text"}], "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["predictions"]) == 2, r.text


async def test_vertex_text_model_refuses(text_model):
    r = await post(text_model, "/predict", {"instances": [{"prompt": "What is", "image": b64(RED)}]})
    assert r.status_code == 400 and "'image'" in r.text and "'tiny'" in r.text, r.text
