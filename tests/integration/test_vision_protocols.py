"""Images through every chat protocol's real client against one `lmiserve serve` of a tiny random
Qwen2-VL (helpers.tiny_vlm; the API key on), issue #40: `openai` (chat.completions with an
``image_url`` data URL, streamed too; responses.create with ``input_image``), `anthropic`
(messages.create with a base64 ``image`` block; count_tokens), `huggingface_hub.InferenceClient`
(text_generation with a markdown image; chat_completion with ``image_url``), plain HTTP for LMI /
SageMaker (/invocations ``messages``), KServe V2 (infer's ``image`` input, generate's ``image``) and
Vertex (``{"prompt", "image"}`` instances), and /tokenize.

The image is used: the same greedy prompt with image A and with image B answers differently, and the
prompt's token count includes the image's tokens. A text model answers an image with a 400 naming the
model; an http(s) image is refused (no `allowed_media_domains`); hostile images (corrupt, truncated,
SVG, a decompression bomb, too many) get a 400 in each protocol's own shape. The same paths on a fake
model, in process: tests/unit/test_vision_http.py."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from huggingface_hub import InferenceClient

from helpers.server import on_a_free_port

KEY = "vision-test-key"
MODEL = "vlm"  # its served name (KServe addresses it by its directory name)
FAMILY = "qwen2_vl"
PROMPT = "Describe the image."
TIMEOUT = 120.0


def png(seed: int) -> bytes:
    from helpers.tiny_vlm import tiny_image

    out = io.BytesIO()
    tiny_image(seed).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


A, B = png(1), png(2)


def bomb() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (20000, 20000)).save(out, format="PNG")  # 400 million pixels declared, ~50 KB
    return out.getvalue()


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect width="8" height="8"/></svg>'
HOSTILE = {
    "corrupt": (b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 20, "image/png"),
    "truncated": (A[: len(A) // 2], "image/png"),
    "svg": (SVG, "image/svg+xml"),
    "bomb": (None, "image/png"),
}


def hostile(name: str) -> tuple[bytes, str]:
    data, media_type = HOSTILE[name]
    return (bomb() if data is None else data), media_type


@pytest.fixture(scope="module")
def served(server_pool, tiny_vlm_dir) -> tuple[str, int]:
    """The module's server: its URL and its gRPC port (picked free here; the default 8081 may be another's)."""
    path = tiny_vlm_dir(FAMILY)
    args = [
        "--model-id",
        str(path),
        "--api-key",
        KEY,
        "-o",
        "limit_mm_per_prompt=2",
        "-o",
        f"served_model_name={MODEL}",
    ]
    return on_a_free_port(lambda grpc_port: server_pool.url([*args, "--grpc-port", str(grpc_port)], timeout=300))


@pytest.fixture(scope="module")
def vlm(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def name(tiny_vlm_dir) -> str:
    return tiny_vlm_dir(FAMILY).name


@pytest.fixture
def http(vlm) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vlm, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
def oai(vlm) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{vlm}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
def claude(vlm) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=vlm, api_key=KEY, max_retries=0, timeout=TIMEOUT) as client:
        yield client


def image_message(data: bytes, text: str = PROMPT) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(data)}}, {"type": "text", "text": text}],
        }
    ]


def anthropic_message(data: bytes, media_type: str = "image/png") -> list[dict[str, Any]]:
    block = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}
    return [{"role": "user", "content": [block, {"type": "text", "text": PROMPT}]}]


# ---- OpenAI ------------------------------------------------------------------------------------------


def test_openai_chat_uses_the_image(oai, http):
    def ask(data: bytes):
        return oai.chat.completions.create(model=MODEL, messages=image_message(data), max_tokens=8, temperature=0)

    a, b, again = ask(A), ask(B), ask(A)
    assert a.choices[0].message.content == again.choices[0].message.content != b.choices[0].message.content
    text_only = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1, temperature=0
    )
    image_tokens = a.usage.prompt_tokens - text_only.usage.prompt_tokens
    assert image_tokens >= 4, (a.usage, text_only.usage)  # the image's tokens are counted
    counted = http.post("/tokenize", json={"messages": image_message(A)})
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == a.usage.prompt_tokens  # /tokenize counts them as the engine does


def test_openai_chat_stream_with_an_image(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=image_message(B), max_tokens=6, temperature=0)
    chunks = oai.chat.completions.create(
        model=MODEL, messages=image_message(B), max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_openai_responses_input_image(oai):
    def ask(data: bytes) -> str:
        content = [{"type": "input_text", "text": PROMPT}, {"type": "input_image", "image_url": data_url(data)}]
        response = oai.responses.create(
            model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=8, temperature=0, store=False
        )
        return response.output_text

    assert ask(A) == ask(A) != ask(B)


def test_openai_refuses_http_images_and_too_many(oai):
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="allowed_media_domains"):
        oai.chat.completions.create(model=MODEL, messages=remote, max_tokens=2)
    parts = [{"type": "image_url", "image_url": {"url": data_url(A)}}] * 3
    with pytest.raises(openai.BadRequestError, match="limit_mm_per_prompt"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=2)


def test_the_api_key_guards_image_requests(vlm):
    r = httpx.post(f"{vlm}/v1/chat/completions", json={"messages": image_message(A), "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 401, r.text


# ---- Anthropic ------------------------------------------------------------------------------------------


def test_anthropic_image_block_and_count_tokens(claude):
    def ask(data: bytes):
        return claude.messages.create(
            model=MODEL, messages=anthropic_message(data), max_tokens=8, extra_body={"temperature": 0}
        )

    a, b, again = ask(A), ask(B), ask(A)
    text = [m.content[0].text for m in (a, b, again)]
    assert text[0] == text[2] != text[1]
    counted = claude.messages.count_tokens(model=MODEL, messages=anthropic_message(A))
    # Anthropic's usage: input_tokens leaves out what the prefix cache read
    assert counted.input_tokens == a.usage.input_tokens + (a.usage.cache_read_input_tokens or 0)
    text_only = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": PROMPT}])
    assert counted.input_tokens - text_only.input_tokens >= 4


def test_anthropic_url_source_refused(claude):
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError, match="allowed_media_domains"):
        claude.messages.create(model=MODEL, messages=[{"role": "user", "content": [block]}], max_tokens=2)


# ---- TGI (huggingface_hub) -----------------------------------------------------------------------------


def test_tgi_text_generation_markdown_image(vlm):
    client = InferenceClient(base_url=vlm, api_key=KEY, timeout=TIMEOUT)

    def ask(data: bytes):
        return client.text_generation(f"![]({data_url(data)}) {PROMPT}", max_new_tokens=8, details=True)

    a, b, again = ask(A), ask(B), ask(A)
    assert a.generated_text == again.generated_text != b.generated_text
    assert a.details.generated_tokens == 8


def test_tgi_chat_completion_image_url(vlm):
    client = InferenceClient(base_url=vlm, api_key=KEY, timeout=TIMEOUT)

    def ask(data: bytes) -> str:
        out = client.chat_completion(image_message(data), max_tokens=8, temperature=0)
        return out.choices[0].message.content

    assert ask(A) == ask(A) != ask(B)


def test_tgi_tokenize_counts_the_image_tokens(http):
    plain = http.post("/tokenize", json={"inputs": PROMPT}).json()
    with_image = http.post("/tokenize", json={"inputs": f"![]({data_url(A)}){PROMPT}"})
    assert with_image.status_code == 200, with_image.text
    assert len(with_image.json()) - len(plain) >= 4
    chat = http.post("/chat_tokenize", json={"messages": image_message(A)})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["tokenize_response"]) > len(chat.json()["templated_text"].split())


# ---- LMI / SageMaker, KServe V2, Vertex (plain HTTP) ---------------------------------------------------


def test_invocations_messages_with_an_image(http):
    def ask(data: bytes) -> str:
        r = http.post("/invocations", json={"messages": image_message(data), "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert ask(A) == ask(A) != ask(B)


def test_kserve_infer_and_generate_with_an_image(http, name):
    def infer(data: bytes) -> str:
        body = {
            "inputs": [
                {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]},
                {"name": "image", "datatype": "BYTES", "shape": [1], "data": [b64(data)]},
            ],
            "parameters": {"max_new_tokens": 8},
        }
        r = http.post(f"/v2/models/{name}/infer", json=body)
        assert r.status_code == 200, r.text
        return r.json()["outputs"][0]["data"][0]

    assert infer(A) == infer(A) != infer(B)
    r = http.post(f"/v2/models/{name}/generate", json={"text_input": PROMPT, "image": data_url(A), "max_tokens": 8})
    assert r.status_code == 200 and r.json()["text_output"] == infer(A), r.text


def test_kserve_grpc_infer_with_image_bytes(http, name, served):
    """gRPC ModelInfer (tritonclient): the `image` input holding the PNG file's own bytes."""

    def infer(data: bytes) -> str:
        text = triton.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
        image = triton.InferInput("image", [1], "BYTES")
        image.set_data_from_numpy(np.array([data], dtype=object))
        auth = {"authorization": f"Bearer {KEY}"}
        with triton.InferenceServerClient(f"127.0.0.1:{served[1]}") as client:
            result = client.infer(name, [text, image], parameters={"max_new_tokens": 8}, headers=auth)
        return result.as_numpy("text_output")[0].decode()

    over_http = http.post(
        f"/v2/models/{name}/generate", json={"text_input": PROMPT, "image": b64(A), "max_tokens": 8}
    ).json()["text_output"]
    assert infer(A) == over_http != infer(B)
    with pytest.raises(Exception, match="image"):
        infer(b"not an image at all, \xff\xfe")


