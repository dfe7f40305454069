"""The images of one request, from what the client sent (`ImageSource`) to decoded `Image`s.

`load_images` checks the count first (`limit_mm_per_prompt`), then gets each image's bytes (a base64
``data:`` URL, bytes the protocol already decoded, or an http(s) fetch: fetch.py) and decodes them
(decode.py), all images at once; base64 and image decoding run in worker threads, off the event loop.
The first image that fails ends the request with its InvalidRequest (the others are cancelled).
Images are numbered from 1 in the messages, in the request's order.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Sequence

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import Image, ImageSource, MediaLimits
from lmiserve.media.decode import decode_image, too_large

_URL_SAFE = str.maketrans("-_", "+/")


async def load_images(sources: Sequence[ImageSource], limits: MediaLimits) -> tuple[Image, ...]:
    """The decoded images of `sources`, in order; InvalidRequest (a client error, its message safe to
    show) for too many images or the first image that cannot be had."""
    check_count(len(sources), limits)
    if not sources:
        return ()
    tasks = [asyncio.ensure_future(load_image(source, limits, index)) for index, source in enumerate(sources, 1)]
    try:
        return tuple(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def check_count(count: int, limits: MediaLimits) -> None:
    """InvalidRequest when a request has more images than `limit_mm_per_prompt` allows."""
    if count > limits.max_images:
        if limits.max_images == 0:
            raise InvalidRequest("this server accepts no images (its limit_mm_per_prompt allows 0)")
        raise InvalidRequest(
            f"the request has {count} images; the server accepts at most {limits.max_images} per request "
            "(limit_mm_per_prompt)"
        )


async def load_image(source: ImageSource, limits: MediaLimits, index: int = 1) -> Image:
    """One image: its bytes, then decoded (in a worker thread)."""
    if source.data is not None:
        check_media_type(source.media_type, index)
        return await asyncio.to_thread(decode_image, source.data, limits, index)
    url = (source.url or "").strip()
    if not url:
        raise InvalidRequest(f"image {index} has neither a URL nor data")
    head, colon, _ = url[:16].partition(":")  # (a data: URL may be megabytes long: not copied here)
    scheme = head.lower() if colon else ""
    if scheme == "data":
        check_media_type(source.media_type, index)
        return await asyncio.to_thread(_decode_data_url, url, limits, index)
    if scheme in ("http", "https"):
        from lmiserve.media.fetch import fetch_image  # httpx, imported only when a server fetches an image

        data = await fetch_image(url, limits, index)
        return await asyncio.to_thread(decode_image, data, limits, index)
    shown = f"{scheme[:20]}: URLs" if scheme else "this URL"
    raise InvalidRequest(f"image {index}: only data: and http(s) image URLs are accepted, not {shown}")


def check_media_type(media_type: str | None, index: int) -> None:
    """A media type the client named must be an image's (SVG refused); None: nothing named. The bytes
    decide the format afterwards (decode.py), whatever the type says."""
    if media_type is None:
        return
    kind = media_type.split(";", 1)[0].strip().lower()
    if kind == "image/svg+xml":
        raise InvalidRequest(f"image {index} is an SVG (vector) image, which is not accepted")
    if not kind.startswith("image/") or len(kind) <= len("image/"):
        raise InvalidRequest(f"image {index}: the media type must be an image type (image/png, ...), not {kind[:60]!r}")


def data_url_bytes(url: str, limits: MediaLimits, index: int = 1) -> bytes:
    """The payload of a base64 ``data:image/...;base64,...`` URL; its size is checked on the base64 text
    before decoding."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise InvalidRequest(f"image {index}: the data: URL has no ',' before its data")
    media_type, *params = (part.strip().lower() for part in header.split(";"))
    if "base64" not in params:
        raise InvalidRequest(f"image {index}: only base64 data: URLs are accepted (data:image/png;base64,...)")
    check_media_type(media_type, index)
    if len(payload) > (limits.max_image_bytes + 2) // 3 * 4 + 1024:  # slack: line breaks in the base64
        raise too_large(index, limits)
    text = "".join(payload.split()).translate(_URL_SAFE)
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"image {index}: the data: URL's data is not valid base64") from None
    if len(data) > limits.max_image_bytes:
        raise too_large(index, limits)
    return data


def _decode_data_url(url: str, limits: MediaLimits, index: int) -> Image:
    return decode_image(data_url_bytes(url, limits, index), limits, index)
