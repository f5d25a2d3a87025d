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

Bounded memory per connection: a receive buffer (1 KiB until the connection authenticates,
64 KiB after) and at most one partial frame (4 KiB before authentication, ``max_frame`` plus
one read after) are held, and when the client stops reading its replies (the transport's write
buffer passes its high-water mark) the server stops reading and executing that client's
requests until the buffer drains, so replies cannot pile up. Pending waiters are capped per
session by the core.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import TracebackType
from typing import Self, cast

import anyio
import msgspec

from m2n_async._proto.errors import M2NError, PeerLostError, RemoteProtocolError, StoreError
from m2n_async._store import _auth
from m2n_async._store._core import Session, Snapshot, StaleGenerationError, StoreCore, Waiter
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

__all__ = ["StoreServer", "format_address", "tune_socket"]

_log = logging.getLogger("m2n_async.store")
_CLOSE_GRACE = 5.0  # seconds a failed connection gets to flush its error frame
# Receive buffer per connection. Requests are small; a large value just takes several reads.
_RECV_SIZE = 64 * 1024
# Until a connection has authenticated it gets only this much (the handshake frame is ~120
# bytes), so that connections which never authenticate cost little while they wait to be
# dropped.
_AUTH_RECV_SIZE = 1024
# ... and may have at most this much of a partial frame held for it: without the cap one
# unauthenticated connection could announce a max_frame-sized frame and park ~16 MiB here
# until its auth deadline.
_AUTH_MAX_PENDING = 4096


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts bracketed (``[::1]:port``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


class StoreServer:
    """The control-plane store, served from the current event loop.

    ``async with StoreServer(host="127.0.0.1", port=0, token=secret) as server:`` binds
    exactly ``host`` (never the wildcard unless asked), picks a free port for ``port=0``, and
    serves until the block exits; ``server.address`` is ``"host:port"`` for
    ``StoreClient.connect``. ``token`` (str or bytes, non-empty) is the shared secret.

    Cancellation: leaving the block (normally, by error or by cancellation) closes the listener
    and every connection; clients then see ``StoreError``/``PeerLostError``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | bytes,
                 max_frame: int = DEFAULT_MAX_FRAME, auth_timeout: float = 10.0,
                 max_tombstones: int = 65536, max_waiters_per_session: int = 4096) -> None:
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
        self._host = host
        self._port = port
        self._max_frame = max_frame
        self._auth_timeout = auth_timeout
        self.core = StoreCore(max_tombstones=max_tombstones,
                              max_waiters_per_session=max_waiters_per_session)
        self._server: asyncio.Server | None = None
        self._protocols: set[_ServerProtocol] = set()
        self._address: str | None = None

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

    async def __aenter__(self) -> Self:
        """Bind and start serving.

        Cancellation: if cancelled while binding, nothing is left listening.
        """
        if self._server is not None:
            raise StoreError("StoreServer is already running")
        loop = running_loop("StoreServer")
        sock = await _listen(self._host, self._port)
        try:
            self._server = await loop.create_server(lambda: _ServerProtocol(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        host, port = sock.getsockname()[:2]
        self._address = format_address(str(host), int(port))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        server, self._server = self._server, None
        self._address = None
        if server is None:
            return
        server.close()
        for proto in list(self._protocols):
            proto.abort()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await server.wait_closed()

    async def serve_forever(self) -> None:
        """Serve until cancelled.

        Cancellation: the only way it returns; the server is then closed.
        """
        async with self:
            await anyio.sleep_forever()


async def _listen(host: str, port: int) -> socket.socket:
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
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise StoreError(f"StoreServer cannot listen on {format_address(host, port)}: {exc}"
                         ) from exc
    return sock


class _ServerProtocol(asyncio.BufferedProtocol):
    """One connection: handshake, then requests answered synchronously (see module doc).

    A ``BufferedProtocol``: the loop receives into our one preallocated buffer. A plain
    ``Protocol`` gets a fresh ``bytes`` per read, which asyncio allocates at 256 KiB and then
    shrinks — an mmap/munmap pair per request that cost ~20 us of a ~60 us round trip.
    """

    def __init__(self, server: StoreServer) -> None:
        self._server = server
        self._core = server.core
        self._reader: FrameReader[ClientMessage] = FrameReader(
            ClientMessage, max_frame=server._max_frame)  # type: ignore[arg-type]
        self._transport: asyncio.Transport | None = None
        self._nonce = _auth.new_nonce()
        self._session: Session | None = None
        self._pending: dict[int, Waiter] = {}
        self._paused = False  # the client is not reading: stop executing its requests
        self._closing = False
        self._deadline: asyncio.TimerHandle | None = None
        self._recv = memoryview(bytearray(_AUTH_RECV_SIZE))

    # --- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses: no isinstance).
        self._transport = cast(asyncio.Transport, transport)
        self._server._protocols.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)
        self._deadline = asyncio.get_running_loop().call_later(
            self._server._auth_timeout, self._auth_expired)
        self._write(ServerHello(STORE_PROTO_VERSION, self._nonce))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._recv[:nbytes])  # the reader copies only a partial frame

    def data_received(self, data: bytes | memoryview) -> None:
        """Bytes in (``buffer_updated`` calls it with a view of the receive buffer)."""
        if self._closing:
            return
        try:
            self._reader.feed(data)
            self._process()
            if self._session is None and self._reader.buffered > _AUTH_MAX_PENDING:
                raise RemoteProtocolError(
                    f"store client sent {self._reader.buffered} bytes of a frame before "
                    f"authenticating (at most {_AUTH_MAX_PENDING} are held until then)")
        except RemoteProtocolError as exc:
            self._fail(0, "protocol", str(exc))
        except Exception:  # a bug must cost one connection, never the server
            _log.exception("store connection handler failed; connection dropped")
            self._fail(0, "store", "internal error in the store server; connection dropped")

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._server._protocols.discard(self)
        if self._deadline is not None:
            self._deadline.cancel()
        self._pending.clear()
        if self._session is not None:
            self._core.close_session(self._session)  # ephemeral keys lost, watchers told

    def pause_writing(self) -> None:
        self._paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()
            self.data_received(b"")  # execute what was parsed but not executed while paused

    # --- the connection's logic (synchronous) --------------------------------------------

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _process(self) -> None:
        while not self._paused and not self._closing:
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
        key = self._server._key
        if not _auth.verify(_auth.client_proof(key, self._nonce, msg.nonce), msg.mac):
            self._fail(0, "auth", "store authentication failed: wrong token")
            return
        if self._deadline is not None:
            self._deadline.cancel()
        self._session = self._core.open_session()
        # Safe to swap here: the reader has consumed or copied everything it was fed.
        self._recv = memoryview(bytearray(_RECV_SIZE))
        self._write(AuthOk(_auth.server_proof(key, self._nonce, msg.nonce), self._session.id))

    def _auth_expired(self) -> None:
        if self._session is None and not self._closing:
            self._fail(0, "auth", "authentication deadline passed")

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
        if waiter is not None and not self._closing:
            self._write(_waiter_reply(rid, waiter))

    def _write(self, msg: ServerMessage | ItemsRaw) -> None:
        frame = encode_frame(msg)
        if len(frame) - 4 > self._server._max_frame and not isinstance(msg, Error):
            rid = getattr(msg, "rid", 0)
            frame = encode_frame(Error(
                rid, "limit", f"reply of {len(frame) - 4} bytes exceeds the store frame limit "
                f"of {self._server._max_frame} bytes"))
        if self._transport is not None and not self._closing:
            self._transport.write(frame)

    def _fail(self, rid: int, kind: ErrorKind, message: str) -> None:
        """Send a connection-level error (best effort) and close this connection only."""
        if self._closing:
            return
        self._write(Error(rid, kind, message))
        self._closing = True
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
    if isinstance(exc, RemoteProtocolError):
        return Error(rid, "protocol", str(exc))
    return Error(rid, "store", str(exc))
