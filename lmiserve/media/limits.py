"""The server's `MediaLimits` from its settings (the Vision group of docs/configuration.md)."""

from __future__ import annotations

from typing import Any

from lmiserve.core.media import MediaLimits


def media_limits(settings: Any) -> MediaLimits:
    """`MediaLimits` from the settings (`lmiserve.config.Settings`, or anything with its media fields):
    `limit_mm_per_prompt`, `max_image_bytes`, `max_image_pixels`, `media_fetch_timeout`,
    `allowed_media_domains` and `allow_private_media_urls`."""
    return MediaLimits(
        max_images=int(settings.limit_mm_per_prompt),
        max_image_bytes=int(settings.max_image_bytes),
        max_image_pixels=int(settings.max_image_pixels),
        fetch_timeout=float(settings.media_fetch_timeout),
        allowed_domains=tuple(settings.media_domains()),
        allow_private=bool(settings.allow_private_media_urls),
    )