def test_vertex_instances_with_an_image(http):
    def predict(data: bytes) -> str:
        body = {"instances": [{"prompt": PROMPT, "image": b64(data)}], "parameters": {"max_new_tokens": 8}}
        r = http.post("/v1/endpoints/e/deployedModels/d:predict", json=body)
        assert r.status_code == 200, r.text
        return r.json()["predictions"][0]

    assert predict(A) == predict(A) != predict(B)


# ---- hostile images: a 400 in each protocol's shape -------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_images_are_400_everywhere(kind, oai, claude, http, name, vlm):
    data, media_type = hostile(kind)
    url = data_url(data, media_type)
    with pytest.raises(openai.BadRequestError, match="image"):
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            max_tokens=2,
        )
    with pytest.raises(openai.BadRequestError, match="image"):
        oai.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
            max_output_tokens=2,
        )
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=MODEL, messages=anthropic_message(data, media_type), max_tokens=2)
    r = http.post("/generate", json={"inputs": f"![]({url}) hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and "image" in r.json()["error"], r.text
    r = http.post("/invocations", json={"messages": image_message(data), "max_tokens": 2})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"], r.text
    infer = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
            {"name": "image", "datatype": "BYTES", "shape": [1], "data": [b64(data)]},
        ]
    }
    r = http.post(f"/v2/models/{name}/infer", json=infer)
    assert r.status_code == 400 and "image" in r.json()["error"], r.text
    r = http.post(
        "/v1/endpoints/e/deployedModels/d:predict", json={"instances": [{"prompt": "hi", "image": b64(data)}]}
    )
    assert r.status_code == 400 and "image" in r.text, r.text
    assert httpx.get(f"{vlm}/ping", timeout=TIMEOUT).status_code == 200  # the server lives on


