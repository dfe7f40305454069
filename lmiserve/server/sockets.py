"""The listening sockets of `lmiserve serve` (the HTTP port, the gRPC port's probe, the metrics port), bound
as uvicorn binds them."""

from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to host:port (as uvicorn binds it); OSError if it cannot be.

    The protocol is named (IPPROTO_TCP, not 0): asyncio sets TCP_NODELAY only on accepted sockets whose
    protocol says TCP, and without it every answer on a kept-alive connection waited ~40 ms for the
    client's delayed ACK (Nagle's algorithm holding the body back behind the head)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
