"""Where an image fetch may go: the hosts `allowed_media_domains` names, and only public addresses unless
`allow_private_media_urls` (loopback, private, link-local, shared, reserved, multicast and unspecified
addresses are refused, IPv4 and IPv6, an IPv4 address inside an IPv6 one included).

`checked_address` resolves a host once and returns the address the fetch then connects to, so a DNS
answer that changes between the check and the connection (DNS rebinding) cannot move it elsewhere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import MediaLimits

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # an IPv4 address behind a NAT64 gateway


def domain_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether `host` is in `allowed`: an exact name, ``*.example.com`` (any name under example.com, not
    example.com itself) or ``*`` (any host)."""
    name = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.strip().lower().rstrip(".")
        if entry == "*" or entry == name:
            return True
        if entry.startswith("*.") and name.endswith(entry[1:]) and len(name) > len(entry) - 1:
            return True
    return False


def embedded_addresses(ip: IPAddress) -> list[IPAddress]:
    """`ip` and the IPv4 addresses an IPv6 address carries (IPv4-mapped, NAT64, 6to4, Teredo)."""
    found: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            found.append(ip.ipv4_mapped)
        if ip in _NAT64:
            found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None:
            found.append(ip.sixtofour)
        if ip.teredo is not None:
            found.extend(ip.teredo)
    return found


def is_public_address(address: str) -> bool:
    """Whether `address` (an IP literal, an IPv6 scope allowed) is a public unicast address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    for candidate in embedded_addresses(ip):
        if isinstance(ip, ipaddress.IPv6Address) and candidate is ip and ip.ipv4_mapped is not None:
            continue  # judged by the IPv4 address it maps (Python calls all of ::ffff:0:0/96 private)
        if not candidate.is_global or candidate.is_multicast or candidate.is_unspecified:
            return False
    return True


async def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (an IP literal resolves to itself)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def check_domain(host: str, limits: MediaLimits, index: int, redirect: bool) -> None:
    """InvalidRequest unless `allowed_media_domains` allows `host`."""
    if domain_allowed(host, limits.allowed_domains):
        return
    if not limits.allowed_domains:
        raise InvalidRequest(
            f"image {index}: http(s) image URLs are off on this server (its allowed_media_domains is empty); "
            "send the image as a data: URL"
        )
    what = "redirects to" if redirect else "is from"
    raise InvalidRequest(f"image {index} {what} the host {host!r}, which is not in the server's allowed_media_domains")


async def checked_address(host: str, port: int, limits: MediaLimits, index: int) -> str:
    """The address to connect to for `host`: resolved once; every address it resolves to must be public
    unless `allow_private` (one private answer among public ones refuses the host)."""
    try:
        addresses = await resolve_host(host, port)
    except (OSError, UnicodeError):
        raise InvalidRequest(f"image {index}: could not resolve the host {host!r}") from None
    if not addresses:
        raise InvalidRequest(f"image {index}: could not resolve the host {host!r}")
    if not limits.allow_private and not all(is_public_address(address) for address in addresses):
        raise InvalidRequest(
            f"image {index}: the host {host!r} has a private, loopback, link-local or reserved address; the "
            "server does not fetch from those (allow_private_media_urls)"
        )
    return addresses[0]