# ---- a text model --------------------------------------------------------------------------------------


def test_a_text_model_refuses_images_naming_it(server):
    model = server.name
    r = server.post({"messages": image_message(A), "max_tokens": 2}, path="/v1/chat/completions")
    assert r.status_code == 400, r.text
    assert f"The model '{model}' does not take images" in r.json()["error"]["message"]
    body = {"model": model, "max_tokens": 2, "messages": anthropic_message(A)}
    r = server.post(body, path="/v1/messages")
    assert r.status_code == 400 and f"'{model}' does not take images" in r.json()["error"]["message"], r.text
    r = server.post({"text_input": "hi", "image": b64(A)}, path=f"/v2/models/{model}/generate")
    assert r.status_code == 400 and f"'{model}' does not take images" in r.json()["error"], r.text


# ---- http(s) images from an allowed host -----------------------------------------------------------------


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A local HTTP server: /a.png (image A), /moved (a redirect to /a.png), /away (a redirect to a host
    not allowed)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/a.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(A)))
                self.end_headers()
                self.wfile.write(A)
                return
            target = {"/moved": "/a.png", "/away": "http://example.com/a.png"}.get(self.path)
            self.send_response(302 if target else 404)
            if target:
                self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def fetching(server_pool, tiny_vlm_dir) -> str:
    """The same model, allowed to fetch images from 127.0.0.1 (a private address, so allowed too)."""
    args = ["--model-id", str(tiny_vlm_dir(FAMILY)), "-o", f"served_model_name={MODEL}", "--grpc-port", "0"]
    args += ["-o", "allowed_media_domains=127.0.0.1", "-o", "allow_private_media_urls=true"]
    return server_pool.url(args, timeout=300)


def test_http_images_from_an_allowed_host(fetching, image_host):
    """An allowed host's image answers as the same image sent as a data URL (OpenAI chat, Anthropic's url
    source), a redirect within the host is followed, a redirect to a host not allowed is a 400."""
    with openai.OpenAI(base_url=f"{fetching}/v1", api_key="-", max_retries=0, timeout=TIMEOUT) as oai:

        def ask(url: str):
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, PROMPT_PART]}]
            return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)

        inline, fetched, moved = ask(data_url(A)), ask(f"{image_host}/a.png"), ask(f"{image_host}/moved")
        assert fetched.choices[0].message.content == inline.choices[0].message.content
        assert moved.choices[0].message.content == inline.choices[0].message.content
        assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="allowed_media_domains"):
            ask(f"{image_host}/away")
        with pytest.raises(openai.BadRequestError, match="404"):
            ask(f"{image_host}/missing.png")
    with anthropic.Anthropic(base_url=fetching, api_key="-", max_retries=0, timeout=TIMEOUT) as claude:
        block = {"type": "image", "source": {"type": "url", "url": f"{image_host}/a.png"}}
        by_url = claude.messages.create(
            model=MODEL,
            max_tokens=8,
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": [block, PROMPT_PART]}],
        )
        by_data = claude.messages.create(
            model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=anthropic_message(A)
        )
        assert by_url.content[0].text == by_data.content[0].text  # type: ignore[union-attr]


PROMPT_PART = {"type": "text", "text": PROMPT}
