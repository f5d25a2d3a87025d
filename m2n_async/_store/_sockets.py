"""What both ends of the TCP store share: the address format and how a connection is tuned.

Theory of operation: the server (``_server.py``) and the client (``_client.py``) are two
drivers over one wire; neither imports the other. The facts both must apply alike — how an
address is written and read back (IPv6 bracketed), the socket options that make a silent
host's session end, and the asyncio loop both run on — live here, once.
"""

from __future__ import annotations

import asyncio
import socket

from m2n_async._proto.errors import StoreError

__all__ = ["format_address", "parse_address", "running_loop", "tune_socket"]


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts bracketed (``[::1]:port``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` → ``(host, port)``."""
    if isinstance(address, tuple):
        host, port = address
    else:
        text = address.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]:")
            port_text = rest if sep else ""
        else:
            host, _, port_text = text.rpartition(":")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"store address must be 'host:port', got {address!r}") from None
    if not host or not 0 < int(port) <= 65535:
        raise ValueError(f"store address must be 'host:port' with a port in [1, 65535], "
                         f"got {address!r}")
    return str(host), int(port)


# TCP keepalive: a peer whose host dies (power, kernel panic, cable) sends no FIN or RST, and an
# idle session would then live on forever, its ephemeral keys with it, so nobody watching them
# would ever hear of the loss. Probing an idle connection after 10 s, every 2 s, 5 times, ends
# such a session about 20 s after the host went silent.
_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5))


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay (requests are small and latency-bound) and keepalive probes (above)."""
    for level, name, value in ((socket.IPPROTO_TCP, "TCP_NODELAY", 1),
                               (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
                               *((socket.IPPROTO_TCP, n, v) for n, v in _KEEPALIVE)):
        option = getattr(socket, name, None)
        if option is None:  # e.g. TCP_KEEPIDLE on macOS: the system default applies
            continue
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass


def running_loop(who: str) -> asyncio.AbstractEventLoop:
    """The running asyncio loop, or a clear error under another anyio backend."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise StoreError(f"{who} runs on asyncio (anyio's default backend); no asyncio event "
                         "loop is running here") from None
