"""http(s) images fetched under the server's limits (lmiserve/media/fetch.py, guard.py), against a real
local HTTP server: allowed hosts only, never a private address unless allowed (a redirect included), the
address checked is the one connected to, redirects counted, a total timeout, the body's size cap."""

from __future__ import annotations

import asyncio
import datetime
import io
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image as PILImage

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import ImageSource, MediaLimits
from lmiserve.media import fetch, guard, load_images
from lmiserve.media.guard import domain_allowed, is_public_address


def png_bytes(size: tuple[int, int] = (5, 4)) -> bytes:
    buffer = io.BytesIO()
    PILImage.effect_noise(size, 40).convert("RGB").save(buffer, "PNG")
    return buffer.getvalue()


PNG = png_bytes()
BIG = png_bytes((200, 200))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes (no Content-Length needed)
    seen: list[tuple[str, str]]  # (path, Host header) of every request

    def log_message(self, *args: object) -> None:
        pass

    def send(self, status: int, body: bytes = b"", length: int | None = None, **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append((self.path, self.headers.get("Host", "")))
        path, _, query = self.path.partition("?")
        if path == "/img.png":
            self.send(200, PNG, len(PNG), Content_Type="image/png")
        elif path.startswith("/hops/"):
            left = int(path.rsplit("/", 1)[1])
            if left == 0:
                self.send(200, PNG, len(PNG))
            else:
                self.send(302, Location=f"/hops/{left - 1}")
        elif path == "/to":
            self.send(307, Location=query)
        elif path == "/no-location":
            self.send(302)
        elif path == "/slow":
            time.sleep(1.5)
            self.send(200, PNG, len(PNG))
        elif path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            for byte in PNG:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.02)
        elif path == "/big":  # no Content-Length: read until the connection closes
            self.send(200, BIG)
        elif path == "/endless":  # no Content-Length, and no end: only a cut-off stops reading it
            self.send_response(200)
            self.end_headers()
            chunk = PNG + bytes(65536)
            try:
                for _ in range(100_000):
                    self.wfile.write(chunk)
                    time.sleep(0.001)
            except OSError:
                pass
        elif path == "/declares-big":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            self.wfile.flush()
            time.sleep(1.5)
        elif path == "/short-lie":  # says 20 bytes, sends the whole PNG
            self.send(200, PNG, 20)
        elif path == "/long-lie":  # says 10000 bytes, sends 50 and closes
            self.send(200, PNG[:50], 10000)
        elif path == "/html":
            self.send(200, b"<html><body>not an image</body></html>", Content_Type="image/png")
        elif path == "/teapot":
            self.send(418, b"short and stout")
        else:
            self.send(404, b"no such page")


class Server:
    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        handler = type("RecordingHandler", (Handler,), {"seen": []})
        self.handler = handler
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def seen(self) -> list[tuple[str, str]]:
        return self.handler.seen

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = Server()
    yield running
    running.close()


LOCAL = MediaLimits(allowed_domains=("127.0.0.1", "localhost"), allow_private=True, fetch_timeout=1.0)


def fetch_one(url: str, limits: MediaLimits = LOCAL):
    return asyncio.run(load_images([ImageSource(url=url)], limits))[0]


def refused(url: str, limits: MediaLimits = LOCAL) -> str:
    with pytest.raises(InvalidRequest) as info:
        fetch_one(url, limits)
    return info.value.message


