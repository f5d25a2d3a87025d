"""The TCP store client: one connection, one session, many concurrent callers.

Theory of operation: the connection is an ``asyncio.Protocol``; every received frame is parsed
in ``buffer_updated`` and filed, by request id, into the waiting caller's reply slot — never by
order. A call is: write one frame (``transport.write`` is synchronous, so a frame is always
whole), then wait on its slot. There is no background task, so a client needs no task group and
``connect`` can be awaited anywhere in an anyio (asyncio backend) program.

Cancellation: a cancelled caller removes its slot; a reply that arrives later for that id is
dropped, so the connection is never "one reply behind" (the redis-py CVE-2023-28858 bug). For
a blocking request the client also writes ``Cancel(rid)`` so the server forgets the waiter.

Unacknowledged sets (``set(..., ack=False)``, TCPStore's ``set`` semantics) are written and not
waited for; the server answers one only if it fails. Replies of one connection are written in
request order, so a reply to request ``r`` proves that every unacknowledged set sent before
``r`` has been applied or its failure has already arrived; that is how the client forgets them
(bounded: past ``MAX_UNACKED`` outstanding, the next set waits for its acknowledgement).

The connection is the session: closing it (``aclose``, or the process dying) drops the
session's ephemeral keys on the server. A transport or protocol failure marks the client
broken: pending calls raise the cause, later calls raise ``StoreError`` naming it.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Final, Self, TypeVar

import anyio
import anyio.lowlevel

from m2n_async._proto.errors import (
    AuthenticationError,
    M2NError,
    PeerLostError,
    RemoteProtocolError,
    StoreError,
)
from m2n_async._store import _auth
from m2n_async._store._core import StaleGenerationError, StoreLimitError, check_request_keys
from m2n_async._store._sockets import parse_address, running_loop, tune_socket
from m2n_async._store._wire import (
    DEFAULT_MAX_FRAME,
    STORE_PROTO_VERSION,
    Add,
    AuthOk,
    Cancel,
    ClientAuth,
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
    Items,
    Ok,
    Request,
    ServerHello,
    ServerMessage,
    Set,
    Swapped,
    Value,
    Wait,
    _Msg,
    encode_frame,
)

__all__ = ["MAX_UNACKED", "StoreClient", "parse_address", "sever_all"]

#: Every client of this process that may still be open: what ``sever_all`` cuts.
_LIVE: weakref.WeakSet[StoreClient] = weakref.WeakSet()


def sever_all(reason: str) -> int:
    """Break every open ``StoreClient`` of the running event loop at once, as a lost network
    would: their calls fail with ``StoreError`` and the server ends their sessions
    (ephemeral keys vanish, peers watching them get ``PeerLostError``). The process lives
    on. Only this loop's: a client is not thread-safe, and an engine's clients live on its
    loop. For the ``disconnect`` fault action (``m2n_async.testing``); how many it broke."""
    loop = asyncio.get_running_loop()
    n = 0
    for client in list(_LIVE):
        if client._loop is loop and not client._closed and client._broken is None:
            client._break(StoreError(f"store connection to {client.address} severed: "
                                     f"{reason}"))
            n += 1
    return n

#: Unacknowledged sets one client may have outstanding; the next ``set(ack=False)`` past it
#: waits for its acknowledgement (which settles every earlier one).
MAX_UNACKED: Final[int] = 1024
_CORK_LIMIT = 64 * 1024  # held-back unacknowledged sets are written once they reach this

R = TypeVar("R", bound=ServerMessage)


_RECV_SIZE = 256 * 1024  # one read takes a 64-rank all-gather of 1 KB envelopes whole


class _ClientProtocol(asyncio.BufferedProtocol):
    """Parses frames as they arrive and hands each message to the client.

    A ``BufferedProtocol`` receiving into one preallocated buffer: a plain ``Protocol`` costs a
    fresh 256 KiB ``bytes`` (mmap + munmap) per read, a large share of a round trip.
    """

    def __init__(self, max_frame: int) -> None:
        self._recv = memoryview(bytearray(_RECV_SIZE))
        self.reader: FrameReader[ServerMessage] = FrameReader(
            ServerMessage, max_frame=max_frame)  # type: ignore[arg-type]
        self.client: StoreClient | None = None
        self.inbox: list[ServerMessage] = []  # handshake messages, before a client exists
        self.inbox_event = anyio.Event()
        self.lost: BaseException | None = None
        self.writable: anyio.Event | None = None  # set while the transport is paused

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.reader.feed(self._recv[:nbytes])  # copies only a trailing partial frame
            while (msg := self.reader.next_message()) is not None:
                if self.client is not None:
                    self.client._on_message(msg)
                else:
                    self.inbox.append(msg)
                    self.inbox_event.set()
        except RemoteProtocolError as exc:
            if self.client is not None:
                self.client._break(RemoteProtocolError(f"store at {self.client.address}: {exc}"))
            else:
                self._lose(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc if exc is not None else EOFError("connection closed"))
        if self.writable is not None:
            self.writable.set()

    def _lose(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        self.inbox_event.set()
        if self.client is not None:
            self.client._on_lost(exc)

    def pause_writing(self) -> None:
        self.writable = anyio.Event()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set()
            self.writable = None


class StoreClient:
    """A session on a ``StoreServer``; implements the ``Store`` protocol.

    Create with ``await StoreClient.connect(address, token=...)``. Safe to share between tasks
    of one event loop: calls may run concurrently (a blocking ``gather`` does not hold up a
    ``set`` from another task).
    """

    def __init__(self, transport: asyncio.Transport, protocol: _ClientProtocol, session: int,
                 address: str) -> None:
        self._transport = transport
        self._protocol = protocol
        self.session = session
        self.address = address
        # This end's address of the connection: the interface that reaches the store, which
        # is where a data plane of this rank should listen (peers reach the store too).
        sockname = transport.get_extra_info("sockname")
        self.local_host: str | None = (str(sockname[0]) if isinstance(sockname, tuple)
                                       and sockname else None)
        # rid -> the caller's future. Its result is the reply, or the M2NError that failed
        # every pending call (a bare future is the cheapest wakeup there is, and anyio's cancel
        # scopes cancel it like any other await).
        self._pending: dict[int, asyncio.Future[ServerMessage | M2NError]] = {}
        self._rids = itertools.count(1)
        # Unacknowledged sets not known to be settled: their rids in send order, and their keys
        # (for the error message). A reply to rid r settles every one below r.
        self._unacked: deque[int] = deque()
        self._unacked_keys: dict[int, str] = {}
        self._deferred: M2NError | None = None  # first unreported failure of one of them
        self._deferred_more = 0  # further failures while it was unreported
        self._corked = bytearray()  # frames held back to go out in one write (see set)
        self._uncork_scheduled = False
        self._broken: M2NError | None = None
        self._closed = False
        self._loop = asyncio.get_running_loop()
        protocol.client = self
        _LIVE.add(self)

    @classmethod
    async def connect(cls, address: str | tuple[str, int], *, token: str | bytes | None,
                      max_frame: int = DEFAULT_MAX_FRAME) -> StoreClient:
        """Connect and authenticate.

        Raises ``AuthenticationError`` if the server refuses ``token`` or cannot prove it holds
        it, ``StoreError`` if the address cannot be reached or the handshake breaks.

        Cancellation: bounded only by the caller's cancel scope (there is no timeout argument);
        a cancelled connect closes its socket, and the server then drops the half-open session.
        """
        host, port = parse_address(address)
        key = _auth.token_bytes(token)
        where = f"store at {host}:{port}"
        loop = running_loop("StoreClient")
        try:
            transport, protocol = await loop.create_connection(
                lambda: _ClientProtocol(max_frame), host, port)
        except OSError as exc:
            raise StoreError(f"cannot connect to the {where}: {exc}") from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a store host that dies must fail our waits, not hang them
            tune_socket(sock)
        try:
            hello = await _handshake_message(protocol, where)
            if not isinstance(hello, ServerHello):
                raise RemoteProtocolError(
                    f"{where} sent {type(hello).__name__} instead of its challenge")
            if hello.version != STORE_PROTO_VERSION:
                raise RemoteProtocolError(
                    f"{where} speaks store protocol {hello.version}, we speak "
                    f"{STORE_PROTO_VERSION}")
            nonce = _auth.new_nonce()
            mac = _auth.client_proof(key, hello.nonce, nonce)
            transport.write(encode_frame(ClientAuth(STORE_PROTO_VERSION, nonce, mac)))
            reply = await _handshake_message(protocol, where)
            if not isinstance(reply, AuthOk):
                raise RemoteProtocolError(
                    f"{where} sent {type(reply).__name__} instead of accepting authentication")
            if not _auth.verify(_auth.server_proof(key, hello.nonce, nonce), reply.mac):
                raise AuthenticationError(
                    f"{where} failed to prove it holds the token: refusing to use it")
            if protocol.inbox:
                raise RemoteProtocolError(f"{where} sent frames before any request")
        except BaseException:
            transport.abort()
            raise
        return cls(transport, protocol, reply.session, f"{host}:{port}")

    # --- the Store protocol --------------------------------------------------------------

    async def set(self, key: str, value: bytes, *, ephemeral: bool = False, ack: bool = True
                  ) -> None:
        """Write ``key``.

        ``ack=True`` (the default) returns once the server has applied the write, and raises
        its failure. ``ack=False`` is TCPStore's ``set``: it returns at once, without a round
        trip; the request goes out with this client's next request or when this task next
        yields to the event loop, whichever comes first (a set and the call after it share one
        write). The write is still applied in order — every later call on this client sees it —
        but other sessions may not see it yet when this returns, and a failure (e.g.
        ``StaleGenerationError``) is raised later: by the first call on this client that starts
        after the failure arrived (that call does nothing else), or by ``flush()``, which waits
        until every earlier write was applied. If the connection breaks, unacknowledged writes
        since the last reply may or may not have been applied. At most 1024 are outstanding:
        past that, ``set`` waits for its acknowledgement. ``ack=False`` waits only while the
        server is not reading our writes (back-pressure), and does not otherwise yield to the
        event loop.

        Cancellation: with ``ack=True`` the write may or may not have happened; the connection
        stays usable. With ``ack=False`` a cancelled call sent nothing (it can only be cancelled
        while waiting for back-pressure); once sent, the write is never withdrawn.
        """
        if ack or len(self._unacked) >= MAX_UNACKED:
            await self._call(Set(self._rid(), key, bytes(value), ephemeral), Ok)
            return
        self._check_usable()
        writable = self._protocol.writable
        if writable is not None:  # the server is not draining our writes: wait (nothing sent)
            await writable.wait()
            self._check_usable()
        rid = self._rid()
        self._unacked.append(rid)
        self._unacked_keys[rid] = key
        # Held back until this task yields or the next request goes out, so that a set and
        # the call after it travel in one write (one syscall and one server wakeup, not two).
        corked = self._corked
        corked += encode_frame(Set(rid, key, bytes(value), ephemeral, False))
        if len(corked) >= _CORK_LIMIT:
            self._uncork()
        elif not self._uncork_scheduled:
            self._uncork_scheduled = True
            self._loop.call_soon(self._uncork)

    async def flush(self) -> None:
        """Wait until every ``set(..., ack=False)`` made so far has been applied; raise the
        first failure among them not raised yet (one round trip; none if nothing is pending).

        Cancellation: safe at any point; the writes themselves are not withdrawn.
        """
        if self._unacked:
            await self._call(Wait(self._rid(), (), ()), Ok)  # waits for no key: a no-op
        self._check_usable()

    async def get(self, key: str, *, wait: bool = False, watch: Sequence[str] = ()
                  ) -> bytes | None:
        """The value of ``key``, or ``None``; ``wait=True`` blocks until it exists.

        Cancellation: safe at any point; a waiting request is withdrawn on the server.
        """
        check_request_keys("get", watch)
        reply = await self._call(Get(self._rid(), key, wait, tuple(watch)), Value,
                                 blocking=wait)
        return reply.value

    async def wait(self, keys: Sequence[str], *, watch: Sequence[str] = ()) -> None:
        """Block until every key of ``keys`` has been set.

        Cancellation: safe at any point; the request is withdrawn on the server.
        """
        check_request_keys("wait", keys, watch)
        await self._call(Wait(self._rid(), tuple(keys), tuple(watch)), Ok, blocking=True)

    async def add(self, key: str, delta: int = 1) -> int:
        """Atomic int64 add; returns the new value.

        Cancellation: the add may or may not have happened (its result is then unknown).
        """
        return (await self._call(Add(self._rid(), key, delta), Int)).value

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes
                          ) -> tuple[bool, bytes | None]:
        """Set ``key`` to ``desired`` iff it holds ``expected``; ``(swapped, current)``.

        Cancellation: the swap may or may not have happened.
        """
        reply = await self._call(CompareSet(self._rid(), key, expected, bytes(desired)), Swapped)
        return reply.swapped, reply.current

    async def delete(self, key: str, *, lost: bool = False) -> bool:
        """Remove ``key``; whether it existed. ``lost=True``: as if the session that wrote it
        ended — watchers of ``key`` get ``PeerLostError`` (a failing rank leaving on purpose).

        Cancellation: the delete may or may not have happened.
        """
        return (await self._call(Delete(self._rid(), key, lost), Flag)).value

    async def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``; how many.

        Cancellation: the delete may or may not have happened.
        """
        return (await self._call(DeletePrefix(self._rid(), prefix), Count)).value

    async def gather(self, prefix: str, n: int, *, watch: Sequence[str] = ()
                     ) -> dict[str, bytes]:
        """Block until ``n`` keys exist under ``prefix``; all of them, sorted by key.

        Cancellation: safe at any point; the request is withdrawn on the server.
        """
        check_request_keys("gather", watch)
        reply = await self._call(Gather(self._rid(), prefix, n, tuple(watch)), Items,
                                 blocking=True)
        return reply.items

    async def exchange(self, key: str, value: bytes, prefix: str, n: int, *,
                       watch: Sequence[str] = (), delete: str | None = None
                       ) -> dict[str, bytes]:
        """Atomically delete ``delete``, set ``key``, then ``gather(prefix, n)``: one round trip.

        Cancellation: the set (and delete) may have happened; the gather is withdrawn.
        """
        check_request_keys("exchange", watch)
        reply = await self._call(Exchange(self._rid(), key, bytes(value), delete, prefix, n,
                                          tuple(watch)), Items, blocking=True)
        return reply.items

    async def aclose(self) -> None:
        """Close the connection; the server ends the session (ephemeral keys vanish).

        Unacknowledged sets are handed to the socket first, but one that the socket could not
        take at once is lost: ``await flush()`` before closing to know they landed.

        Cancellation: the close completes (it does not wait for the server).
        """
        if self._closed:
            return
        self._uncork()
        self._closed = True
        self._fail_all(StoreError(f"store client for {self.address} was closed"))
        # Abort, not close: a graceful close stops reading at once but waits for our write
        # buffer to drain, and a server that stopped reading us (we had not read its replies)
        # never drains it, so the connection — and the session's ephemeral keys, which peers
        # watch — would outlive the close until the process exits. What the socket already
        # took is still delivered; the rest belongs to calls that were just failed, or to
        # unacknowledged sets, which promise nothing without a flush.
        self._transport.abort()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` was called (a broken connection is not closed: calls say why)."""
        return self._closed

    # --- machinery -----------------------------------------------------------------------

    def _rid(self) -> int:
        return next(self._rids)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise StoreError(f"store connection to {self.address} is unusable after an "
                             f"earlier failure: {self._broken}") from self._broken
        if self._closed:
            raise StoreError(f"store client for {self.address} is closed")
        if self._deferred is not None:  # an unacknowledged set failed: report it now
            exc, more = self._deferred, self._deferred_more
            self._deferred, self._deferred_more = None, 0
            if more:
                exc.add_note(f"{more} later unacknowledged set(s) on this client failed too")
            raise exc

    async def _call(self, request: Request, expect: type[R], *, blocking: bool = False) -> R:
        self._check_usable()
        writable = self._protocol.writable
        if writable is not None:  # the server is not draining our writes: wait (nothing sent)
            await writable.wait()
            self._check_usable()
        rid = request.rid
        future: asyncio.Future[ServerMessage | M2NError] = self._loop.create_future()
        self._pending[rid] = future
        if self._corked:
            self._corked += encode_frame(request)
            self._uncork()
        elif not self._transport.is_closing():  # else connection_lost is about to fail us
            self._transport.write(encode_frame(request))
        try:
            reply = await future
        except BaseException:
            if self._pending.pop(rid, None) is not None and blocking:
                self._write(Cancel(rid))  # the server withdraws the waiter
            raise
        if isinstance(reply, expect):
            return reply
        if isinstance(reply, M2NError):
            raise _fresh(reply)
        if isinstance(reply, Error):
            raise _error_to_exception(reply, f"store at {self.address}")
        self._break(RemoteProtocolError(
            f"store at {self.address} answered {type(request).__name__} (rid {rid}, "
            f"session {self.session}) with {_describe(reply)}"))
        raise _fresh(self._broken)  # type: ignore[arg-type]

    def _write(self, msg: _Msg) -> None:
        self._corked += encode_frame(msg)
        self._uncork()

    def _uncork(self) -> None:
        """Write what is held back (unacknowledged sets, and the frame that joined them)."""
        self._uncork_scheduled = False
        if not self._corked:
            return
        # A new buffer rather than clear(): the transport may keep a view of what it could
        # not send yet.
        data, self._corked = self._corked, bytearray()
        if self._broken is None and not self._closed and not self._transport.is_closing():
            self._transport.write(data)

    def _on_message(self, msg: ServerMessage) -> None:
        if isinstance(msg, Error) and msg.rid == 0:
            self._break(_error_to_exception(msg, f"store at {self.address}"))
            return
        rid = getattr(msg, "rid", None)
        if not isinstance(rid, int):
            self._break(RemoteProtocolError(
                f"store at {self.address} sent an unexpected {type(msg).__name__}"))
            return
        if self._unacked:
            self._settle_unacked(rid, msg)
        future = self._pending.pop(rid, None)
        if future is None:
            return  # a late reply to a cancelled request: correlated by id, dropped
        if not future.done():  # done: cancelled, and its caller has not run yet to pop it
            future.set_result(msg)

    def _settle_unacked(self, rid: int, msg: ServerMessage) -> None:
        """``msg`` answers ``rid``: unacknowledged sets sent before it are settled (replies
        are written in request order); if it is the failure of one, keep it to raise."""
        unacked = self._unacked
        while unacked and unacked[0] < rid:
            del self._unacked_keys[unacked.popleft()]
        if unacked and unacked[0] == rid:
            unacked.popleft()
            key = self._unacked_keys.pop(rid)
            if isinstance(msg, Error):
                exc = _error_to_exception(msg, f"store at {self.address}")
                exc.add_note(f"raised by a later call: the unacknowledged set of {key!r} "
                             f"(rid {rid}) failed")
                if self._deferred is None:
                    self._deferred = exc
                else:
                    self._deferred_more += 1
            else:  # only a failure answers an unacknowledged set
                self._break(RemoteProtocolError(
                    f"store at {self.address} answered the unacknowledged set of {key!r} "
                    f"(rid {rid}, session {self.session}) with {_describe(msg)}"))

    def _on_lost(self, exc: BaseException) -> None:
        if self._closed:
            return
        self._break(StoreError(f"store at {self.address} closed the connection "
                               f"({type(exc).__name__})"))

    def _break(self, exc: M2NError) -> None:
        """Mark the connection unusable and close it (the server then ends our session)."""
        if self._broken is None:
            self._broken = exc
        self._fail_all(exc)
        self._transport.abort()

    def _fail_all(self, exc: M2NError) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_result(exc)


async def _handshake_message(protocol: _ClientProtocol, where: str) -> ServerMessage:
    while not protocol.inbox:
        if protocol.lost is not None:
            if isinstance(protocol.lost, RemoteProtocolError):
                raise RemoteProtocolError(f"{where}: {protocol.lost}")
            raise StoreError(f"{where} closed the connection during the handshake")
        protocol.inbox_event = anyio.Event()
        await protocol.inbox_event.wait()
    msg = protocol.inbox.pop(0)
    if isinstance(msg, Error):
        raise _error_to_exception(msg, where)
    return msg


def _describe(msg: ServerMessage | None) -> str:
    """A reply, briefly, for a mismatch report: its type, id and the start of its payload
    (which tells whose reply it was)."""
    if msg is None:
        return "nothing"
    fields = {f: getattr(msg, f) for f in msg.__struct_fields__}
    rid = fields.pop("rid", None)
    shown = ", ".join(f"{k}={_clip(repr(v))}" for k, v in fields.items())
    return f"{type(msg).__name__} (rid {rid}{', ' if shown else ''}{shown})"


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fresh(exc: M2NError) -> M2NError:
    """A new instance to raise, so tracebacks of different callers do not pile up."""
    if isinstance(exc, PeerLostError):
        return PeerLostError(str(exc), ranks=exc.ranks, key=exc.key)
    if isinstance(exc, StaleGenerationError):
        return StaleGenerationError(str(exc), job=exc.job, generation=exc.generation,
                                    current=exc.current)
    if isinstance(exc, StoreLimitError):
        return StoreLimitError(str(exc), limit=exc.limit)
    try:
        return type(exc)(*exc.args)
    except TypeError:
        return exc


def _error_to_exception(msg: Error, where: str) -> M2NError:
    text = msg.message
    if msg.kind == "peer_lost":
        return PeerLostError(text, key=msg.key)
    if msg.kind == "stale_generation":
        return StaleGenerationError(text, job=msg.key or "", generation=msg.generation or 0,
                                    current=msg.current or 0)
    if msg.kind == "auth":
        return AuthenticationError(f"{where}: {text}")
    if msg.kind == "protocol":
        return RemoteProtocolError(f"{where} reported a protocol error: {text}")
    if msg.kind == "limit":  # ``key`` names the limit
        return StoreLimitError(f"{where}: {text}", limit=msg.key or "")
    return StoreError(text)

