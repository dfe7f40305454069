"""The vision scenario (`lmiserve bench --scenario vision`): single-turn chats over
``/v1/chat/completions``, each user message one image (an OpenAI ``image_url`` part holding a
``data:image/png;base64`` URL) and one short question, with the token count forced as in the chat
scenario (``max_tokens = min_tokens = N``, ``ignore_eos``).

Request number `k` (a level's measured requests are numbered 0, 1, ... across its clients, as the
chat scenario numbers its conversations; warm-ups from `WARMUP_NUMBER` on) sends image `k` and
question `k`: every request of a run has an image of its own, so the prefix cache, which keys the
image's KV blocks by the image's content, cannot answer one request with another's image. The images
are drawn here, deterministically from `k` (a two-colour gradient and a few filled shapes, 640 x 480
PNG by default), and encoded before the level starts, so the clients' clock never times the drawing.

The in-process baseline (`baselines_vision.py`) gives `model.generate` the same images and questions,
requests 0 .. B-1 as one batch of B.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lmiserve.bench.chat import WARMUP_CONVERSATIONS
from lmiserve.bench.conversations import Conversation, conversation_number

IMAGE_SIZE = (640, 480)  # (width, height): a photo's size in a typical chat upload, scaled down
WARMUP_NUMBER = WARMUP_CONVERSATIONS  # the chat loop numbers warm-up requests from here
PROBE_NUMBER = WARMUP_NUMBER - 1

QUESTIONS: tuple[str, ...] = (
    "Describe this image in detail.",
    "What shapes do you see in this picture, and what colours are they?",
    "Which object in the image is the largest? Explain how you can tell.",
    "Write a short caption for this image.",
    "What colour is the background, and how does it change from top to bottom?",
    "How many shapes overlap each other in this image?",
    "Describe the image to someone who cannot see it.",
    "What could this picture be used for in a presentation?",
)


@lru_cache(maxsize=64)
def draw_image(number: int, size: tuple[int, int] = IMAGE_SIZE) -> Any:
    """Image `number` (a ``PIL.Image.Image``, RGB, `size`): the same for the same number, in every run."""
    from PIL import Image, ImageDraw  # the bench extra's matplotlib brings Pillow

    rng = random.Random(number)
    width, height = size
    top, bottom = (tuple(rng.randrange(256) for _ in range(3)) for _ in range(2))
    ramp = Image.linear_gradient("L").resize(size)
    image = Image.composite(Image.new("RGB", size, bottom), Image.new("RGB", size, top), ramp)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randrange(4, 9)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        box = (x0, y0, x0 + rng.randrange(20, max(21, width // 2)), y0 + rng.randrange(20, max(21, height // 2)))
        fill = tuple(rng.randrange(256) for _ in range(3))
        shape = draw.rectangle if rng.randrange(2) else draw.ellipse
        shape(box, fill=fill, outline=(0, 0, 0), width=rng.randrange(1, 5))
    return image


@lru_cache(maxsize=4096)
def image_data_url(number: int, size: tuple[int, int] = IMAGE_SIZE) -> str:
    """Image `number` as a PNG ``data:`` URL (cached: a level's URLs are made before it starts)."""
    buffer = io.BytesIO()
    draw_image(number, size).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def question(number: int) -> str:
    """The question of request `number`."""
    return QUESTIONS[number % len(QUESTIONS)]


def vision_messages(number: int, size: tuple[int, int] = IMAGE_SIZE) -> list[dict[str, Any]]:
    """The OpenAI chat messages of request `number`: one user message, its image then its question."""
    content = [
        {"type": "image_url", "image_url": {"url": image_data_url(number, size)}},
        {"type": "text", "text": question(number)},
    ]
    return [{"role": "user", "content": content}]


@dataclass
class VisionRequest(Conversation):
    """A one-turn conversation whose question carries image `number` (what the chat scenario's closed
    loop, `run_chat_level`, runs with ``turns=1``); its history keeps the question's text only."""

    system_prompt: str = ""
    size: tuple[int, int] = IMAGE_SIZE

    def __post_init__(self) -> None:
        self.messages = []

    @property
    def turn(self) -> int:
        return 1

    @property
    def awaiting_reply(self) -> bool:
        return bool(self.messages) and self.messages[-1]["role"] == "user"

    def ask(self) -> list[dict[str, Any]]:
        if self.messages:
            raise RuntimeError("a vision request asks once")
        self.messages.append({"role": "user", "content": question(self.number)})
        return vision_messages(self.number, self.size)


def level_numbers(concurrency: int, requests_per_client: int, warmup: int) -> list[int]:
    """The request numbers a level sends without --duration (warm-ups included): their images are
    encoded before the level starts."""
    measured = [conversation_number(c, i, concurrency) for c in range(concurrency) for i in range(requests_per_client)]
    warm = [WARMUP_NUMBER + c + w * concurrency for c in range(concurrency) for w in range(warmup)]
    return [*measured, *warm]


def prepare_images(numbers: Iterable[int], size: tuple[int, int] = IMAGE_SIZE) -> None:
    """Encode these requests' images now (they are cached), off the clients' clock."""
    for number in numbers:
        image_data_url(number, size)
