"""Image inputs as each protocol's parse step reads them (issue #40, docs/vision.md), without a server:
the shared step (lmiserve/protocols/textgen/images.py: sources, marks, template content, TGI's markdown,
the raw-prompt placeholders), OpenAI's chat parts, Responses' ``input_image``, Anthropic's ``image``
blocks, vLLM's /tokenize bodies, and the records of Vertex / SageMaker. Over HTTP: test_vision_http.py."""

from __future__ import annotations

import pytest

from helpers.fake_vision import FakeProcessor, vision_tokenizer
from lmiserve.core.errors import InvalidRequest
from lmiserve.core.image_prompt import markers, placeholder, raw_prompt
from lmiserve.core.media import ImageSource
from lmiserve.core.tensors import ModelSignature
from lmiserve.models.llm_tensor import IMAGE, SIGNATURE, VISION_SIGNATURE, image_source
from lmiserve.protocols.anthropic import parse as anthropic
from lmiserve.protocols.anthropic.schema import CountTokensRequest
from lmiserve.protocols.openai import responses_input
from lmiserve.protocols.openai.errors import InvalidValue
from lmiserve.protocols.openai.tokenize import image_sources as tokenize_sources
from lmiserve.protocols.tensor import records
from lmiserve.protocols.textgen import images
from lmiserve.protocols.textgen.chat import ChatRequest, Message

MARK = images.MARK
DATA = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module")
def processor() -> FakeProcessor:
    return FakeProcessor(vision_tokenizer())


# ---- the shared step -------------------------------------------------------------------------------


def test_url_source_takes_data_and_http_urls():
    assert images.url_source(DATA, "x") == ImageSource(url=DATA)
    assert images.url_source(" https://example.com/a.png ", "x") == ImageSource(url="https://example.com/a.png")
    assert images.url_source("HTTP://example.com/a.png", "x").url == "HTTP://example.com/a.png"


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://h/a.png", "a.png", "", "  ", None, 3, {"url": DATA}])
def test_url_source_refuses_other_values_naming_the_field(url):
    with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.content\[1\]"):
        images.url_source(url, "messages[0].content[1]")


def test_base64_source_is_a_data_url_for_the_loader():
    assert images.base64_source("QUJD", "image/jpeg", "w") == ImageSource(url="data:image/jpeg;base64,QUJD")
    assert images.base64_source("QUJD", None, "w").url == "data:image/*;base64,QUJD"
    for data, media in [("", "image/png"), (None, "image/png"), (b"QUJD", "image/png"), ("QUJD", 5)]:
        with pytest.raises(InvalidRequest, match="^w"):
            images.base64_source(data, media, "w")
    with pytest.raises(InvalidRequest, match="media_type"):  # no parameters smuggled into the data URL
        images.base64_source("QUJD", "image/png;base64,AAAA", "w")


def test_markdown_images_become_marks_in_order():
    text, sources = images.markdown("Look: ![a cat](https://h/cat.png) and ![](data:image/png;base64,QUJD)!")
    assert text == f"Look: {MARK} and {MARK}!"
    assert [s.url for s in sources] == ["https://h/cat.png", "data:image/png;base64,QUJD"]
    assert images.markdown("no image [link](https://h) here") == ("no image [link](https://h) here", [])
    with pytest.raises(InvalidRequest, match="inputs"):
        images.markdown("![](file:///etc/passwd)")


def test_template_content_gives_image_parts_in_place():
    assert images.template_content("hi") == [{"type": "text", "text": "hi"}]
    assert images.template_content(f"What is {MARK} this?{MARK}") == [
        {"type": "text", "text": "What is "},
        {"type": "image"},
        {"type": "text", "text": " this?"},
        {"type": "image"},
    ]
    assert images.template_content(f"{MARK}\n\n") == [{"type": "image"}]  # whitespace-only pieces dropped
    assert images.template_content(None) is None
    parts = [{"type": "text", "text": "x"}]
    assert images.template_content(parts) is parts
    messages = [{"role": "user", "content": MARK, "name": "n"}]
    assert images.template_messages(messages) == [{"role": "user", "content": [{"type": "image"}], "name": "n"}]
    assert images.has_marks(messages) and not images.has_marks([{"role": "user", "content": "x"}])


