"""``m2n-async store``: run a StoreServer standalone until interrupted.

Theory of operation: the token comes from a file (never the command line, where ``ps`` would
show it); the first stdout line is the bound address alone (``host:port``) so scripts can read
it, e.g. with port 0. Ctrl-C / SIGTERM stop it; clients then see their sessions end.

The event loop: uvloop when it is installed (``pip install m2n_async[fast]``), else asyncio
(``--loop`` picks one explicitly). The server's per-request cost is mostly the event loop's own
(readiness wait, receive, send), which uvloop does in C: it roughly halves the server's CPU per
request. The protocol and every guarantee are the same on both.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from m2n_async._proto.errors import StoreError
from m2n_async._store._server import StoreServer
from m2n_async._store._wire import DEFAULT_MAX_FRAME

__all__ = ["add_store_command", "pick_loop", "read_token_file", "run_store_command"]


def add_store_command(sub: Any) -> None:
    """Register ``store`` on an ``argparse`` subparsers object."""
    p = sub.add_parser("store", help="run the control-plane store server standalone",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind, exactly (default 127.0.0.1; 0.0.0.0 = all IPv4)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: pick a free one)")
    p.add_argument("--token-file", type=Path, required=True,
                   help="file holding the shared secret (surrounding whitespace is ignored)")
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME,
                   help=f"largest frame in bytes (default {DEFAULT_MAX_FRAME})")
    # The store's budgets (docs/security.md); unset: the server's defaults.
    for flag, what in (("--max-bytes", "bytes of values the whole store may hold"),
                       ("--max-job-bytes", "bytes of values one job's keys may hold"),
                       ("--max-output-bytes", "bytes of unread replies, all connections"),
                       ("--max-partial-bytes", "bytes of partly received frames, all "
                                               "connections"),
                       ("--max-connections", "open connections")):
        p.add_argument(flag, type=int, default=None, help=f"most {what} (default: the "
                       "server's, docs/security.md)")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop (default auto: uvloop if installed, else asyncio)")


def read_token_file(path: Path) -> str:
    """The token in ``path``; ``ValueError`` naming the file if missing or empty."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"--token-file {path}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def run_store_command(args: argparse.Namespace) -> int:
    try:
        token = read_token_file(args.token_file)
        limits = {k: getattr(args, k) for k in ("max_bytes", "max_job_bytes",
                                                 "max_output_bytes", "max_partial_bytes",
                                                 "max_connections")
                  if getattr(args, k, None) is not None}
        server = StoreServer(args.host, args.port, token=token, max_frame=args.max_frame,
                             **limits)
        loop = pick_loop(getattr(args, "loop", "auto"))
    except ValueError as exc:
        print(f"m2n-async store: {exc}", file=sys.stderr)
        return 2
    try:
        anyio.run(_serve, server, loop, backend_options={"use_uvloop": loop == "uvloop"})
    except KeyboardInterrupt:
        pass
    except (StoreError, OSError) as exc:  # e.g. the port is taken: report, no traceback
        print(f"m2n-async store: {exc}", file=sys.stderr)
        return 1
    return 0


def pick_loop(choice: str) -> str:
    """``"uvloop"`` or ``"asyncio"`` for ``--loop``; ``ValueError`` if uvloop is asked for but
    missing."""
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401  (only probing that it is installed)
    except ImportError:
        if choice == "uvloop":
            raise ValueError("loop uvloop: uvloop is not installed "
                             "(pip install m2n_async[fast])") from None
        return "asyncio"
    return "uvloop"


async def _serve(server: StoreServer, loop: str) -> None:
    async with server:
        print(server.address, flush=True)
        print(f"m2n-async store: listening on {server.address} ({loop} event loop; Ctrl-C to "
              "stop)", file=sys.stderr, flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                return
