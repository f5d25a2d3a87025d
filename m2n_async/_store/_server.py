"""The TCP store server: a thin anyio driver over ``StoreCore``.

Theory of operation: ``async with StoreServer(...)`` binds exactly the given address and serves
from a task group inside the caller's event loop until the block exits. Each connection gets
one task that (1) sends a challenge and must receive a valid HMAC answer within
``auth_timeout`` (a silent or wrong client is dropped; nothing else is accepted before), then
(2) opens a core session and reads frames in a loop. Non-blocking requests are answered inline,
so a client that stops reading its replies stops being read (TCP back-pressure, no queue
growth). A blocking request registers a core waiter; when the core completes it, its request id
goes onto the connection's completion queue (bounded by the core's per-session waiter limit)
and a second task sends the reply — this is how a lost peer is *pushed* to waiters at once.
One send lock keeps frames whole.

Anything malformed — an oversized length prefix, bytes that are not one message of the
request union, a request before authentication — gets a connection-level ``Error`` frame
(best effort) and closes that connection only; the session's ephemeral keys are then lost as
for any disconnect. Per connection the server holds at most one partial frame
(``max_frame`` + one read) plus its pending waiters.
"""

from __future__ import annotations

import logging
import math
import socket
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Self

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from m2n_async._proto.errors import M2NError, PeerLostError, RemoteProtocolError, StoreError
from m2n_async._store import _auth
from m2n_async._store._core import Session, Snapshot, StaleGenerationError, StoreCore, Waiter
from m2n_async._store._io import SocketChannel
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

__all__ = ["StoreServer", "format_address"]

_log = logging.getLogger("m2n_async.store")
_SEND_TIMEOUT = 30.0  # a peer that does not drain its socket for this long is dropped


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts bracketed (``[::1]:port``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
        self._stack: AsyncExitStack | None = None
        self._address: str | None = None
        self._connections = 0

    @property
    def address(self) -> str:
        """``"host:port"`` the server listens on (valid inside the ``async with`` block)."""
        if self._address is None:
            raise StoreError("StoreServer.address is only known while the server runs")
        return self._address

    @property
    def connections(self) -> int:
        """Connections currently open (authenticated or not)."""
        return self._connections

    async def __aenter__(self) -> Self:
        """Bind and start serving.

        Cancellation: if cancelled while binding, nothing is left listening.
        """
        if self._stack is not None:
            raise StoreError("StoreServer is already running")
        stack = AsyncExitStack()
        try:
            sock = await _listen(self._host, self._port)
            stack.callback(_close_listener, sock)
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)  # runs first on exit: stop serving
            host, port = sock.getsockname()[:2]
            self._address = format_address(str(host), int(port))
            tg.start_soon(self._accept_loop, sock, tg)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        stack, self._stack = self._stack, None
        self._address = None
        if stack is not None:
            return await stack.__aexit__(exc_type, exc, tb)
        return None

    async def serve_forever(self) -> None:
        """Serve until cancelled.

        Cancellation: the only way it returns; the server is then closed.
        """
        async with self:
            await anyio.sleep_forever()

    # --- per connection ------------------------------------------------------------------

    async def _accept_loop(self, sock: socket.socket, tg: anyio.abc.TaskGroup) -> None:
        while True:
            await anyio.wait_readable(sock)
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                _log.warning("store accept failed (%s); retrying in 0.1 s", exc)
                await anyio.sleep(0.1)
                continue
            tg.start_soon(self._handle, conn)

    async def _handle(self, sock: socket.socket) -> None:
        self._connections += 1
        chan = SocketChannel(sock, send_timeout=_SEND_TIMEOUT)
        try:
            await _Connection(self, chan).run()
        except Exception:  # one connection's failure must never stop the server
            _log.exception("store connection handler failed; connection dropped")
        finally:
            chan.close()
            self._connections -= 1


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


def _close_listener(sock: socket.socket) -> None:
    try:
        anyio.notify_closing(sock)
    except Exception:  # no waiter registered (loop already gone)
        pass
    sock.close()


