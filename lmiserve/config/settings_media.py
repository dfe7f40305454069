"""The settings of images in requests (vision-language models, docs/vision.md): how many a request may
carry, how large each may be, and which http(s) image URLs the server may fetch. `lmiserve.media` turns
them into the loader's `MediaLimits` (``media_limits(settings)``)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from pydantic import ByteSize, Field, field_validator

from lmiserve.config.settings_types import FieldGroup

logger = logging.getLogger("lmiserve.config.settings")

_DOMAIN = re.compile(r"^(\*|(\*\.)?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*)$")
_MODALITIES = ("image", "video", "audio")  # vLLM's; lmiserve serves images


def parse_mm_limit(value: Any) -> Any:
    """`limit_mm_per_prompt` as the images per request: vLLM's JSON (``{"image": 4}``, its other
    modalities ignored with a warning) or a plain number."""
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            return text
        try:
            value = json.loads(text)
        except ValueError:
            raise ValueError('not JSON: write {"image": N} or N') from None
    if not isinstance(value, dict):
        return value
    unknown = sorted(str(key) for key in value if key not in _MODALITIES)
    if unknown:
        raise ValueError(f"unknown modality {', '.join(unknown)}: the keys are {', '.join(_MODALITIES)}")
    others = sorted(key for key in value if key != "image" and value[key])
    if others:
        logger.warning("limit_mm_per_prompt: lmiserve serves images only; %s ignored", ", ".join(others))
    return value.get("image", 0)


class MediaFields(FieldGroup):
    """Images in requests: their number and size, and the http(s) URLs the server may fetch."""

    limit_mm_per_prompt: int = Field(
        4,
        ge=0,
        description=(
            'Most images in one request (vLLM\'s `limit_mm_per_prompt`, its JSON `{"image": 4}` or a plain `4`; '
            "`video` and `audio` counts are ignored); a request with more gets 400, and `0` refuses images."
        ),
        json_schema_extra={"allowed": 'an integer >= 0, or JSON such as {"image": 4}'},
    )
    max_image_bytes: ByteSize = Field(
        ByteSize(20 * 2**20),
        ge=1,
        description=(
            "Largest encoded image in bytes (a `data:` URL's decoded payload, a fetched body; `20MiB`, `5MB` ... "
            "accepted): a larger one gets 400, a fetch is cut off once it passes it."
        ),
        json_schema_extra={"allowed": "a size >= 1 in bytes, e.g. 20971520, 20MiB or 5MB"},
    )
    max_image_pixels: int = Field(
        64 * 2**20,
        ge=1,
        description=(
            "Most pixels (width x height) of one decoded image, checked from the file's header before any pixel "
            "is decoded (decompression bombs); a larger one gets 400. Within it the model's processor resizes "
            "the image as it always does. Above about 179 million pixels Pillow refuses an image anyway."
        ),
    )
    media_fetch_timeout: float = Field(
        5.0,
        gt=0,
        description=(
            "Seconds an http(s) image may take to fetch, from the name lookup to the last byte, redirects "
            "included (vLLM's `VLLM_IMAGE_FETCH_TIMEOUT`); a slower one gets 400."
        ),
    )
    allowed_media_domains: str | None = Field(
        None,
        description=(
            "Hosts http(s) image URLs may come from (vLLM's `allowed_media_domains`): comma-separated names or a "
            "JSON list, `*.example.com` for the names under example.com, `*` for any host. Unset = none: only "
            "`data:` images are accepted (unlike vLLM, which fetches from any host by default). Every redirect "
            "(at most 3) is checked again."
        ),
        json_schema_extra={"allowed": "comma-separated host names, *.domain or *"},
    )
    allow_private_media_urls: bool = Field(
        False,
        description=(
            "Let image fetches reach loopback, private, link-local and other non-public addresses (the name of "
            "an allowed host is resolved and its address checked, on every redirect too); off, such a URL gets "
            "400."
        ),
    )

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _parse_mm_limit(cls, value: Any) -> Any:
        return parse_mm_limit(value)

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _parse_domains(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().startswith("["):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("not a JSON list") from None
        if isinstance(value, list | tuple):
            if not all(isinstance(item, str) for item in value):
                raise ValueError("a list of host names")
            value = ",".join(value)
        return value

    @field_validator("allowed_media_domains")
    @classmethod
    def _check_domains(cls, value: str | None) -> str | None:
        if value is None:
            return None
        names = [name.strip().lower().rstrip(".") for name in value.split(",") if name.strip()]
        bad = [name for name in names if not _DOMAIN.match(name)]
        if bad:
            raise ValueError(f"not a host name: {bad[0]!r}")
        return ",".join(names) or None

    def media_domains(self) -> tuple[str, ...]:
        """`allowed_media_domains` as a tuple of names (empty: no http(s) image URLs)."""
        return tuple(self.allowed_media_domains.split(",")) if self.allowed_media_domains else ()