def test_the_mark_cannot_be_guessed_from_outside():
    assert MARK.startswith("\ue000image-") and len(MARK) > 20


def test_placeholder_is_what_the_template_writes(processor):
    assert placeholder(processor) == "<image>"
    assert markers(processor) == ("<image>",)


def test_placeholder_of_a_qwen_like_template():
    class Qwen:
        image_token = "<|image_pad|>"

        def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=False):
            parts = conversation[0]["content"]
            body = "".join(
                "<|vision_start|><|image_pad|><|vision_end|>" if p["type"] == "image" else p["text"] for p in parts
            )
            return f"<|im_start|>user\n{body}<|im_end|>\n"

    qwen = Qwen()
    assert placeholder(qwen) == "<|vision_start|><|image_pad|><|vision_end|>"
    assert raw_prompt("describe", 2, qwen) == "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "describe"
    assert raw_prompt("a <|image_pad|> b", 1, qwen) == "a <|image_pad|> b"  # its own placeholder kept


def test_placeholder_falls_back_to_the_image_token():
    class Broken:
        image_token = "<img>"

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("no template")

    assert placeholder(Broken()) == "<img>"


def test_raw_prompt(processor):
    assert raw_prompt("hi", 0, None) == "hi"
    assert raw_prompt("hi", 2, processor) == "<image><image>hi"
    assert raw_prompt("USER: <image>\nWhat? ASSISTANT:", 1, processor) == "USER: <image>\nWhat? ASSISTANT:"
    with pytest.raises(InvalidRequest, match="does not take images"):
        raw_prompt("hi", 1, None)


def test_no_vision_names_the_model():
    assert "model 'org/text-model' does not take images" in images.no_vision("org/text-model").message


# ---- OpenAI chat (and TGI's chat, LMI's and SageMaker's messages) ----------------------------------


def _chat(content) -> ChatRequest:
    return ChatRequest.model_validate(
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}]}
    )


def test_openai_image_url_parts_in_order():
    req = _chat(
        [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": DATA, "detail": "low"}},
            {"type": "text", "text": " with "},
            {"type": "image_url", "image_url": "https://h/b.png"},  # vLLM's bare string
        ]
    )
    assert req.messages[1].text() == f"Compare {MARK} with {MARK}"
    assert [s.url for s in req.image_sources()] == [DATA, "https://h/b.png"]
    assert _chat("plain text").image_sources() == []


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url"},
        {"type": "image_url", "image_url": {}},
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "image_url", "image_url": 7},
    ],
)
def test_openai_bad_image_url_parts_name_the_part(part):
    with pytest.raises(InvalidRequest, match=r"messages\[1\]\.content\[0\]\.image_url"):
        _chat([part]).image_sources()


def test_message_text_without_images_is_unchanged():
    assert Message(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]).text() == "ab"


# ---- the Responses API --------------------------------------------------------------------------------


def test_responses_input_image_parts():
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is "},
                {"type": "input_image", "image_url": DATA, "detail": "auto"},
            ],
        },
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_image", "image_url": "https://h/x"}],
        },
    ]
    assert [s.url for s in responses_input.image_sources(items)] == [DATA, "https://h/x"]
    messages = responses_input.messages(items[:1], None)
    assert messages[0].content == f"What is {MARK}"
    assert responses_input.image_sources(responses_input.input_items("just text")) == []


def test_responses_file_id_and_bad_urls_are_400_naming_the_field():
    with pytest.raises(InvalidValue) as exc:
        responses_input.image_sources([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}])
    assert exc.value.param == "input[0].content[0].file_id" and "file_id" in exc.value.message
    with pytest.raises(InvalidValue) as exc:
        responses_input.image_sources([{"role": "user", "content": [{"type": "input_image", "image_url": "x.png"}]}])
    assert exc.value.param == "input[0].content[0].image_url"


# ---- Anthropic --------------------------------------------------------------------------------------------


