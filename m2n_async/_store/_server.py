"""The TCP store server: asyncio transports driving a synchronous per-connection protocol.

Theory of operation: ``async with StoreServer(...)`` binds exactly the given address and serves
on the current event loop (anyio's asyncio backend) until the block exits. Each connection is
an ``asyncio.BufferedProtocol`` whose whole logic is synchronous — bytes in (received into one
preallocated buffer per connection), frames out (one ``transport.write`` per reply, which never
blocks) — over ``StoreCore``: a request is parsed, executed and answered inside one callback,
with no task switch. A blocking request registers a core waiter whose completion callback writes
the reply directly, which is how a lost peer is *pushed* to its waiters at once. (The store's
latency is a few Python callbacks per request; tasks and readiness waits per request cost more
than the work itself.) Any asyncio event loop works, uvloop included.

Authentication comes first: the server writes a challenge on connect and accepts nothing but a
valid HMAC answer within ``auth_timeout``; a silent or wrong client is dropped. Anything
malformed — an oversized length prefix (refused before the body is read), bytes that are not one
message of the request union, a request before authentication — gets a connection-level
``Error`` frame and closes that connection only; its session's ephemeral keys are then lost as
for any disconnect.

Bounded memory per connection, whatever the client does: no receive buffer of its own (the
loop reads every connection into one server-wide buffer — reading into it and handing the
bytes over run back to back in one callback, and the frame reader copies only a trailing
partial frame — so an idle connection costs a few KiB of loop and session objects, not a
buffer); at most one partial frame (4 KiB before authentication, just under
``4 + max_frame`` after), which must arrive whole within ``frame_timeout``; and at most
``max_output`` bytes of replies the client has not read. Store-wide, the partial frames of
all connections together may hold at most ``max_partial_bytes`` (256 MiB by default):
without it, N connections could each park a frame of ``max_frame`` bytes. The connection
whose bytes would pass it is dropped (``limit`` error, ``key="max_partial_bytes"``, and one
log line per 10 s); the ones within it, and every client whose requests arrive whole — a
request of one read never counts — keep being served. When
the client stops reading (the transport's write buffer passes its high-water mark) the server
stops reading and executing its requests until the buffer drains; replies that do not wait for
a request — waiter completions, pushed when another client writes — count toward the same
``max_output``, and the reply that would pass it drops the connection instead (``limit``
error, ``key="max_output"``). Gather replies are sized by the core before they are encoded
(``max_reply = max_frame``), so a request for more than a frame fails with a ``limit`` error
and builds nothing. Store-wide, the replies queued for clients that are not keeping up may
hold at most ``max_output_bytes`` (256 MiB by default, never below ``max_output``): without it,
N connections that park waiters and never read could each hold ``max_output``. A connection
is counted from the moment its transport pauses it (its write buffer past the high-water mark,
64 KiB on asyncio and uvloop) until it resumes (below the low-water mark) or closes; one that
keeps up is never counted, nor measured. When a reply takes the count past the budget, the
connection holding the most is dropped (``limit`` error, ``key="max_output_bytes"``, one log
line per 10 s) — not the one the reply was for: it may only be briefly behind, while the most
is held by whoever reads least (``StoreServer._reclaim_output`` says why). A dropped
connection's error frame queues behind what it holds, and its bytes stay counted through its
close grace, until the room is needed again: it is then aborted and its bytes freed at once.
So one connection costs at most about ``max_frame + max_output`` (48 MiB by default); all
connections' partial frames together ``max_partial_bytes``; all connections' queued replies
together ``max_output_bytes``, plus the one reply being written when it passes it and up to
the high-water mark for each connection below it. Pending waiters are capped per session by
the core; the bytes the store holds by its quotas (``max_bytes``, ``max_job_bytes``).

Connection limits: the server runs its own accept loop (asyncio's ``create_server`` would
re-``listen`` at its own backlog of 100, and logs a traceback per failed ``accept``). The
listen backlog is ``backlog``. At ``max_connections`` open connections a new one is sent a
``limit`` error and closed at once (its file descriptor is freed, not held); at most
``max_unauthenticated`` connections may wait to authenticate, and a new one evicts the oldest
(so a flood of silent connections cannot lock a token holder out: it only has to answer its
challenge sooner than ``max_unauthenticated`` others arrive). When ``accept`` itself fails —
the process is out of file descriptors, the kernel out of buffers — the loop backs off (10 ms
doubling to 1 s) and logs one line per failure kind per 10 s. A wrong token is answered only
after ``auth_fail_delay`` (the connection still counts as unauthenticated meanwhile), so
guessing runs at most ``max_unauthenticated / auth_fail_delay`` attempts per second. An
authenticated connection may be dropped after ``idle_timeout`` without requests or pending
waits; it is off by default, because ranks sit idle between rounds and TCP keepalive already
ends the sessions of hosts that died.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self, cast

import anyio
import msgspec

from m2n_async._proto.errors import M2NError, PeerLostError, RemoteProtocolError, StoreError
from m2n_async._store import _auth
from m2n_async._store._core import (
    DEFAULT_MAX_BYTES,
    Session,
    Snapshot,
    StaleGenerationError,
    StoreCore,
    StoreLimitError,
    Waiter,
)
from m2n_async._store._sockets import format_address, running_loop, tune_socket
from m2n_async._store._wire import (
    DEFAULT_MAX_FRAME,
    STORE_PROTO_VERSION,
    Add,
    AuthOk,
    Cancel,
    ClientAuth,
    ClientMessage,
    CompareSet,
    Count,
    Delete,
    DeletePrefix,
    Error,
    ErrorKind,
    Exchange,
    Flag,
    FrameReader,
    Gather,
    Get,
    Int,
    ItemsRaw,
    Ok,
    ServerHello,
    ServerMessage,
    Set,
    Swapped,
    Value,
    Wait,
    encode_frame,
)

if TYPE_CHECKING:
    from m2n_async._store._thread import StoreThread

__all__ = ["DEFAULT_MAX_OUTPUT_BYTES", "DEFAULT_MAX_PARTIAL_BYTES", "StoreServer"]

_log = logging.getLogger("m2n_async.store")
_CLOSE_GRACE = 5.0  # seconds a failed connection gets to flush its error frame
# The server's one receive buffer (module docstring). Requests are small; a large value just
# takes several reads.
_RECV_SIZE = 64 * 1024
# Until a connection has authenticated it may read only this much at a time (the handshake
# frame is ~120 bytes), so that a connection which never authenticates cannot make the server
# parse more than a few of its bytes before it is dropped.
_AUTH_RECV_SIZE = 1024
# ... and may have at most this much of a partial frame held for it: without the cap one
# unauthenticated connection could announce a max_frame-sized frame and park ~16 MiB here
# until its auth deadline.
_AUTH_MAX_PENDING = 4096
_ACCEPT_BACKOFF_MIN = 0.01  # seconds; doubled per consecutive accept failure ...
_ACCEPT_BACKOFF_MAX = 1.0  # ... up to this
_LOG_EVERY = 10.0  # seconds between two log lines about one kind of connection trouble
_RESERVED_FDS = 64  # file descriptors max_connections leaves to the rest of the process
# What a transport that has not paused us may hold: asyncio's and uvloop's write buffers pause
# the protocol past 64 KiB by default; this leaves a margin. Below it no reply needs measuring.
_UNPAUSED_MAX = 256 * 1024
# How long one connection's requests run back to back before the others get a turn: the
# requests of one read (up to 64 KiB of them, pipelined) would otherwise all run before any
# other client's, and the store may share its event loop with trainer rank 0's engine.
_TURN_S = 0.002
#: Store-wide budget of bytes held for partly received frames (``max_partial_bytes``) by
#: default: 16 frames of the default ``max_frame`` parked at once. Real clients' frames are
#: small and arrive whole; a big ``set`` is in flight for milliseconds.
DEFAULT_MAX_PARTIAL_BYTES: Final[int] = 256 * 1024 * 1024
#: Store-wide budget of bytes of replies queued for clients that are not reading them
#: (``max_output_bytes``) by default: 8 connections' full ``max_output`` at the default
#: ``max_frame``. A client that keeps up holds next to nothing here.
DEFAULT_MAX_OUTPUT_BYTES: Final[int] = 256 * 1024 * 1024


def _default_max_connections() -> int:
    """4096, or fewer when the process may open fewer files (with some left for the rest)."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # not a POSIX system
        return 1024
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - _RESERVED_FDS))


