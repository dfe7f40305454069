"""Images from clients decoded under the server's limits (lmiserve/media): data: URLs and bytes, the
formats, the size and pixel caps, hostile files (corrupt, truncated, SVG, decompression bombs), frames,
modes, EXIF orientation and the digest. http(s) fetches: test_media_fetch.py."""

from __future__ import annotations

import ast
import asyncio
import base64
import io
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image as PILImage

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import ImageSource, MediaLimits
from lmiserve.media import check_count, decode_image, load_images
from lmiserve.media.decode import digest_of, sniff
from lmiserve.media.load import data_url_bytes

LIMITS = MediaLimits()
PACKAGE = Path(__file__).resolve().parents[2] / "lmiserve"


def encode(image: PILImage.Image, fmt: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def solid(color: tuple[int, ...] = (10, 20, 30), size: tuple[int, int] = (8, 6), mode: str = "RGB") -> bytes:
    return encode(PILImage.new(mode, size, color))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height and holds no pixel data (a decompression bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def load(*sources: ImageSource, limits: MediaLimits = LIMITS):
    return asyncio.run(load_images(sources, limits))


def refused(*sources: ImageSource, limits: MediaLimits = LIMITS) -> str:
    with pytest.raises(InvalidRequest) as info:
        load(*sources, limits=limits)
    return info.value.message


# ---- data: URLs and bytes -------------------------------------------------------------------------------


def test_a_data_url_and_bytes_decode_in_order():
    red, blue = solid((255, 0, 0)), solid((0, 0, 255), size=(3, 2))
    images = load(ImageSource(url=data_url(red)), ImageSource(data=blue, media_type="image/png"))
    assert [image.size for image in images] == [(8, 6), (3, 2)]
    assert images[0].pixels.mode == "RGB" and images[0].pixels.getpixel((0, 0)) == (255, 0, 0)
    assert images[1].pixels.getpixel((0, 0)) == (0, 0, 255)
    assert load() == ()


def test_the_bytes_decide_the_format_not_the_media_type():
    png = solid()
    assert load(ImageSource(url=data_url(png, "image/jpeg")))[0].size == (8, 6)
    assert load(ImageSource(data=png, media_type="image/webp"))[0].size == (8, 6)


def test_base64_with_line_breaks_url_safe_letters_or_no_padding_is_read():
    png = solid()
    text = base64.b64encode(png).decode()
    wrapped = "\n".join(text[i : i + 76] for i in range(0, len(text), 76))
    assert data_url_bytes(f"data:image/png;base64,{wrapped}", LIMITS) == png
    assert data_url_bytes(f"data:image/png;base64,{base64.urlsafe_b64encode(png).decode()}", LIMITS) == png
    assert data_url_bytes(f"data:image/png;base64,{text.rstrip('=')}", LIMITS) == png


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png,rawbytes", "only base64 data: URLs"),
        ("data:image/png;base64", "no ','"),
        ("data:text/plain;base64,aGVsbG8=", "must be an image type"),
        ("data:;base64,aGVsbG8=", "must be an image type"),
        ("data:image/;base64,aGVsbG8=", "must be an image type"),
        ("data:image/svg+xml;base64,PHN2Zy8+", "SVG"),
        ("data:image/png;base64,not*base64!", "not valid base64"),
        ("data:image/png;base64,", "not a PNG, JPEG, GIF, WebP or BMP image"),
    ],
)
def test_bad_data_urls_are_refused(url, words):
    assert words in refused(ImageSource(url=url))


@pytest.mark.parametrize("media_type", ["text/html", "application/octet-stream", "image/svg+xml", "image"])
def test_a_media_type_named_with_bytes_must_be_a_raster_images(media_type):
    message = refused(ImageSource(data=solid(), media_type=media_type))
    assert "SVG" in message or "must be an image type" in message


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://x/1", "javascript:alert(1)"]
)
def test_other_schemes_are_refused(url):
    assert "only data: and http(s) image URLs are accepted" in refused(ImageSource(url=url))


def test_a_source_without_url_or_data_is_refused():
    assert "neither a URL nor data" in refused(ImageSource())


# ---- limits -------------------------------------------------------------------------------------------------


def test_the_count_is_checked_before_any_image_is_read():
    sources = [ImageSource(url="gopher://never-read")] * 5
    message = refused(*sources, limits=MediaLimits(max_images=4))
    assert "5 images" in message and "at most 4" in message and "limit_mm_per_prompt" in message
    assert "accepts no images" in refused(ImageSource(data=solid()), limits=MediaLimits(max_images=0))
    check_count(4, MediaLimits(max_images=4))