@pytest.fixture
def public_local(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """127.0.0.1 counts as public and `*.test` names resolve to it, but inside.test to 10.9.8.7 (returns
    the lookups made): the guard with `allow_private` off, against the local server."""
    lookups: dict[str, list[str]] = {}
    real = guard.resolve_host

    async def resolve(host: str, port: int) -> list[str]:
        lookups.setdefault(host, []).append(str(port))
        if host == "inside.test":  # a name whose address is private
            return ["10.9.8.7"]
        return ["127.0.0.1"] if host.endswith(".test") else await real(host, port)

    monkeypatch.setattr(guard, "resolve_host", resolve)
    monkeypatch.setattr(guard, "is_public_address", lambda address: address == "127.0.0.1")
    return lookups


# ---- what is fetched ----------------------------------------------------------------------------------------


def test_an_allowed_host_is_fetched_and_decoded(server):
    image = fetch_one(server.url("/img.png"))
    assert image.size == (5, 4)
    assert fetch_one(server.url("/img.png", host="localhost")).digest == image.digest


def test_the_connection_goes_to_the_checked_address_with_the_hosts_name(server, public_local):
    # images.test exists in no DNS: only the address the guard resolved (and checked) can be reached
    limits = MediaLimits(allowed_domains=("images.test",), fetch_timeout=1.0)
    assert fetch_one(server.url("/img.png", host="images.test"), limits).size == (5, 4)
    assert server.seen[-1] == ("/img.png", f"images.test:{server.port}")
    assert public_local["images.test"] == [str(server.port)]


def test_redirects_are_followed_up_to_three(server):
    assert fetch_one(server.url("/hops/3")).size == (5, 4)
    assert "redirects more than 3 times" in refused(server.url("/hops/4"))
    assert "without a Location" in refused(server.url("/no-location"))


# ---- where a fetch may not go -------------------------------------------------------------------------------


def test_without_allowed_domains_http_images_are_off(server):
    before = len(server.seen)
    message = refused(server.url("/img.png"), MediaLimits(allow_private=True))
    assert "http(s) image URLs are off" in message and "allowed_media_domains" in message
    message = refused(server.url("/img.png"), MediaLimits(allowed_domains=("example.com",), allow_private=True))
    assert "'127.0.0.1', which is not in the server's allowed_media_domains" in message
    assert len(server.seen) == before


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "[::1]",
        "10.1.2.3",
        "192.168.0.1",
        "172.16.0.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "2130706433",  # 127.0.0.1 as one number
        "[::ffff:127.0.0.1]",
        "[fe80::1]",
        "[fc00::1]",
        "[::]",
    ],
)
def test_private_addresses_are_refused_without_allow_private(server, host):
    before = len(server.seen)
    message = refused(f"http://{host}:{server.port}/img.png", MediaLimits(allowed_domains=("*",)))
    assert "private, loopback, link-local or reserved address" in message and "allow_private_media_urls" in message
    assert len(server.seen) == before


def test_a_redirect_to_a_private_address_is_refused(server, public_local):
    limits = MediaLimits(allowed_domains=("*",), fetch_timeout=1.0)
    assert fetch_one(server.url("/to?/img.png", host="images.test"), limits).size == (5, 4)  # a public hop is fine
    for target in ("http://169.254.169.254/latest/meta-data/", f"http://10.0.0.7:{server.port}/img.png"):
        message = refused(server.url(f"/to?{target}", host="images.test"), limits)
        assert "private, loopback, link-local or reserved address" in message, message
    message = refused(server.url(f"/to?http://inside.test:{server.port}/img.png", host="images.test"), limits)
    assert "the host 'inside.test' has a private" in message
    assert public_local["inside.test"] == [str(server.port)]


def test_a_redirect_to_a_host_not_allowed_or_another_scheme_is_refused(server):
    limits = MediaLimits(allowed_domains=("localhost",), allow_private=True, fetch_timeout=1.0)
    message = refused(server.url(f"/to?{server.url('/img.png')}", host="localhost"), limits)
    assert "redirects to the host '127.0.0.1', which is not in the server's allowed_media_domains" in message
    assert "not file: URLs" in refused(server.url("/to?file:///etc/passwd"))


def test_a_host_resolving_to_one_private_address_among_public_ones_is_refused(monkeypatch):
    async def resolve(host: str, port: int) -> list[str]:
        return ["93.184.215.14", "10.0.0.1"]

    monkeypatch.setattr(guard, "resolve_host", resolve)
    assert "private" in refused("http://mixed.example/img.png", MediaLimits(allowed_domains=("*",)))


def test_urls_with_credentials_or_unresolvable_hosts_are_refused():
    limits = MediaLimits(allowed_domains=("*",), allow_private=True)
    assert "credentials" in refused("http://user:pw@127.0.0.1/img.png", limits)
    assert "could not resolve" in refused("http://no-such-host.invalid/img.png", limits)