class _Throttled:
    """Log one line per kind of trouble per ``_LOG_EVERY`` s, counting what it held back: a
    flood of failing connections must not become a flood of log lines (an unread stderr pipe
    would then block the event loop for good)."""

    def __init__(self) -> None:
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        more = f" ({held} more like it in the last {_LOG_EVERY:g} s)" if held else ""
        _log.warning("%s%s", message, more)
        self._next[kind] = now + _LOG_EVERY


class StoreServer:
    """The control-plane store, served from the current event loop.

    ``async with StoreServer(host="127.0.0.1", port=0, token=secret) as server:`` binds
    exactly ``host`` (never the wildcard unless asked), picks a free port for ``port=0``, and
    serves until the block exits; ``server.address`` is ``"host:port"`` for
    ``StoreClient.connect``. ``token`` (str or bytes, non-empty) is the shared secret.

    Limits (module docstring): ``max_frame`` bytes per frame and per reply; ``max_output``
    bytes of unread replies per connection (default ``2 * max_frame``, at least ``max_frame``
    + 1 MiB); ``max_output_bytes`` of replies queued for clients not keeping up, all
    connections together (default 256 MiB, at least ``2 * max_output``; it must hold one
    connection's ``max_output``); ``max_partial_bytes`` held for partly received frames by all
    connections together (default 256 MiB, at least ``2 * max_frame``; it must hold one whole
    frame);
    ``max_bytes`` held by the store and ``max_job_bytes`` by one job (keys and values, plus
    96 bytes per key for its entry; ``None``: no quota); ``max_connections`` open (default
    from the process's file limit) of which
    ``max_unauthenticated`` waiting to authenticate, each for at most ``auth_timeout`` s
    (after it, the connection is dropped with an ``auth`` error); a frame must arrive whole within
    ``frame_timeout`` s; a wrong token is answered after ``auth_fail_delay`` s; an idle
    authenticated connection is dropped after ``idle_timeout`` s (``None``: never);
    ``backlog`` is the listen backlog. A limit that refuses a request answers it with a
    ``StoreLimitError`` naming the limit; one that drops or refuses a connection sends the same
    as a connection-level ``limit`` error first; the server keeps serving everyone else.

    Cancellation: leaving the block (normally, by error or by cancellation) closes the listener
    and every connection; clients then see ``StoreError``/``PeerLostError``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | bytes,
                 max_frame: int = DEFAULT_MAX_FRAME, auth_timeout: float = 10.0,
                 max_tombstones: int = 65536, max_waiters_per_session: int = 4096,
                 max_output: int | None = None, max_output_bytes: int | None = None,
                 max_partial_bytes: int | None = None,
                 max_bytes: int | None = DEFAULT_MAX_BYTES, max_job_bytes: int | None = None,
                 max_connections: int | None = None, max_unauthenticated: int = 64,
                 frame_timeout: float = 30.0, auth_fail_delay: float = 1.0,
                 idle_timeout: float | None = None, backlog: int = 1024) -> None:
        if not host:
            raise ValueError("StoreServer host must be an explicit address, got ''")
        if not 0 <= port <= 65535:
            raise ValueError(f"StoreServer port must be in [0, 65535], got {port}")
        self._key = _auth.token_bytes(token)
        if not self._key:
            raise ValueError("StoreServer token must be non-empty")
        if not 64 <= max_frame <= 2**32 - 1:
            raise ValueError(f"StoreServer max_frame must be in [64, 2**32 - 1], got {max_frame}")
        if not auth_timeout > 0:
            raise ValueError(f"StoreServer auth_timeout must be > 0, got {auth_timeout}")
        if max_output is None:
            max_output = max(2 * max_frame, max_frame + 4 * _UNPAUSED_MAX)
        if max_output < max_frame + 64:  # one reply of a whole frame must always fit
            raise ValueError(f"StoreServer max_output must be >= max_frame + 64 "
                             f"({max_frame + 64}), got {max_output}")
        if max_output_bytes is None:
            max_output_bytes = max(DEFAULT_MAX_OUTPUT_BYTES, 2 * max_output)
        if max_output_bytes < max_output:  # one connection's whole max_output must always fit
            raise ValueError(f"StoreServer max_output_bytes must be >= max_output "
                             f"({max_output}), got {max_output_bytes}")
        if max_partial_bytes is None:
            max_partial_bytes = max(DEFAULT_MAX_PARTIAL_BYTES, 2 * max_frame)
        if max_partial_bytes < max_frame + 4:  # one frame of max_frame must always fit
            raise ValueError(f"StoreServer max_partial_bytes must be >= max_frame + 4 "
                             f"({max_frame + 4}), got {max_partial_bytes}")
        if max_connections is None:
            max_connections = _default_max_connections()
        for name, count in (("max_connections", max_connections),
                            ("max_unauthenticated", max_unauthenticated), ("backlog", backlog)):
            if count < 1:
                raise ValueError(f"StoreServer {name} must be >= 1, got {count}")
        for name, seconds in (("frame_timeout", frame_timeout), ("idle_timeout", idle_timeout)):
            if seconds is not None and not seconds > 0:
                raise ValueError(f"StoreServer {name} must be > 0, got {seconds}")
        if not auth_fail_delay >= 0:
            raise ValueError(f"StoreServer auth_fail_delay must be >= 0, got {auth_fail_delay}")
        self._host = host
        self._port = port
        self._max_frame = max_frame
        self._auth_timeout = auth_timeout
        self._max_output = max_output
        self._max_output_bytes = max_output_bytes
        self._output_bytes = 0  # counted replies queued for all connections (the budget's use)
        # The connections counted in it (value unused): insertion-ordered, so that of two
        # holding as much, the one holding for longer comes first.
        self._output_holders: dict[_ServerProtocol, None] = {}
        self._max_partial_bytes = max_partial_bytes
        self._partial_bytes = 0  # held for partial frames by all connections (the budget's use)
        self._max_connections = max_connections
        self._max_unauthenticated = max_unauthenticated
        self._frame_timeout = frame_timeout
        self._auth_fail_delay = auth_fail_delay
        self._idle_timeout = idle_timeout
        self._backlog = backlog
        self.core = StoreCore(max_tombstones=max_tombstones,
                              max_waiters_per_session=max_waiters_per_session,
                              max_bytes=max_bytes, max_job_bytes=max_job_bytes,
                              max_reply=max_frame)
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._protocols: set[_ServerProtocol] = set()
        # Insertion-ordered: the first is the oldest, the one a new connection evicts.
        self._unauthenticated: dict[_ServerProtocol, None] = {}
        self._address: str | None = None
        self._trouble = _Throttled()
        # Shared by every connection (module docstring); the unauthenticated get a prefix.
        self._recv = memoryview(bytearray(_RECV_SIZE))
        self._auth_recv = self._recv[:_AUTH_RECV_SIZE]

    @property
    def address(self) -> str:
        """``"host:port"`` the server listens on (valid inside the ``async with`` block)."""
        if self._address is None:
            raise StoreError("StoreServer.address is only known while the server runs")
        return self._address

    @property
    def connections(self) -> int:
        """Connections currently open (authenticated or not)."""
        return len(self._protocols)

    @property
    def unauthenticated(self) -> int:
        """Connections open that have not authenticated (yet)."""
        return len(self._unauthenticated)

    @property
    def partial_bytes(self) -> int:
        """Bytes held now for partly received frames, all connections together (the use of
        ``max_partial_bytes``)."""
        return self._partial_bytes

    @property
    def output_bytes(self) -> int:
        """Bytes of replies queued now for clients that are not keeping up, all connections
        together (the use of ``max_output_bytes``; measured afresh on each call)."""
        for proto in list(self._output_holders):
            proto._measure_output()
        return self._output_bytes

    def in_thread(self, *, loop: str = "auto") -> StoreThread:
        """Serve from an event loop thread of its own; returns once the server listens (its
        ``address`` is known), a ``StoreThread`` to ``close()`` or use as ``with``. ``loop``:
        ``"auto"`` (uvloop when installed, else asyncio, as ``m2n-async store``),
        ``"asyncio"`` or ``"uvloop"`` (``ValueError`` if it is not installed).

        For a process that also runs an engine (trainer rank 0 of a job without a store of
        its own) or has no event loop (a synchronous script with ``BlockingTrainer``): the
        store answers every rank off the engine's loop, also while that loop is busy.
        """
        from m2n_async._store._cli import pick_loop
        from m2n_async._store._thread import StoreThread

        if loop not in ("auto", "asyncio", "uvloop"):
            raise ValueError(f"StoreServer.in_thread: loop must be 'auto', 'asyncio' or "
                             f"'uvloop', got {loop!r}")
        if self._sock is not None:
            raise StoreError("StoreServer is already running")
        return StoreThread(self, loop=pick_loop(loop))

    async def __aenter__(self) -> Self:
        """Bind and start serving.

        Cancellation: if cancelled while binding, nothing is left listening.
        """
        if self._sock is not None:
            raise StoreError("StoreServer is already running")
        loop = running_loop("StoreServer")
        sock = await _listen(self._host, self._port, self._backlog)
        host, port = sock.getsockname()[:2]
        self._address = format_address(str(host), int(port))
        self._sock = sock
        self._accepting = loop.create_task(self._accept(loop, sock))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        sock, self._sock = self._sock, None
        task, self._accepting = self._accepting, None
        self._address = None
        if sock is None:
            return
        if task is not None:
            task.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await asyncio.wait({task})
        sock.close()
        for proto in list(self._protocols):
            proto.abort()
        with anyio.CancelScope(shield=True):
            await asyncio.sleep(0)  # let the aborted connections end their sessions

    async def serve_forever(self) -> None:
        """Serve until cancelled.

        Cancellation: the only way it returns; the server is then closed.
        """
        async with self:
            await anyio.sleep_forever()


    def _reclaim_output(self) -> None:
        """All connections' queued replies passed ``max_output_bytes`` (a write just counted
        one): make room, from connections already dropped first, then by dropping the one
        holding the most.

        Why the one holding the most, and not the connection whose reply passed the budget:
        replies are queued by other clients' writes (a ``set`` completes every waiter of its
        key, on every connection at once), so the connection that happens to be written to
        last is no more to blame than any other, and it is often the innocent one: a client
        that keeps up holds at most its transport's high-water mark, while the budget fills
        with the output of connections that read nothing. Dropping the writer would let whoever
        filled the budget first have every later client that falls briefly behind (a large
        gather) dropped, and keep its hoard. The biggest holder is the one reading least, and
        dropping it frees the most room for one dropped connection. (``max_partial_bytes`` is
        the opposite case: a partial frame grows only by its own connection's bytes.)
        """
        holders = self._output_holders
        for proto in list(holders):  # counts taken at their last write are upper bounds
            proto._measure_output()
        budget = self._max_output_bytes
        if self._output_bytes <= budget:
            return
        # Sorted is stable: of two holding as much, the one that has held for longer first.
        ranked = sorted(holders, key=lambda proto: proto._queued, reverse=True)
        for proto in ranked:
            # Dropped already (by this budget or another limit), its error frame queued behind
            # replies it has not read: its grace ends now, its bytes are freed at once.
            if proto._closing:
                proto._discard_output()
                if self._output_bytes <= budget:
                    return
        live = self._output_bytes  # every holder left is a live connection
        for proto in ranked:
            if live <= budget:
                return
            if proto._closing:
                continue
            held = proto._queued
            live -= held
            # Its error frame queues behind what it holds; it keeps its close grace until the
            # room is needed again (the loop above), so a client that resumes reading sees it.
            proto._fail(0, "limit", (
                f"store connections hold {self._output_bytes} bytes of replies their clients "
                f"have not read, past the store-wide limit max_output_bytes ({budget} bytes), "
                f"and this connection holds the most ({held} bytes); connection dropped"),
                key="max_output_bytes")
            self._trouble.warn("max_output_bytes", (
                f"StoreServer at {self._address} dropped a connection holding {held} bytes of "
                f"unread replies: all connections' queued replies passed max_output_bytes "
                f"({budget} bytes)"))

    async def _accept(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        """Accept connections until cancelled (module docstring: limits, back-off)."""
        delay = 0.0
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue  # the peer gave up before it was accepted
            except OSError as exc:
                # Out of file descriptors (EMFILE/ENFILE) or kernel buffers: the connection
                # stays queued and the listener readable, so retrying at once would spin.
                delay = min(_ACCEPT_BACKOFF_MAX, max(2 * delay, _ACCEPT_BACKOFF_MIN))
                self._trouble.warn(f"accept {exc.errno}", (
                    f"StoreServer at {self._address} cannot accept connections: {exc}; backing "
                    f"off (now {delay:g} s); raise the open-files limit (ulimit -n) or lower "
                    "max_connections"))
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            if len(self._protocols) >= self._max_connections and self._unauthenticated:
                # A connection that has not authenticated gives way (the oldest): otherwise
                # silent connections below max_unauthenticated could lock token holders out
                # whenever the authenticated ones and they reach max_connections together.
                next(iter(self._unauthenticated))._fail(0, "limit", (
                    "store connection evicted before it authenticated: max_connections are "
                    "open and it was the oldest waiting"), key="max_connections")
            elif len(self._protocols) >= self._max_connections:
                _refuse(conn, (
                    f"store at {self._address} has {len(self._protocols)} connections open, its "
                    f"limit max_connections; connection refused"), "max_connections")
                self._trouble.warn("max_connections", (
                    f"StoreServer at {self._address} refused a connection: max_connections "
                    f"({self._max_connections}) are open"))
                continue
            try:
                await loop.connect_accepted_socket(lambda: _ServerProtocol(self), conn)
            except Exception as exc:  # one connection's failure must not end the accept loop
                conn.close()
                self._trouble.warn("connect", (
                    f"StoreServer at {self._address} dropped a connection it accepted: {exc!r}"))


def _refuse(conn: socket.socket, message: str, limit: str) -> None:
    """Tell an accepted connection it is over a limit (best effort) and close it at once."""
    try:
        conn.setblocking(False)
        conn.send(encode_frame(Error(0, "limit", message, key=limit)))
    except OSError:
        pass  # it is refused either way
    conn.close()


async def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening non-blocking socket bound to exactly ``host`` (first resolved address)."""
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise StoreError(f"StoreServer cannot resolve host {host!r}: {exc}") from exc
    family, type_, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)  # in force: nothing re-listens (the accept loop is ours)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise StoreError(f"StoreServer cannot listen on {format_address(host, port)}: {exc}"
                         ) from exc
    return sock


