"""Fetching an http(s) image under the server's limits (`MediaLimits`).

Each hop (the URL, then each redirect, at most `MAX_REDIRECTS`) is checked before anything is sent: the
scheme (http or https), no credentials in the URL, the host against `allowed_media_domains`, and the
address it resolves to (guard.py). The request then goes to that very address (the URL's host kept in
the ``Host`` header and as the TLS server name, so the certificate is checked against the name), through
no proxy. The whole fetch, every hop and the body, takes at most `fetch_timeout` seconds; the body is
refused from a ``Content-Length`` over `max_image_bytes`, and cut off once it passes it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl

import httpx

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import MediaLimits
from lmiserve.media import guard
from lmiserve.media.decode import too_large

logger = logging.getLogger(__name__)

MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "lmiserve-media-fetch"}


async def fetch_image(url: str, limits: MediaLimits, index: int = 1) -> bytes:
    """The body of the image at `url` (http or https), or InvalidRequest saying why not."""
    try:
        return await asyncio.wait_for(_fetch(url, limits, index), limits.fetch_timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise InvalidRequest(
            f"fetching image {index} took longer than the server's {limits.fetch_timeout:g} s (media_fetch_timeout)"
        ) from None


def parse_url(url: str, index: int) -> httpx.URL:
    """`url` as an http(s) URL with a host and no credentials, or InvalidRequest."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise InvalidRequest(f"image {index}: {url[:200]!r} is not a valid URL") from None
    if parsed.scheme not in ("http", "https"):
        scheme = parsed.scheme[:20]
        raise InvalidRequest(f"image {index}: only data: and http(s) image URLs are accepted, not {scheme}: URLs")
    if not parsed.raw_host:
        raise InvalidRequest(f"image {index}: the URL {url[:200]!r} has no host")
    if parsed.userinfo:
        raise InvalidRequest(f"image {index}: image URLs with credentials (user:password@) are not fetched")
    return parsed


async def _fetch(url: str, limits: MediaLimits, index: int) -> bytes:
    current = parse_url(url, index)
    for hop in range(MAX_REDIRECTS + 1):
        host = current.raw_host.decode("ascii").lower()
        guard.check_domain(host, limits, index, redirect=hop > 0)
        port = current.port or (443 if current.scheme == "https" else 80)
        address = await guard.checked_address(host, port, limits, index)
        location = await _get(current, address, limits, index)
        if isinstance(location, bytes):
            return location
        current = parse_url(str(current.join(location)), index)
    raise InvalidRequest(f"image {index}: the image URL redirects more than {MAX_REDIRECTS} times")


async def _get(url: httpx.URL, address: str, limits: MediaLimits, index: int) -> bytes | str:
    """GET `url` from `address`: the body, or a redirect's Location."""
    headers = {**_HEADERS, "Host": url.netloc.decode("ascii")}
    extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
    try:
        async with (
            _client(limits) as client,
            client.stream("GET", url.copy_with(host=address), headers=headers, extensions=extensions) as response,
        ):
            status = response.status_code
            if status in _REDIRECTS:
                location = response.headers.get("location")
                if not location:
                    raise InvalidRequest(f"image {index}: the image URL answered HTTP {status} without a Location")
                return str(location)
            if not 200 <= status < 300:
                raise InvalidRequest(f"image {index}: the image URL answered HTTP {status}")
            return await _read_body(response, limits, index)
    except httpx.TimeoutException:
        raise
    except httpx.HTTPError as exc:
        logger.info("fetching image %d from %s (%s) failed: %r", index, url, address, exc)
        what = "could not connect" if isinstance(exc, httpx.ConnectError) else "the connection failed"
        raise InvalidRequest(f"image {index}: could not fetch the image URL ({what})") from None


async def _read_body(response: httpx.Response, limits: MediaLimits, index: int) -> bytes:
    declared = response.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limits.max_image_bytes:
        raise too_large(index, limits)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limits.max_image_bytes:
            raise too_large(index, limits)
    return bytes(body)


def _client(limits: MediaLimits) -> httpx.AsyncClient:
    """A client of one fetch: no proxy from the environment, no redirects of its own, no connection kept
    (a connection is never reused for another host name on the same address)."""
    return httpx.AsyncClient(
        verify=_tls_context(),
        trust_env=False,
        follow_redirects=False,
        timeout=httpx.Timeout(limits.fetch_timeout),
        limits=httpx.Limits(max_keepalive_connections=0),
    )


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The certificate checks of https fetches (made once: loading the CA bundle takes a while)."""
    return httpx.create_ssl_context()