def test_address_and_domain_rules():
    for address in ("8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "1.1.1.1"):
        assert is_public_address(address), address
    for address in ("127.0.0.1", "::1", "10.0.0.1", "169.254.169.254", "fe80::1%eth0", "::ffff:10.0.0.1", "ff02::1"):
        assert not is_public_address(address), address
    for address in ("64:ff9b::a00:1", "2002:7f00:1::", "240.0.0.1", "255.255.255.255", "not an address"):
        assert not is_public_address(address), address  # NAT64 / 6to4 of a private one, reserved, broadcast
    assert domain_allowed("a.example.com", ["*.example.com"]) and domain_allowed("x.y.example.com", ["*.example.com"])
    assert not domain_allowed("example.com", ["*.example.com"]) and not domain_allowed(
        "badexample.com", ["*.example.com"]
    )
    assert domain_allowed("Example.COM.", ["example.com"]) and domain_allowed("anything", ["*"])
    assert not domain_allowed("example.com.evil", ["example.com"]) and not domain_allowed("x", [])


# ---- time and size ---------------------------------------------------------------------------------------------


def test_a_slow_server_hits_the_timeout(server):
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allow_private=True, fetch_timeout=0.3)
    started = time.monotonic()
    assert "took longer than the server's 0.3 s (media_fetch_timeout)" in refused(server.url("/slow"), limits)
    assert "media_fetch_timeout" in refused(server.url("/drip"), limits)  # each byte in time, the whole too slow
    assert time.monotonic() - started < 1.5


def test_a_body_over_the_cap_is_cut_off(server):
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allow_private=True, max_image_bytes=len(BIG) // 4)
    assert "max_image_bytes" in refused(server.url("/big"), limits)
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allow_private=True, max_image_bytes=10**6, fetch_timeout=2.0)
    started = time.monotonic()
    assert "max_image_bytes" in refused(server.url("/endless"), limits)  # not the timeout
    assert time.monotonic() - started < 1.5
    assert fetch_one(server.url("/big")).size == (200, 200)


def test_a_content_length_over_the_cap_is_refused_at_once(server):
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allow_private=True, fetch_timeout=1.0)
    started = time.monotonic()
    assert "max_image_bytes" in refused(server.url("/declares-big"), limits)  # not the 1 s timeout
    assert time.monotonic() - started < 0.9


def test_a_lying_content_length_is_refused(server):
    assert refused(server.url("/short-lie")).startswith("could not decode image 1")  # the first 20 bytes only
    assert "could not fetch the image URL" in refused(server.url("/long-lie"))


def test_a_body_that_is_no_image_and_error_statuses_are_refused(server):
    assert "is not a PNG, JPEG, GIF, WebP or BMP image" in refused(server.url("/html"))
    assert "answered HTTP 404" in refused(server.url("/missing"))
    assert "answered HTTP 418" in refused(server.url("/teapot"))


def test_a_closed_port_is_a_connection_error():
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allow_private=True)
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as probe:
        port = probe.server_address[1]
    assert "could not fetch the image URL (could not connect)" in refused(f"http://127.0.0.1:{port}/img.png", limits)


# ---- https: the certificate is checked against the name, not the address -------------------------------------


def make_certificates(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for `name` it signed: (ca.pem, cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def test_https_checks_the_certificate_against_the_name(tmp_path, monkeypatch, public_local):
    ca, cert, key = make_certificates(tmp_path, "images.test")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(ca))
    monkeypatch.setattr(fetch, "_tls_context", lambda: trusting)
    secure = Server(tls)
    try:
        limits = MediaLimits(allowed_domains=("*.test",), fetch_timeout=2.0)
        assert fetch_one(secure.url("/img.png", host="images.test", scheme="https"), limits).size == (5, 4)
        assert secure.seen[-1] == ("/img.png", f"images.test:{secure.port}")
        # another name on the same address: the certificate does not match it
        message = refused(secure.url("/img.png", host="other.test", scheme="https"), limits)
        assert "could not fetch the image URL" in message
    finally:
        secure.close()