class _ServerProtocol(asyncio.BufferedProtocol):
    """One connection: handshake, then requests answered synchronously (see module doc).

    A ``BufferedProtocol``: the loop receives into the server's one preallocated buffer. A
    plain ``Protocol`` gets a fresh ``bytes`` per read, which asyncio allocates at 256 KiB and
    then shrinks — an mmap/munmap pair per request that cost ~20 us of a ~60 us round trip.
    Sharing the buffer is safe because both loops (asyncio, uvloop) call ``get_buffer``, read
    into it and call ``buffer_updated`` back to back, and ``buffer_updated`` consumes or
    copies every byte before it returns.
    """

    def __init__(self, server: StoreServer) -> None:
        self._server = server
        self._core = server.core
        self._reader: FrameReader[ClientMessage] = FrameReader(
            ClientMessage, max_frame=server._max_frame)  # type: ignore[arg-type]
        self._held = 0  # bytes of a partial frame counted in the server's max_partial_bytes
        self._queued = 0  # bytes of unread replies counted in the server's max_output_bytes
        self._transport: asyncio.Transport | None = None
        self._nonce = _auth.new_nonce()
        self._session: Session | None = None
        self._pending: dict[int, Waiter] = {}
        self._paused = False  # the client is not reading: stop executing its requests
        self._yielded = False  # its turn is over (_TURN_S): reading resumes next loop turn
        self._closing = False
        self._rejected = False  # wrong token: its answer is delayed, nothing more is read
        self._deadline: asyncio.TimerHandle | None = None  # auth, then the wrong-token answer
        self._frame_deadline: asyncio.TimerHandle | None = None  # a partial frame is held
        self._idle_check: asyncio.TimerHandle | None = None
        self._last_input = 0.0  # loop time of the last bytes in (only with idle_timeout)

    # --- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses: no isinstance).
        self._transport = cast(asyncio.Transport, transport)
        server = self._server
        server._protocols.add(self)
        waiting = server._unauthenticated
        if len(waiting) >= server._max_unauthenticated:
            oldest = next(iter(waiting))
            oldest._fail(0, "limit", (
                f"store connection evicted before it authenticated: more than "
                f"{server._max_unauthenticated} connections were waiting to (the limit "
                "max_unauthenticated), and it was the oldest"), key="max_unauthenticated")
            server._trouble.warn("max_unauthenticated", (
                f"StoreServer at {server._address} evicted a connection that had not "
                f"authenticated: max_unauthenticated ({server._max_unauthenticated}) were "
                "waiting"))
        waiting[self] = None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)
        self._deadline = asyncio.get_running_loop().call_later(
            self._server._auth_timeout, self._auth_expired)
        self._write(ServerHello(STORE_PROTO_VERSION, self._nonce))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._server._recv if self._session is not None else self._server._auth_recv

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._server._recv[:nbytes])  # the reader copies a partial frame

    def data_received(self, data: bytes | memoryview) -> None:
        """Bytes in (``buffer_updated`` calls it with a view of the receive buffer)."""
        if self._closing or self._rejected:
            return
        try:
            before = self._reader.buffered
            if data:  # nothing to feed on resume: feeding would replace a pending framing
                self._reader.feed(data)  # error (raised after the frames before it) with another
            # A frame completed in these bytes: what is still held is of a newer frame, whose
            # frame_timeout starts now (a pipelining client always holds part of one).
            newer = self._reader.buffered < before + len(data)
            if self._reader.buffered != self._held and self._over_partial_budget():
                return
            self._process()
            if self._reader.buffered:
                if self._session is None and self._reader.buffered > _AUTH_MAX_PENDING:
                    raise RemoteProtocolError(
                        f"store client sent {self._reader.buffered} bytes of a frame before "
                        f"authenticating (at most {_AUTH_MAX_PENDING} are held until then)")
                # A newer frame's clock starts now; while the connection's turn is over
                # (_yield_turn) the server, not the client, holds its bytes back: none runs.
                if (newer or self._yielded) and self._frame_deadline is not None:
                    self._frame_deadline.cancel()
                    self._frame_deadline = None
                if (self._frame_deadline is None and self._session is not None
                        and not self._yielded):
                    self._frame_deadline = asyncio.get_running_loop().call_later(
                        self._server._frame_timeout, self._frame_expired)
            elif self._frame_deadline is not None:
                self._frame_deadline.cancel()
                self._frame_deadline = None
            if self._idle_check is not None:
                self._last_input = asyncio.get_running_loop().time()
        except RemoteProtocolError as exc:
            self._fail(0, "protocol", str(exc))
        except Exception:  # a bug must cost one connection, never the server
            _log.exception("store connection handler failed; connection dropped")
            self._fail(0, "store", "internal error in the store server; connection dropped")

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._release_partial()
        self._count_output(0)  # the transport and its buffer are gone
        self._server._protocols.discard(self)
        self._server._unauthenticated.pop(self, None)
        for timer in (self._deadline, self._frame_deadline, self._idle_check):
            if timer is not None:
                timer.cancel()
        self._pending.clear()
        if self._session is not None:
            self._core.close_session(self._session)  # ephemeral keys lost, watchers told

    def pause_writing(self) -> None:
        self._paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        self._count_output(0)  # down to the low-water mark: what keeps up is not counted
        if self._transport is not None and not self._closing and not self._rejected:
            self._transport.resume_reading()
            # Execute what was parsed but not executed while paused -- soon, not here: the
            # transport calls this from inside its own write callback, and a request executed
            # now may close the transport (a framing error, a limit), which asyncio's selector
            # transport then reports lost twice (a traceback in the log).
            asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self.data_received(b"")

    def _yield_turn(self) -> None:
        """Stop executing this connection's requests until the loop's next turn, so that the
        other connections' reads (and the loop's other callbacks) run between its slices:
        its reads pause; what it already sent stays parsed and waits (``_end_turn``)."""
        self._yielded = True
        if self._transport is not None:
            self._transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._end_turn)

    def _end_turn(self) -> None:
        self._yielded = False
        if self._closing or self._rejected or self._paused:
            return  # resume_writing resumes reading and executing (as it would have)
        if self._transport is not None:
            self._transport.resume_reading()
        self.data_received(b"")

    # --- the connection's logic (synchronous) --------------------------------------------

    def abort(self) -> None:
        self._closing = True  # a turn queued (_end_turn, _resume) must not run on after it
        if self._transport is not None:
            self._transport.abort()

    def _process(self) -> None:
        turn_ends = time.perf_counter() + _TURN_S
        first = True  # at least one request a turn, however short the turn
        while not self._paused and not self._closing and not self._yielded:
            if not first and time.perf_counter() > turn_ends:
                self._yield_turn()
                return
            first = False
            msg = self._reader.next_message()
            if msg is None:
                return
            if self._session is None:
                self._authenticate(msg)
                continue
            if isinstance(msg, Cancel):
                waiter = self._pending.pop(msg.rid, None)
                if waiter is not None:
                    self._core.cancel(waiter)
                continue
            if isinstance(msg, ClientAuth):
                raise RemoteProtocolError("store client authenticated twice")
            if msg.rid in self._pending:
                raise RemoteProtocolError(f"store request id {msg.rid} reused while pending")
            try:
                reply = self._execute(self._session, msg)
            except M2NError as exc:
                reply = _error_reply(msg.rid, exc)
            if reply is not None:
                self._write(reply)

    def _authenticate(self, msg: ClientMessage) -> None:
        if not isinstance(msg, ClientAuth):
            raise RemoteProtocolError(
                f"store expected authentication first, got {type(msg).__name__}")
        if msg.version != STORE_PROTO_VERSION:
            raise RemoteProtocolError(
                f"store protocol version mismatch: client {msg.version}, server "
                f"{STORE_PROTO_VERSION}")
        server = self._server
        key = server._key
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if not _auth.verify(_auth.client_proof(key, self._nonce, msg.nonce), msg.mac):
            # Answer later, reading nothing meanwhile: guessing the token costs a connection
            # slot (max_unauthenticated of them) for auth_fail_delay per guess.
            self._rejected = True
            self._paused = True
            if self._transport is not None:
                self._transport.pause_reading()
            self._deadline = asyncio.get_running_loop().call_later(
                server._auth_fail_delay, self._fail, 0, "auth",
                "store authentication failed: wrong token")
            return
        server._unauthenticated.pop(self, None)
        self._session = self._core.open_session()
        if server._idle_timeout is not None:
            loop = asyncio.get_running_loop()
            self._last_input = loop.time()
            self._idle_check = loop.call_later(server._idle_timeout, self._idle_expired)
        self._write(AuthOk(_auth.server_proof(key, self._nonce, msg.nonce), self._session.id))

    def _auth_expired(self) -> None:
        if self._session is None and not self._closing:
            self._fail(0, "auth", "authentication deadline passed")

    def _over_partial_budget(self) -> bool:
        """Count this connection's partial frame in the store-wide ``max_partial_bytes``; if
        its growth passes the budget, drop the connection (True). A partial frame that only
        shrank, or a connection holding none, is never the one dropped."""
        server = self._server
        held = self._reader.buffered
        grew = held > self._held
        server._partial_bytes += held - self._held
        self._held = held
        limit = server._max_partial_bytes
        if not grew or server._partial_bytes <= limit:
            return False
        others = server._partial_bytes - held
        self._fail(0, "limit", (
            f"store connections hold {others} bytes of partly received frames, and the "
            f"{held} bytes of this connection's frame would pass the store-wide limit "
            f"max_partial_bytes ({limit} bytes); connection dropped"), key="max_partial_bytes")
        server._trouble.warn("max_partial_bytes", (
            f"StoreServer at {server._address} dropped a connection whose partial frame of "
            f"{held} bytes would pass max_partial_bytes ({limit} bytes; {others} held by "
            f"other connections)"))
        return True

    def _release_partial(self) -> None:
        """Free this connection's partial frame and give its bytes back to the budget."""
        self._server._partial_bytes -= self._held
        self._held = 0
        self._reader.discard()

    def _frame_expired(self) -> None:
        self._frame_deadline = None
        if self._reader.buffered and not self._closing:
            self._fail(0, "limit", (
                f"store client sent {self._reader.buffered} bytes of a frame and not the rest "
                f"within {self._server._frame_timeout:g} s (the limit frame_timeout); "
                "connection dropped"), key="frame_timeout")

    def _idle_expired(self) -> None:
        timeout = self._server._idle_timeout
        assert timeout is not None
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last_input
        if self._closing:
            return
        if idle < timeout or self._pending:  # a pending wait is not idleness
            self._idle_check = loop.call_later(max(timeout - idle, timeout / 10),
                                               self._idle_expired)
            return
        self._fail(0, "limit", (f"store connection idle for {idle:.1f} s (the limit "
                                "idle_timeout); connection dropped"), key="idle_timeout")

    def _execute(self, session: Session, msg: ClientMessage) -> ServerMessage | ItemsRaw | None:
        core = self._core
        match msg:
            case Get(rid, key, wait, watch):
                if not wait:
                    return Value(rid, core.get(session, key))
                return self._blocking(rid, core.begin_get(session, key, watch,
                                                          self._notifier(rid)))
            case Set(rid, key, value, ephemeral, reply):
                core.set(session, key, value, ephemeral=ephemeral)
                return Ok(rid) if reply else None  # unacknowledged: only a failure is answered
            case Add(rid, key, delta):
                return Int(rid, core.add(session, key, delta))
            case CompareSet(rid, key, expected, desired):
                swapped, current = core.compare_set(session, key, expected, desired)
                return Swapped(rid, swapped, current)
            case Delete(rid, key, lost):
                return Flag(rid, core.delete(session, key, lost=lost))
            case DeletePrefix(rid, prefix):
                return Count(rid, core.delete_prefix(session, prefix))
            case Wait(rid, keys, watch):
                return self._blocking(rid, core.begin_wait(session, keys, watch,
                                                           self._notifier(rid)))
            case Gather(rid, prefix, n, watch):
                return self._blocking(rid, core.begin_gather(session, prefix, n, watch,
                                                             self._notifier(rid)))
            case Exchange(rid, key, value, delete, prefix, n, watch):
                return self._blocking(rid, core.begin_exchange(
                    session, key, value, delete, prefix, n, watch, self._notifier(rid)))
        raise RemoteProtocolError(f"store cannot execute {type(msg).__name__}")

    def _notifier(self, rid: int) -> _Notify:
        return _Notify(self, rid)

    def _blocking(self, rid: int, waiter: Waiter) -> ServerMessage | ItemsRaw | None:
        if waiter.done:
            return _waiter_reply(rid, waiter)
        self._pending[rid] = waiter
        return None

    def _completed(self, rid: int) -> None:
        waiter = self._pending.pop(rid, None)
        # Sized before it is encoded: a client that does not read must not make us build
        # (and then refuse) one reply per waiter it parked.
        if waiter is not None and not self._closing and self._fits(_reply_size(waiter)):
            self._write(_waiter_reply(rid, waiter))

    def _fits(self, size: int) -> bool:
        """Whether ``size`` more bytes of replies fit ``max_output``; if not, drop the client.

        A completion is written whether or not the client reads (it answers no new request,
        so pausing reads cannot hold it back); this is what bounds them.
        """
        limit = self._server._max_output
        if not self._paused and size <= limit - _UNPAUSED_MAX:
            return True  # the common case, without a call: the transport holds little
        transport = self._transport
        if transport is None:
            return False
        held = transport.get_write_buffer_size()
        if held + size <= limit:
            return True
        self._fail(0, "limit", (
            f"store client is not reading its replies: {held} bytes wait for it, and a reply "
            f"of {size} bytes would pass the connection's limit max_output ({limit} bytes); "
            "connection dropped"), key="max_output")
        return False

    def _write(self, msg: ServerMessage | ItemsRaw, *, dropping: bool = False) -> None:
        """``dropping``: the error frame ``_fail`` writes as it drops this connection."""
        frame = encode_frame(msg)
        if not isinstance(msg, Error):
            if len(frame) - 4 > self._server._max_frame:  # a backstop: the core sizes gathers
                rid = getattr(msg, "rid", 0)
                frame = encode_frame(Error(
                    rid, "limit", f"reply of {len(frame) - 4} bytes exceeds the store frame "
                    f"limit of {self._server._max_frame} bytes", key="max_frame"))
            elif not self._fits(len(frame)):
                return
        elif len(frame) - 4 > self._server._max_frame:
            # The core quotes keys cut short, but an error's key field names one whole (a lost
            # key, a job), which may be nearly a frame long: the error then goes without it,
            # its message cut to fit too (a tiny max_frame), rather than as a frame too big
            # for its client to read.
            frame = encode_frame(msgspec.structs.replace(
                msg, key=None, message=msg.message[:max(0, self._server._max_frame - 128) // 4]))
        transport = self._transport
        if transport is None or self._closing:
            return
        transport.write(frame)  # past the high-water mark, this pauses us (synchronously)
        if self._paused or self._queued:  # the client is behind: count what waits for it
            self._measure_output()
            server = self._server
            # Any reply counts, per-request errors too (a waiter's peer_lost names two keys);
            # only the frame of a drop does not make room: no reclaim inside a reclaim.
            if server._output_bytes > server._max_output_bytes and not dropping:
                server._reclaim_output()

    def _measure_output(self) -> None:
        """Count what the transport holds for this client in ``max_output_bytes``: all of it
        while the transport has paused us (past its high-water mark), nothing once it resumed
        (below its low-water mark) — so a client that keeps up costs the count nothing."""
        transport = self._transport
        held = transport.get_write_buffer_size() if self._paused and transport is not None else 0
        self._count_output(held)

    def _count_output(self, queued: int) -> None:
        server = self._server
        server._output_bytes += queued - self._queued
        self._queued = queued
        if queued:
            server._output_holders[self] = None  # one already there keeps its place
        else:
            server._output_holders.pop(self, None)

    def _discard_output(self) -> None:
        """End a dropped connection's close grace now: its queued bytes are freed."""
        if self._transport is not None:
            self._transport.abort()
        self._count_output(0)

    def _fail(self, rid: int, kind: ErrorKind, message: str, *, key: str | None = None
              ) -> None:
        """Send a connection-level error (best effort) and close this connection only."""
        if self._closing:
            return
        self._server._unauthenticated.pop(self, None)
        self._write(Error(rid, kind, message, key=key), dropping=True)
        self._closing = True
        self._release_partial()  # nothing more is read: its partial frame is garbage now
        if self._transport is not None:
            self._transport.close()  # flushes the error frame, then closes
            # A peer that does not read would keep a closing transport (and its buffer) alive.
            asyncio.get_running_loop().call_later(_CLOSE_GRACE, self._transport.abort)


class _Notify:
    """Core completion callback: write the waiter's reply on its connection, right away."""

    __slots__ = ("_proto", "_rid")

    def __init__(self, proto: _ServerProtocol, rid: int) -> None:
        self._proto = proto
        self._rid = rid

    def __call__(self) -> None:
        self._proto._completed(self._rid)


_items_encoder = msgspec.msgpack.Encoder()


def _reply_size(waiter: Waiter) -> int:
    """A completed waiter's reply frame, in bytes at most (without encoding it)."""
    result = waiter.result
    if waiter.error is not None:
        return 256 + 4 * len(str(waiter.error))
    if isinstance(result, Snapshot):
        return result.nbytes
    if isinstance(result, bytes):
        return 64 + len(result)
    return 64


def _waiter_reply(rid: int, waiter: Waiter) -> ServerMessage | ItemsRaw:
    if waiter.error is not None:
        return _error_reply(rid, waiter.error)
    if waiter.kind == "gather":  # also exchange
        snapshot = waiter.result
        assert isinstance(snapshot, Snapshot)
        if not isinstance(snapshot.cache, msgspec.Raw):  # encode once for every waiter
            snapshot.cache = msgspec.Raw(_items_encoder.encode(snapshot.items))
        return ItemsRaw(rid, snapshot.cache)
    if waiter.kind == "get":
        assert isinstance(waiter.result, bytes)
        return Value(rid, waiter.result)
    return Ok(rid)


def _error_reply(rid: int, exc: M2NError) -> Error:
    if isinstance(exc, PeerLostError):
        return Error(rid, "peer_lost", str(exc), key=exc.key)
    if isinstance(exc, StaleGenerationError):
        return Error(rid, "stale_generation", str(exc), key=exc.job,
                     generation=exc.generation, current=exc.current)
    if isinstance(exc, StoreLimitError):
        return Error(rid, "limit", str(exc), key=exc.limit)
    if isinstance(exc, RemoteProtocolError):
        return Error(rid, "protocol", str(exc))
    return Error(rid, "store", str(exc))
