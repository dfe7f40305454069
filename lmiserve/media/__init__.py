"""Images from clients, fetched and decoded under the server's limits (docs/vision.md).

The protocols call `load_images` with the `ImageSource`s they parsed and `media_limits(settings)`; the
engine never imports this package (it gets decoded `Image`s). Every refusal is an `InvalidRequest` whose
message is safe to show the client: load.py (the count, data: URLs, the order), fetch.py and guard.py
(http(s) URLs: allowed hosts, public addresses, redirects, timeout, size), decode.py (formats, pixels,
RGB, the digest), limits.py (the settings).
"""

from lmiserve.media.decode import decode_image
from lmiserve.media.limits import media_limits
from lmiserve.media.load import check_count, load_image, load_images

__all__ = ["check_count", "decode_image", "load_image", "load_images", "media_limits"]