def _anthropic(*content, role="user") -> CountTokensRequest:
    return CountTokensRequest.model_validate({"model": "m", "messages": [{"role": role, "content": list(content)}]})


BASE64_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}
URL_BLOCK = {"type": "image", "source": {"type": "url", "url": "https://h/a.png"}}


def test_anthropic_image_blocks_in_order():
    req = _anthropic(BASE64_BLOCK, {"type": "text", "text": "and"}, URL_BLOCK, {"type": "text", "text": "what?"})
    assert [s.url for s in anthropic.image_sources(req)] == ["data:image/png;base64,QUJD", "https://h/a.png"]
    messages, _ = anthropic.conversation(req)
    assert messages[0].content == f"{MARK}and{MARK}what?"  # text blocks still joined by a blank line
    req = _anthropic({"type": "text", "text": "a"}, {"type": "text", "text": "b"}, BASE64_BLOCK)
    assert anthropic.conversation(req)[0][0].content == f"a\n\nb{MARK}"


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ({"type": "file", "file_id": "f"}, "file"),
        ({"type": "base64", "media_type": "image/png"}, "base64 image data"),
        ({"type": "url", "url": "ftp://h/a"}, "url"),
        ({"type": "other"}, "must be `base64` or `url`"),
    ],
)
def test_anthropic_bad_sources_name_the_block(source, match):
    with pytest.raises(InvalidRequest, match=rf"^messages\.0\.content\.0\.source.*{match}"):
        anthropic.image_sources(_anthropic({"type": "image", "source": source}))


def test_anthropic_images_elsewhere_are_400():
    with pytest.raises(InvalidRequest, match="user"):
        anthropic.conversation(_anthropic(BASE64_BLOCK, role="assistant"))
    result = {"type": "tool_result", "tool_use_id": "t", "content": [BASE64_BLOCK]}
    with pytest.raises(InvalidRequest, match="image"):
        anthropic.conversation(_anthropic(result))


# ---- vLLM's /tokenize ------------------------------------------------------------------------------------


def test_tokenize_image_sources():
    payload = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA}}]}]}
    assert tokenize_sources(payload) == [ImageSource(url=DATA)]
    assert tokenize_sources({"prompt": "x"}) == [] and tokenize_sources([1]) == []


# ---- KServe V2 and Vertex: the `image` input ------------------------------------------------------------


def test_image_elements():
    assert image_source(DATA).url == DATA
    assert image_source(b" QUJD\n").url == "data:image/*;base64,QUJD"
    assert image_source(b"\x89PNG\r\n\x1a\n...") == ImageSource(data=b"\x89PNG\r\n\x1a\n...")
    for bad in ("", b"  ", 5):
        with pytest.raises(InvalidRequest, match=IMAGE):
            image_source(bad)


def test_records_with_an_image_beside_the_prompt():
    req = records.to_request(
        [{"prompt": "a", "image": "QUJD"}, {"text_input": "b", "image": "REVG"}], VISION_SIGNATURE, "m"
    )
    assert [v.decode() if isinstance(v, bytes) else v for v in req.inputs["text_input"]] == ["a", "b"]
    assert len(req.inputs[IMAGE]) == 2
    plain = records.to_request(["a", {"prompt": "b"}], VISION_SIGNATURE, "m")  # no image: as a text model's
    assert set(plain.inputs) == {"text_input"}
    with pytest.raises(Exception, match="same inputs"):
        records.to_request([{"prompt": "a", "image": "QUJD"}, "b"], VISION_SIGNATURE, "m")
    with pytest.raises(Exception, match="one input"):
        records.to_request([{"prompt": "a", "text": "b", "image": "QUJD"}], VISION_SIGNATURE, "m")


def test_a_text_model_declares_no_image_input():
    assert isinstance(SIGNATURE, ModelSignature) and SIGNATURE.input(IMAGE) is None
    with pytest.raises(Exception, match="unexpected inference input 'image' for model 'm'"):
        records.to_request([{"prompt": "a", "image": "QUJD"}], SIGNATURE, "m")
