"""A fake vision-language model for the protocols' HTTP tests: `vision_app` is `helpers.text_app`'s app
(scripted fake engine, real tiny tokenizer) with a `FakeProcessor` as the model's processor, so every
protocol's image path runs for real up to the engine request (parse, load, decode, render, count) and the
fake engine encodes the request through the real `ImageCodec`.

The processor's chat template writes ``<image>`` for an image part; its expansion of ``<image>`` is
`TOKENS_PER_IMAGE` image tokens and one ordinary token picked by the image's pixels, so two images give
two prompts (and the fake engine's derived answers differ) and the token counts are known. Images are
made by `png` (a solid colour), `data_url` wraps one.
"""

from __future__ import annotations

import base64
import functools
import io
from typing import Any

import numpy as np

from helpers.text_app import TextApp, text_app
from helpers.tiny_model import build_tiny_tokenizer
from lmiserve.engine.text.images import ImageCodec
from lmiserve.media import media_limits
from lmiserve.models.llm_tensor import LlmTensorModel

IMAGE_TOKEN = "<image>"
TOKENS_PER_IMAGE = 4
IMAGE_EXPANSION = TOKENS_PER_IMAGE + 1  # the image tokens, then the pixel-picked token


class FakeProcessor:
    """The processor calls lmiserve makes: `apply_chat_template` (content parts) and `__call__`."""

    image_token = IMAGE_TOKEN
    chat_template = "fake: <|role|>text-or-<image></s> per message"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        self.calls: list[dict[str, Any]] = []  # each template call's messages

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        self.calls.append({"messages": conversation, **kwargs})
        out = ""
        for message in conversation:
            content = message.get("content")
            if not isinstance(content, list):  # a vision model's template gets content parts, always
                raise TypeError(f"content must be a list of parts, got {type(content).__name__}")
            text = "".join(IMAGE_TOKEN if part["type"] == "image" else part["text"] for part in content)
            out += f"<|{message['role']}|>{text}"
            if not (continue_final_message and message is conversation[-1]):
                out += "</s>"
        if add_generation_prompt:
            out += "<|assistant|>"
        return out

    def __call__(
        self, text: list[str], images: Any = None, add_special_tokens: bool = True, return_tensors: Any = None, **_: Any
    ) -> dict[str, Any]:
        (prompt,) = text
        pictures = list(images[0]) if images else []
        pieces = prompt.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(pictures):
            raise ValueError(f"{len(pieces) - 1} image tokens in the text for {len(pictures)} images")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            ids += self.tokenizer(piece, add_special_tokens=add_special_tokens and i == 0)["input_ids"]
            if i < len(pictures):
                ids += [self.image_token_id] * TOKENS_PER_IMAGE + [pixel_token(pictures[i])]
        return {"input_ids": np.array([ids]), "pixel_values": np.zeros((len(pictures), 3), dtype=np.float32)}


def pixel_token(picture: Any) -> int:
    """An ordinary token id picked by the image's first pixel (ids 100..299 of the tiny vocabulary)."""
    r, g, b = picture.convert("RGB").getpixel((0, 0))
    return 100 + (r * 7 + g * 3 + b) % 200


def vision_tokenizer() -> Any:
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    return tokenizer


def vision_app(**options: Any) -> TextApp:
    """`text_app` (options as it takes them) serving a fake vision model: the processor on the loaded
    model, the engine's codec and the tensor model."""
    served = text_app(tokenizer=vision_tokenizer(), max_context=1024, **options)
    processor = FakeProcessor(served.fake.tokenizer)
    service = served.service
    service.loaded.processor = processor
    served.fake.codec.images = ImageCodec(processor, processor.image_token_id)
    settings = service.settings
    service._tensor_model = LlmTensorModel(
        served.fake, service.limits, service.name, processor=processor, media=media_limits(settings)
    )
    return served


def png(color: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (16, 16), fmt: str = "PNG") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes | None = None, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data if data is not None else png())}"


RED = png((200, 30, 30))
BLUE = png((20, 40, 220))
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'


@functools.cache
def bomb() -> bytes:
    """A small PNG that declares far more pixels than any limit (a decompression bomb's header)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (20000, 20000)).save(out, format="PNG")  # ~ 50 KB, 400 million pixels
    return out.getvalue()


HOSTILE = {
    "corrupt": b"\x89PNG\r\n\x1a\nthis is not a png at all",
    "truncated": RED[: len(RED) // 2],
    "svg": SVG,
    "text": b"hello, not an image",
}
