"""``m2n-async store``: run a StoreServer standalone until interrupted.

Theory of operation: the token comes from a file (never the command line, where ``ps`` would
show it); the first stdout line is the bound address alone (``host:port``) so scripts can read
it, e.g. with port 0. Ctrl-C / SIGTERM stop it; clients then see their sessions end.

The event loop: uvloop when it is installed (``pip install m2n_async[fast]``), else asyncio
(``--loop`` picks one explicitly). The server's per-request cost is mostly the event loop's own
(readiness wait, receive, send), which uvloop does in C: it roughly halves the server's CPU per
request. The protocol and every guarantee are the same on both.

Exit status: 0 stopped by SIGTERM or Ctrl-C, 1 cannot listen (address in use, or a host that
does not resolve or is not this one's), 2 bad option or token file.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import anyio

from m2n_async._proto.errors import StoreError
from m2n_async._store._server import StoreServer
from m2n_async._store._wire import DEFAULT_MAX_FRAME

__all__ = ["add_store_command", "pick_loop", "read_token_file", "run_store_command"]

#: The most bytes a token file is read for: a token is a short secret (``secrets.token_hex(32)``
#: is 64 characters), so a larger file is a wrong path, and ``/dev/zero`` ends here too.
MAX_TOKEN_FILE_BYTES = 64 * 1024

# The flag that sets each StoreServer argument: its messages name the argument, ours the flag.
_FLAGS = {"host": "--host", "port": "--port", "max_frame": "--max-frame",
          "max_bytes": "--max-bytes", "max_job_bytes": "--max-job-bytes",
          "max_output_bytes": "--max-output-bytes", "max_partial_bytes": "--max-partial-bytes",
          "max_connections": "--max-connections"}


def add_store_command(sub: Any) -> None:
    """Register ``store`` on an ``argparse`` subparsers object."""
    p = sub.add_parser("store", help="run the control-plane store server standalone",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind, exactly (default 127.0.0.1; 0.0.0.0 = all IPv4)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: pick a free one)")
    # str, not Path: Path("") is ".", which would hide an empty argument behind "a directory"
    p.add_argument("--token-file", required=True,
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


def read_token_file(path: str | Path) -> str:
    """The token in ``path``, surrounding whitespace stripped; ``ValueError`` naming the file
    if it is missing, unreadable, not UTF-8, empty or over ``MAX_TOKEN_FILE_BYTES``."""
    if str(path) == "":
        raise ValueError("--token-file '': an empty path names no file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)  # bounded: a pipe or device may not end
    except OSError as exc:
        raise ValueError(f"--token-file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise ValueError(f"--token-file {path}: more than {MAX_TOKEN_FILE_BYTES} bytes, not a "
                         f"token (one is a short secret, e.g. 64 hex digits)")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"--token-file {path}: not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def _readable_by_others(path: str | Path) -> str | None:
    """A warning when other users may read the token file (docs/security.md: a file only
    the job's user can read), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # it was just read; a file gone since is no warning's business
    # Only a regular file: a pipe (`--token-file <(...)`) or device has no lasting readers.
    if not stat.S_ISREG(mode) or not mode & (stat.S_IRGRP | stat.S_IROTH):
        return None
    return (f"warning: --token-file {path} is readable by other users (mode "
            f"{stat.S_IMODE(mode):04o}); the token is a password: chmod 600 {path} "
            f"(docs/security.md)")


def _flag_error(exc: ValueError, args: argparse.Namespace) -> str:
    """A StoreServer argument error in the command's words: the flag and its value first."""
    text = str(exc).removeprefix("StoreServer ")
    m = re.fullmatch(r"(\w+) (must .*?)(?:, got .*)?", text)
    if m is None or m.group(1) not in _FLAGS:
        return text
    name, rule = m.groups()
    value = getattr(args, name)
    rule = rule.removesuffix(" or None")  # None (no quota) is the API's, not a flag's value
    # max_output is no flag: say what it is in flags (the server's default of it)
    rule = re.sub(r"max_output \((\d+)\)", r"one connection's reply budget (\1 bytes, the "
                  r"larger of 2 x --max-frame and --max-frame + 1 MiB)", rule)
    rule = re.sub(r"\bmax_frame\b", "--max-frame", rule)
    shown = repr(value) if value == "" else str(value)  # an empty --host, visibly
    return f"{_FLAGS[name]} {shown}: {rule}"


def run_store_command(args: argparse.Namespace) -> int:
    try:
        token = read_token_file(args.token_file)
        limits = {k: getattr(args, k) for k in ("max_bytes", "max_job_bytes",
                                                 "max_output_bytes", "max_partial_bytes",
                                                 "max_connections")
                  if getattr(args, k, None) is not None}
        try:
            server = StoreServer(args.host, args.port, token=token, max_frame=args.max_frame,
                                 **limits)
        except ValueError as exc:
            raise ValueError(_flag_error(exc, args)) from None
        loop = pick_loop(getattr(args, "loop", "auto"))
    except ValueError as exc:
        print(f"m2n-async store: {exc}", file=sys.stderr)
        return 2
    warning = _readable_by_others(args.token_file)
    if warning is not None:  # served all the same: the file is the operator's to fix
        print(f"m2n-async store: {warning}", file=sys.stderr, flush=True)
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