class _Connection:
    def __init__(self, server: StoreServer, chan: SocketChannel) -> None:
        self._server = server
        self._core = server.core
        self._chan = chan
        self._reader: FrameReader[ClientMessage] = FrameReader(
            ClientMessage, max_frame=server._max_frame)  # type: ignore[arg-type]
        self._pending: dict[int, Waiter] = {}
        send, receive = anyio.create_memory_object_stream[int](max_buffer_size=math.inf)
        self._done_send: MemoryObjectSendStream[int] = send
        self._done_receive: MemoryObjectReceiveStream[int] = receive

    async def run(self) -> None:
        try:
            with anyio.fail_after(self._server._auth_timeout):
                authenticated = await self._authenticate()
        except TimeoutError:
            await self._send_error(0, "auth", "authentication deadline passed", best_effort=True)
            return
        except RemoteProtocolError as exc:
            await self._send_error(0, "protocol", str(exc), best_effort=True)
            return
        if authenticated is None:
            return
        session = authenticated
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._push_completions)
                try:
                    await self._serve(session)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._pending.clear()
            self._core.close_session(session)
            self._done_send.close()
            self._done_receive.close()

    async def _read(self) -> ClientMessage | None:
        """The next message, or ``None`` at end of stream. Framing errors propagate."""
        while True:
            msg = self._reader.next_message()
            if msg is not None:
                return msg
            try:
                data = await self._chan.receive()
            except (anyio.ClosedResourceError, OSError):
                return None
            if not data:
                return None
            self._reader.feed(data)

    async def _send(self, msg: ServerMessage | ItemsRaw) -> None:
        frame = encode_frame(msg)
        if len(frame) - 4 > self._server._max_frame and not isinstance(msg, Error):
            rid = getattr(msg, "rid", 0)
            frame = encode_frame(Error(
                rid, "limit", f"reply of {len(frame) - 4} bytes exceeds the store frame limit "
                f"of {self._server._max_frame} bytes"))
        await self._chan.send(frame)  # frame-atomic under cancellation (see _io)

    async def _send_error(self, rid: int, kind: str, message: str, *,
                          best_effort: bool = False) -> None:
        msg = Error(rid, kind, message)  # type: ignore[arg-type]
        if not best_effort:
            await self._send(msg)
            return
        try:
            with anyio.move_on_after(1.0):
                await self._send(msg)
        except Exception:  # the connection is being dropped anyway
            pass

    async def _authenticate(self) -> Session | None:
        nonce = _auth.new_nonce()
        await self._send(ServerHello(STORE_PROTO_VERSION, nonce))
        msg = await self._read()
        if msg is None:
            return None
        if not isinstance(msg, ClientAuth):
            raise RemoteProtocolError(
                f"store expected authentication first, got {type(msg).__name__}")
        if msg.version != STORE_PROTO_VERSION:
            raise RemoteProtocolError(
                f"store protocol version mismatch: client {msg.version}, server "
                f"{STORE_PROTO_VERSION}")
        key = self._server._key
        if not _auth.verify(_auth.client_proof(key, nonce, msg.nonce), msg.mac):
            await self._send_error(0, "auth", "store authentication failed: wrong token",
                                   best_effort=True)
            return None
        session = self._core.open_session()
        await self._send(AuthOk(_auth.server_proof(key, nonce, msg.nonce), session.id))
        return session

    async def _serve(self, session: Session) -> None:
        while True:
            try:
                msg = await self._read()
            except RemoteProtocolError as exc:
                await self._send_error(0, "protocol", str(exc), best_effort=True)
                return
            if msg is None:
                return
            if isinstance(msg, Cancel):
                waiter = self._pending.pop(msg.rid, None)
                if waiter is not None:
                    self._core.cancel(waiter)
                continue
            if isinstance(msg, ClientAuth):
                await self._send_error(0, "protocol", "store client authenticated twice",
                                       best_effort=True)
                return
            if msg.rid in self._pending:
                await self._send_error(0, "protocol", f"store request id {msg.rid} reused "
                                       "while still pending", best_effort=True)
                return
            try:
                reply = self._execute(session, msg)
            except M2NError as exc:
                reply = _error_reply(msg.rid, exc)
            if reply is not None:
                await self._send(reply)

    def _execute(self, session: Session, msg: ClientMessage) -> ServerMessage | ItemsRaw | None:
        core = self._core
        match msg:
            case Get(rid, key, wait, watch):
                if not wait:
                    return Value(rid, core.get(session, key))
                return self._blocking(rid, core.begin_get(session, key, watch,
                                                          self._notifier(rid)))
            case Set(rid, key, value, ephemeral):
                core.set(session, key, value, ephemeral=ephemeral)
                return Ok(rid)
            case Add(rid, key, delta):
                return Int(rid, core.add(session, key, delta))
            case CompareSet(rid, key, expected, desired):
                swapped, current = core.compare_set(session, key, expected, desired)
                return Swapped(rid, swapped, current)
            case Delete(rid, key):
                return Flag(rid, core.delete(session, key))
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
        return _Notify(self._done_send, rid)

    def _blocking(self, rid: int, waiter: Waiter) -> ServerMessage | ItemsRaw | None:
        if waiter.done:
            return _waiter_reply(rid, waiter)
        self._pending[rid] = waiter
        return None

    async def _push_completions(self) -> None:
        async for rid in self._done_receive:
            waiter = self._pending.pop(rid, None)
            if waiter is None:  # cancelled by the client after completing: drop
                continue
            await self._send(_waiter_reply(rid, waiter))


class _Notify:
    """Core callback: queue the request id for the completion pusher (never blocks)."""

    __slots__ = ("_rid", "_send")

    def __init__(self, send: MemoryObjectSendStream[int], rid: int) -> None:
        self._send = send
        self._rid = rid

    def __call__(self) -> None:
        try:
            self._send.send_nowait(self._rid)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # connection already gone


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