def test_the_byte_cap_holds_for_bytes_and_data_urls():
    png = solid(size=(64, 64))
    limits = MediaLimits(max_image_bytes=len(png) - 1)
    assert "max_image_bytes" in refused(ImageSource(data=png), limits=limits)
    assert "max_image_bytes" in refused(ImageSource(url=data_url(png)), limits=limits)
    assert load(ImageSource(data=png), limits=MediaLimits(max_image_bytes=len(png)))[0].size == (64, 64)


def test_a_data_url_is_measured_before_its_base64_is_decoded():
    # not base64 at all: decoding it would say so; the size check answers first
    url = "data:image/png;base64," + "!" * 10_000
    assert "max_image_bytes" in refused(ImageSource(url=url), limits=MediaLimits(max_image_bytes=1000))


def test_the_pixel_cap_is_checked_from_the_header_before_decoding():
    bomb = png_header_only(9000, 9000)  # no pixel data at all: decoding it would fail as truncated
    message = refused(ImageSource(data=bomb))
    assert "9000x9000 = 81000000 pixels" in message and "max_image_pixels" in message
    assert "max_image_pixels" in refused(
        ImageSource(data=solid(size=(10, 10))), limits=MediaLimits(max_image_pixels=99)
    )
    assert load(ImageSource(data=solid(size=(10, 10))), limits=MediaLimits(max_image_pixels=100))[0].size == (10, 10)


def test_a_real_decompression_bomb_is_refused():
    # a 1-bit 9000x8000 image: 72 M pixels (below Pillow's own bomb check) in a few kB of PNG
    bomb = encode(PILImage.new("1", (9000, 8000), 0), optimize=True)
    assert len(bomb) < 100_000
    assert "9000x8000 = 72000000 pixels" in refused(ImageSource(data=bomb))


def test_pillows_own_bomb_check_answers_as_the_limit():
    message = refused(ImageSource(data=png_header_only(20000, 20000)), limits=MediaLimits(max_image_pixels=10**10))
    assert "max_image_pixels" in message and "Traceback" not in message


# ---- hostile and odd files ---------------------------------------------------------------------------------


def test_svg_is_refused_whatever_the_media_type_says():
    svg = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'
    assert "SVG" in refused(ImageSource(data=svg, media_type="image/png"))
    assert "SVG" in refused(ImageSource(url=data_url(b"\xef\xbb\xbf  <svg/>")))


@pytest.mark.parametrize(
    "data",
    [b"hello world, not an image", b"%PDF-1.7", b"II*\x00\x08\x00\x00\x00", b"\x00\x00\x01\x00", b"\x1f\x8b\x08"],
)
def test_other_formats_are_refused_without_trying_a_decoder(data):
    assert "is not a PNG, JPEG, GIF, WebP or BMP image" in refused(ImageSource(data=data))


