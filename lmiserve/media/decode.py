"""Decoding an image file's bytes into an RGB `Image`, safely.

- The format is read from the bytes, never from a media type: PNG, JPEG, GIF, WebP and BMP are decoded,
  and only by their own Pillow plugin (no other plugin is ever tried on the bytes). SVG and any other
  format are refused.
- The size in the header is checked against `max_image_pixels` before any pixel is decoded
  (decompression bombs); Pillow's own bomb check answers the same way.
- Truncated or corrupt files, whatever the plugin raises, are an InvalidRequest.
- An animated image gives its first frame; the EXIF orientation is applied; transparent pixels are
  composited over white (as vLLM does); 16-bit images are scaled to 8 bits.

`Image.digest` is the sha256 of the width, height, mode and RGB bytes: the same pixels, whatever the file
format or metadata, give the same digest (the prefix cache's key).
"""

from __future__ import annotations

import hashlib
import io
import re
from typing import Any

from PIL import Image as PILImage
from PIL import ImageOps, UnidentifiedImageError

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import Image, MediaLimits

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
ACCEPTED = "a PNG, JPEG, GIF, WebP or BMP image"
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_OBJECT_REPR = re.compile(r"<[^<>]*>")  # a Python object's repr in a message (an address): left out
_BOMB = (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning)


def sniff(data: bytes) -> str | None:
    """The format of an image file from its first bytes (one of `FORMATS`), or None."""
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def looks_like_svg(data: bytes) -> bool:
    """An SVG (or other XML) document: text starting with ``<``."""
    head = data[:4096].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return head.startswith(b"<") and (b"<svg" in head or head.startswith((b"<?xml", b"<!doctype svg")))


def decode_image(data: bytes, limits: MediaLimits, index: int = 1) -> Image:
    """`data` (an encoded image file) as an RGB `Image`, or InvalidRequest; `index` (1-based) names the
    image in the messages. Blocking: run it off the event loop."""
    if len(data) > limits.max_image_bytes:
        raise too_large(index, limits)
    name = sniff(data)
    if name is None:
        if looks_like_svg(data):
            raise InvalidRequest(f"image {index} is an SVG (vector) image, which is not accepted: send {ACCEPTED}")
        raise InvalidRequest(f"image {index} is not {ACCEPTED}")
    try:
        with PILImage.open(io.BytesIO(data), formats=[name]) as opened:
            width, height = opened.size
            if width * height > limits.max_image_pixels:
                raise _too_many_pixels(index, limits, f"{width}x{height} = {width * height} pixels")
            opened.load()  # the first frame of an animated image
            pixels = to_rgb(ImageOps.exif_transpose(opened))
    except InvalidRequest:
        raise
    except _BOMB:
        raise _too_many_pixels(index, limits, "too many pixels") from None
    except UnidentifiedImageError:
        raise InvalidRequest(f"could not decode image {index}: not a valid {name} file") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # what Pillow raises for a bad file
        raise InvalidRequest(f"could not decode image {index}: {_reason(exc)}") from None
    except Exception:  # noqa: BLE001 - a plugin's other errors on hostile bytes: a bad image, not a server error
        raise InvalidRequest(f"could not decode image {index}: the file is corrupt") from None
    return Image(pixels=pixels, digest=digest_of(pixels))


def to_rgb(image: Any) -> Any:
    """`image` in mode RGB: transparency composited over white, 16- and 32-bit values scaled to 8 bits."""
    if image.mode == "RGB":
        return image
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    if image.mode.startswith("I;16") or image.mode == "I":
        image = image.convert("I").point(lambda value: value * (1 / 256)).convert("L")
    return image.convert("RGB")


def digest_of(pixels: Any) -> str:
    """sha256 (hex) of an RGB image's size, mode and pixels."""
    width, height = pixels.size
    digest = hashlib.sha256(f"{width}x{height} {pixels.mode}\n".encode())
    digest.update(pixels.tobytes())
    return digest.hexdigest()


def too_large(index: int, limits: MediaLimits) -> InvalidRequest:
    """The refusal of an encoded image over `max_image_bytes`."""
    return InvalidRequest(
        f"image {index} is larger than the server's limit of {limits.max_image_bytes} bytes (max_image_bytes)"
    )


def _too_many_pixels(index: int, limits: MediaLimits, size: str) -> InvalidRequest:
    return InvalidRequest(
        f"image {index} is {size}, over the server's limit of {limits.max_image_pixels} pixels (max_image_pixels)"
    )


def _reason(exc: BaseException) -> str:
    """Pillow's words for a bad file, short and on one line ("image file is truncated ...")."""
    text = " ".join(_OBJECT_REPR.sub("", str(exc)).split())[:120]
    return text or "the file is corrupt"
