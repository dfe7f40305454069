"""Images in generation requests, for a vision-language model (docs/vision.md); owned by no protocol.

- A protocol's parse step writes `MARK` into a message's text where an image part was (OpenAI's
  ``image_url``, Responses' ``input_image``, Anthropic's ``image`` block, TGI's markdown ``![](url)``)
  and collects its `ImageSource`, in the same order (`url_source`, `base64_source`, `markdown`).
- The route loads the sources before it renders the prompt (`load`): a 400 naming the model when it
  takes no images, at most `limit_mm_per_prompt` of them, each fetched and decoded under the server's
  media limits (lmiserve/media/).
- `Served.render_chat` hands a vision model's processor each message as content parts, a mark as an
  ``{"type": "image"}`` part (`template_content`), so the family's chat template writes its own image
  placeholders; a raw prompt's marks (TGI's ``inputs``) become the placeholder that template writes
  (`placeholder`). The engine request carries the images in the marks' order.

The mark holds a random token made at start, so a client cannot forge one in its text.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

from lmiserve.core.errors import InvalidRequest, excerpt
from lmiserve.core.image_prompt import placeholder
from lmiserve.core.media import Image, ImageSource
from lmiserve.media import load_images, media_limits

__all__ = [
    "MARK",
    "base64_source",
    "has_marks",
    "load",
    "markdown",
    "no_vision",
    "placeholder",
    "template_content",
    "template_messages",
    "url_source",
]

MARK = f"\ue000image-{secrets.token_hex(8)}\ue000"  # an image's place in a message's text
URL_SCHEMES = ("data", "http", "https")
# TGI's markdown image: ![alt](url) (the url without spaces or closing parenthesis)
MARKDOWN_IMAGE = re.compile(r"!\[[^\]\n]*\]\(([^)\s]+)\)")


def url_source(url: Any, where: str) -> ImageSource:
    """An image URL as the client gave it: a ``data:`` URL, or an ``http(s)`` one the loader may fetch;
    `InvalidRequest` naming `where` for anything else."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidRequest(f"{where}: an image URL (a non-empty string) is required")
    scheme = url.strip().split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in URL_SCHEMES:
        raise InvalidRequest(f"{where}: an image URL must be a data: URL or an http(s) URL. Given: {excerpt(url, 64)}")
    return ImageSource(url=url.strip())


def base64_source(data: Any, media_type: Any, where: str) -> ImageSource:
    """An image given as base64 text (Anthropic's ``base64`` source, a tensor's element), as the
    ``data:`` URL the loader decodes (its size checked before decoding; `media_type` checked there too,
    none: ``image/*``, the bytes tell the format); `InvalidRequest` naming `where` for what is not text."""
    if not isinstance(data, str) or not data.strip():
        raise InvalidRequest(f"{where}: base64 image data (a non-empty string) is required")
    if media_type is not None and (not isinstance(media_type, str) or "," in media_type or ";" in media_type):
        raise InvalidRequest(f"{where}: media_type must be an image media type such as image/png")
    return ImageSource(url=f"data:{media_type or 'image/*'};base64,{data}")


def markdown(text: str) -> tuple[str, list[ImageSource]]:
    """TGI's ``inputs``: each markdown image ``![](url)`` becomes `MARK`; the text and the sources."""
    sources: list[ImageSource] = []

    def mark(match: re.Match[str]) -> str:
        sources.append(url_source(match.group(1), "inputs"))
        return MARK

    return MARKDOWN_IMAGE.sub(mark, text), sources


def has_marks(messages: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), str) and MARK in m["content"] for m in messages)


def template_content(content: Any) -> Any:
    """A message's content as a vision model's chat template takes it: content parts, each mark an
    ``{"type": "image"}`` part, the text between them ``{"type": "text"}`` parts (whitespace-only pieces
    left out); content that is not a string is left as it is."""
    if not isinstance(content, str):
        return content
    if MARK not in content:
        return [{"type": "text", "text": content}]
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(content.split(MARK)):
        if i:
            parts.append({"type": "image"})
        if piece.strip():
            parts.append({"type": "text", "text": piece})
    return parts


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`template_content` of every message (the other keys kept)."""
    return [{**m, "content": template_content(m.get("content"))} for m in messages]


async def load(settings: Any, model_name: str, takes_images: bool, sources: Sequence[ImageSource]) -> tuple[Image, ...]:
    """The request's images, decoded (none: ``()``): a 400 naming the model when it takes no images, or
    for more images than `limit_mm_per_prompt`, or an image the loader refuses (not allowed to fetch, too
    large, not an image)."""
    if not sources:
        return ()
    if not takes_images:
        raise no_vision(model_name)
    return await load_images(tuple(sources), media_limits(settings))


def no_vision(model_name: str) -> InvalidRequest:
    return InvalidRequest(
        f"The model '{model_name}' does not take images (it is not a vision-language model): send text only."
    )
