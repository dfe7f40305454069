"""Images as the engine and the protocols share them (vision-language models, docs/vision.md).

A protocol parses an image part into an `ImageSource` (what the client sent: a URL or bytes); the media
loader (`lmiserve/media/`) fetches and decodes it under the server's `MediaLimits` into an `Image`; a
`GenerationRequest` carries its images, in the order of the image placeholders its prompt's chat
template wrote. The engine hands them to the model's processor and never sees a URL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ImageSource:
    """An image as a client sent it, not yet fetched or decoded: `url` (a ``data:`` URL, or an
    ``http(s)`` URL the server may fetch) or `data` (the encoded file's bytes, base64 already decoded by
    the protocol); `media_type` where the protocol names one (Anthropic's ``media_type``)."""

    url: str | None = None
    data: bytes | None = None
    media_type: str | None = None

    def describe(self) -> str:
        """A short, safe description for error messages (never the whole data URL)."""
        if self.url is not None:
            return self.url[:32] + "..." if self.url.startswith("data:") else self.url[:200]
        return f"{len(self.data or b'')} bytes"


@dataclass(frozen=True, eq=False)
class Image:
    """A decoded image, ready for a model's processor: `pixels` is an RGB ``PIL.Image.Image``;
    `digest` the sha256 (hex) of its size and pixels, which keys the prefix cache (the same image shares
    KV blocks, another does not)."""

    pixels: Any
    digest: str

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        width, height = self.pixels.size
        return int(width), int(height)


@dataclass(frozen=True)
class MediaLimits:
    """What the server accepts in one request (settings `limit_mm_per_prompt`, `max_image_bytes`,
    `max_image_pixels`, `media_fetch_timeout`, `allowed_media_domains`, `allow_private_media_urls`)."""

    max_images: int = 4  # images per request (vLLM's limit_mm_per_prompt {"image": N})
    max_image_bytes: int = 20 * 1024 * 1024  # an encoded image (a data URL's payload, a fetched body)
    max_image_pixels: int = 64 * 1024 * 1024  # width x height once decoded (decompression bombs)
    fetch_timeout: float = 5.0  # seconds for an http(s) image, connect to last byte
    # hosts an http(s) image may come from (exact names, or "*.example.com"; "*": any); empty: none
    allowed_domains: tuple[str, ...] = field(default_factory=tuple)
    allow_private: bool = False  # may a fetch reach loopback/private/link-local addresses