def test_only_the_sniffed_formats_plugin_reads_the_bytes(monkeypatch):
    asked = []
    real_open = PILImage.open

    def spy(fp, mode="r", formats=None):
        asked.append(formats)
        return real_open(fp, mode, formats)

    monkeypatch.setattr(PILImage, "open", spy)
    load(ImageSource(data=solid()), ImageSource(data=encode(PILImage.new("RGB", (2, 2)), "JPEG")))
    assert sorted(asked) == [["JPEG"], ["PNG"]]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_truncated_files_are_refused(fmt):
    noise = PILImage.effect_noise((128, 128), 64).convert("RGB")
    whole = encode(noise, fmt)
    message = refused(ImageSource(data=whole[: len(whole) // 2]))
    assert message.startswith("could not decode image 1: "), message
    assert "0x" not in message and "\n" not in message  # no object reprs, one line


def test_corrupt_files_are_refused_with_a_short_message():
    png = bytearray(solid(size=(32, 32)))
    png[40:60] = b"\xff" * 20  # inside the IDAT data
    for data in (bytes(png), b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, b"\xff\xd8\xff" + b"\x00" * 50, b"GIF89a\x00"):
        message = refused(ImageSource(data=data))
        assert message.startswith("could not decode image 1: ") and len(message) < 200, message
        assert "BytesIO" not in message


def test_the_failing_image_is_named_by_its_place():
    sources = [ImageSource(data=solid()), ImageSource(data=b"nope")]
    assert refused(*sources).startswith("image 2 ")


# ---- frames, modes, orientation ----------------------------------------------------------------------------


def test_an_animated_gif_gives_its_first_frame():
    frames = [PILImage.new("RGB", (4, 4), color) for color in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    with PILImage.open(io.BytesIO(gif)) as check:
        assert check.n_frames == 3
    (image,) = load(ImageSource(data=gif))
    assert image.pixels.getpixel((0, 0)) == (255, 0, 0)


def test_transparency_is_composited_over_white():
    rgba = PILImage.new("RGBA", (2, 1), (255, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 0, 128))
    (image,) = load(ImageSource(data=encode(rgba)))
    assert image.pixels.mode == "RGB"
    assert image.pixels.getpixel((0, 0)) == (255, 255, 255)
    assert all(126 <= value <= 128 for value in image.pixels.getpixel((1, 0)))
    grey_alpha = PILImage.new("LA", (1, 1), (0, 0))
    assert load(ImageSource(data=encode(grey_alpha)))[0].pixels.getpixel((0, 0)) == (255, 255, 255)


def test_palette_greyscale_and_16_bit_images_become_rgb():
    palette = PILImage.new("RGB", (2, 2), (0, 128, 255)).convert("P", palette=PILImage.Palette.ADAPTIVE)
    assert load(ImageSource(data=encode(palette)))[0].pixels.getpixel((0, 0)) == (0, 128, 255)
    transparent = PILImage.new("P", (1, 1), 0)
    transparent.putpalette([9, 9, 9] * 256)
    assert load(ImageSource(data=encode(transparent, transparency=0)))[0].pixels.getpixel((0, 0)) == (255, 255, 255)
    grey = PILImage.new("L", (1, 1), 77)
    assert load(ImageSource(data=encode(grey)))[0].pixels.getpixel((0, 0)) == (77, 77, 77)
    deep = PILImage.new("I;16", (1, 1), 0x8000)  # scaled to 8 bits: 128, not clipped to 255
    (image,) = load(ImageSource(data=encode(deep)))
    assert image.pixels.mode == "RGB" and image.pixels.getpixel((0, 0)) == (128, 128, 128)
    cmyk = PILImage.new("CMYK", (1, 1), (0, 0, 0, 0))
    assert load(ImageSource(data=encode(cmyk, "JPEG")))[0].pixels.getpixel((0, 0)) == (255, 255, 255)
    one_bit = PILImage.new("1", (3, 3), 1)
    assert load(ImageSource(data=encode(one_bit, "BMP")))[0].pixels.getpixel((0, 0)) == (255, 255, 255)


def test_the_exif_orientation_is_applied():
    wide = PILImage.new("RGB", (4, 2), (0, 0, 0))
    wide.putpixel((0, 0), (255, 0, 0))
    exif = PILImage.Exif()
    exif[0x0112] = 6  # the camera was turned: show it rotated 90 degrees clockwise
    (image,) = load(ImageSource(data=encode(wide, exif=exif)))
    assert image.size == (2, 4)
    assert image.pixels.getpixel((1, 0)) == (255, 0, 0)  # the top-left pixel went to the top right
    assert load(ImageSource(data=encode(wide)))[0].size == (4, 2)


# ---- the digest ----------------------------------------------------------------------------------------------


def test_the_digest_is_the_pixels_whatever_the_file():
    picture = PILImage.effect_noise((16, 16), 50).convert("RGB")
    as_png, as_bmp = encode(picture), encode(picture, "BMP")
    assert sniff(as_png) == "PNG" and sniff(as_bmp) == "BMP"
    png, bmp = load(ImageSource(data=as_png), ImageSource(url=data_url(as_bmp, "image/bmp")))
    assert png.digest == bmp.digest == digest_of(picture)
    assert len(png.digest) == 64 and int(png.digest, 16) >= 0
    changed = picture.copy()
    changed.putpixel((5, 5), tuple(255 - v for v in picture.getpixel((5, 5))))
    assert decode_image(encode(changed), LIMITS).digest != png.digest
    # the same bytes in another shape (16x16 vs 8x32) are another image
    reshaped = PILImage.frombytes("RGB", (8, 32), picture.tobytes())
    assert decode_image(encode(reshaped), LIMITS).digest != png.digest


# ---- the package's place --------------------------------------------------------------------------------------


def test_media_imports_only_core_and_the_engine_never_imports_media():
    for path in sorted((PACKAGE / "media").glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module or "")
        ours = {name for name in names if name.startswith("lmiserve")}
        assert all(name.startswith(("lmiserve.core", "lmiserve.media")) for name in ours), (path, ours)
        assert not {name.split(".")[0] for name in names} & {"torch", "transformers", "starlette", "uvicorn"}
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        assert "lmiserve.media" not in path.read_text(), path
