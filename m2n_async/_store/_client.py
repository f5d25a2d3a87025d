"""The TCP store client: one connection, one session, many concurrent callers.

Theory of operation: every request gets a fresh request id and a reply slot; replies are
matched to slots by id, never by order. There is no background task (so a client needs no
task group and ``connect`` can be awaited anywhere): whichever caller is waiting and finds
nobody reading becomes the reader, reads frames and files each reply into its slot, and when
its own reply has arrived hands the reading role to another waiting caller. Reads are
cancel-safe because received bytes go into a ``FrameReader`` buffer, never half-consumed.

Cancellation: a cancelled caller removes its slot; a reply that arrives later for that id is
dropped, so the connection is never "one reply behind" (the redis-py CVE-2023-28858 bug). For
a blocking request the client also sends ``Cancel(rid)`` (shielded, bounded) so the server
forgets the waiter. Sends are shielded so a cancelled sender never leaves half a frame.

The connection is the session: closing it (``aclose``, or the process dying) drops the
session's ephemeral keys on the server. Any transport or protocol failure marks the client
broken: every pending and later call raises ``StoreError`` naming the cause.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Sequence
from types import TracebackType
from typing import Self, TypeVar

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
from m2n_async._store._core import StaleGenerationError
from m2n_async._store._io import SocketChannel
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

__all__ = ["StoreClient", "parse_address"]

_CANCEL_TIMEOUT = 1.0
R = TypeVar("R", bound=ServerMessage)


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


class _Slot:
    __slots__ = ("error", "event", "reply")

    def __init__(self) -> None:
        self.reply: ServerMessage | None = None
        self.error: M2NError | None = None
        self.event: anyio.Event | None = None

    @property
    def done(self) -> bool:
        return self.reply is not None or self.error is not None

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()


class StoreClient:
    """A session on a ``StoreServer``; implements the ``Store`` protocol.

    Create with ``await StoreClient.connect(address, token=...)``. Safe to share between tasks
    of one event loop: calls may run concurrently (a blocking ``gather`` does not hold up a
    ``set`` from another task).
    """

    def __init__(self, chan: SocketChannel, reader: FrameReader[ServerMessage],
                 session: int, address: str) -> None:
        self._chan = chan
        self._reader = reader
        self.session = session
        self.address = address
        self._pending: dict[int, _Slot] = {}
        self._next_rid = 1
        self._reading = False
        self._broken: M2NError | None = None
        self._closed = False

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
        chan = SocketChannel(await _open_socket(host, port, where))
        try:
            reader: FrameReader[ServerMessage] = FrameReader(
                ServerMessage, max_frame=max_frame)  # type: ignore[arg-type]
            hello = await _read_one(chan, reader, where)
            if isinstance(hello, Error):
                raise _error_to_exception(hello, where)
            if not isinstance(hello, ServerHello):
                raise RemoteProtocolError(
                    f"{where} sent {type(hello).__name__} instead of its challenge")
            if hello.version != STORE_PROTO_VERSION:
                raise RemoteProtocolError(
                    f"{where} speaks store protocol {hello.version}, we speak "
                    f"{STORE_PROTO_VERSION}")
            nonce = _auth.new_nonce()
            mac = _auth.client_proof(key, hello.nonce, nonce)
            try:
                await chan.send(encode_frame(ClientAuth(STORE_PROTO_VERSION, nonce, mac)))
            except (OSError, anyio.ClosedResourceError) as exc:
                raise StoreError(f"{where} closed the connection during the handshake"
                                 ) from exc
            reply = await _read_one(chan, reader, where)
            if isinstance(reply, Error):
                raise _error_to_exception(reply, where)
            if not isinstance(reply, AuthOk):
                raise RemoteProtocolError(
                    f"{where} sent {type(reply).__name__} instead of accepting authentication")
            if not _auth.verify(_auth.server_proof(key, hello.nonce, nonce), reply.mac):
                raise AuthenticationError(
                    f"{where} failed to prove it holds the token: refusing to use it")
        except BaseException:
            chan.close()
            raise
        return cls(chan, reader, reply.session, f"{host}:{port}")

    # --- the Store protocol --------------------------------------------------------------

    async def set(self, key: str, value: bytes, *, ephemeral: bool = False) -> None:
        """Write ``key``.

        Cancellation: the write may or may not have happened; the connection stays usable.
        """
        await self._call(Set(self._rid(), key, bytes(value), ephemeral), Ok)

    async def get(self, key: str, *, wait: bool = False, watch: Sequence[str] = ()
                  ) -> bytes | None:
        """The value of ``key``, or ``None``; ``wait=True`` blocks until it exists.

        Cancellation: safe at any point; a waiting request is withdrawn on the server.
        """
        reply = await self._call(Get(self._rid(), key, wait, tuple(watch)), Value,
                                 blocking=wait)
        return reply.value

    async def wait(self, keys: Sequence[str], *, watch: Sequence[str] = ()) -> None:
        """Block until every key of ``keys`` has been set.

        Cancellation: safe at any point; the request is withdrawn on the server.
        """
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

    async def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed.

        Cancellation: the delete may or may not have happened.
        """
        return (await self._call(Delete(self._rid(), key), Flag)).value

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
        reply = await self._call(Gather(self._rid(), prefix, n, tuple(watch)), Items,
                                 blocking=True)
        return reply.items

    async def exchange(self, key: str, value: bytes, prefix: str, n: int, *,
                       watch: Sequence[str] = (), delete: str | None = None
                       ) -> dict[str, bytes]:
        """Atomically delete ``delete``, set ``key``, then ``gather(prefix, n)``: one round trip.

        Cancellation: the set (and delete) may have happened; the gather is withdrawn.
        """
        reply = await self._call(Exchange(self._rid(), key, bytes(value), delete, prefix, n,
                                          tuple(watch)), Items, blocking=True)
        return reply.items

    async def aclose(self) -> None:
        """Close the connection; the server ends the session (ephemeral keys vanish).

        Cancellation: the close is shielded and completes.
        """
        if self._closed:
            return
        self._closed = True
        self._fail_all(StoreError(f"store client for {self.address} was closed"))
        self._chan.close()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- machinery -----------------------------------------------------------------------

    def _rid(self) -> int:
        rid = self._next_rid
        self._next_rid += 1
        return rid

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise StoreError(f"store connection to {self.address} is unusable after an "
                             f"earlier failure: {self._broken}") from self._broken
        if self._closed:
            raise StoreError(f"store client for {self.address} is closed")

    async def _call(self, request: Request, expect: type[R], *, blocking: bool = False) -> R:
        self._check_usable()
        rid = request.rid
        slot = _Slot()
        self._pending[rid] = slot
        try:
            await self._send(request)
            reply = await self._await_reply(slot)
        except BaseException:
            if self._pending.pop(rid, None) is not None and blocking:
                await self._withdraw(rid)
            raise
        if isinstance(reply, Error):
            raise _error_to_exception(reply, f"store at {self.address}")
        if not isinstance(reply, expect):
            self._break(RemoteProtocolError(
                f"store at {self.address} answered {type(request).__name__} with "
                f"{type(reply).__name__}"))
            raise _fresh(self._broken)  # type: ignore[arg-type]
        return reply

    async def _withdraw(self, rid: int) -> None:
        if self._broken is not None or self._closed:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_TIMEOUT) as scope:
            try:
                await self._send(Cancel(rid))
            except M2NError:
                return
        if scope.cancelled_caught:
            self._break(StoreError(f"store at {self.address}: could not withdraw a cancelled "
                                   "request in time; connection dropped"))

    async def _send(self, msg: _Msg) -> None:
        self._check_usable()
        try:
            await self._chan.send(encode_frame(msg))
        except (OSError, anyio.ClosedResourceError) as exc:
            if self._closed:
                raise StoreError(f"store client for {self.address} is closed") from None
            self._break(StoreError(f"store at {self.address}: connection lost while sending "
                                   f"({exc!r})"))
            raise _fresh(self._broken) from exc  # type: ignore[arg-type]

    async def _await_reply(self, slot: _Slot) -> ServerMessage:
        while not slot.done:
            if self._reading:
                slot.event = anyio.Event()
                try:
                    await slot.event.wait()
                finally:
                    slot.event = None
                continue
            self._reading = True
            try:
                while not slot.done:
                    await self._read_and_dispatch()
            finally:
                self._reading = False
                self._hand_over()
        if slot.error is not None:
            raise _fresh(slot.error)
        assert slot.reply is not None
        return slot.reply

    def _hand_over(self) -> None:
        """Wake one waiting caller to take over reading (it re-checks its slot first)."""
        for other in self._pending.values():
            if not other.done and other.event is not None:
                other.wake()
                return

    async def _read_and_dispatch(self) -> None:
        try:
            msg = self._reader.next_message()
            while msg is None:
                data = await self._chan.receive()
                if not data:
                    raise anyio.EndOfStream
                self._reader.feed(data)
                msg = self._reader.next_message()
        except RemoteProtocolError as exc:
            self._break(RemoteProtocolError(f"store at {self.address}: {exc}"))
            return
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                OSError) as exc:
            if self._closed:
                self._fail_all(StoreError(f"store client for {self.address} was closed"))
            else:
                self._break(StoreError(f"store at {self.address} closed the connection "
                                       f"({type(exc).__name__})"))
            return
        if isinstance(msg, Error) and msg.rid == 0:
            self._break(_error_to_exception(msg, f"store at {self.address}"))
            return
        rid = getattr(msg, "rid", None)
        slot = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if slot is None:
            if rid is None:
                self._break(RemoteProtocolError(
                    f"store at {self.address} sent an unexpected {type(msg).__name__}"))
            return  # a late reply to a cancelled request: correlate by id and drop it
        slot.reply = msg
        slot.wake()

    def _break(self, exc: M2NError) -> None:
        """Mark the connection unusable and close it (the server then ends our session)."""
        if self._broken is None:
            self._broken = exc
        self._fail_all(exc)
        self._chan.close()

    def _fail_all(self, exc: M2NError) -> None:
        pending, self._pending = self._pending, {}
        for slot in pending.values():
            if not slot.done:
                slot.error = exc
                slot.wake()


def _fresh(exc: M2NError) -> M2NError:
    """A new instance to raise, so tracebacks of different callers do not pile up."""
    if isinstance(exc, PeerLostError):
        return PeerLostError(str(exc), ranks=exc.ranks, key=exc.key)
    if isinstance(exc, StaleGenerationError):
        return StaleGenerationError(str(exc), job=exc.job, generation=exc.generation,
                                    current=exc.current)
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
    return StoreError(text)


async def _read_one(chan: SocketChannel, reader: FrameReader[ServerMessage],
                    where: str) -> ServerMessage:
    while True:
        msg = reader.next_message()
        if msg is not None:
            return msg
        try:
            data = await chan.receive()
        except (anyio.ClosedResourceError, OSError) as exc:
            raise StoreError(f"{where} closed the connection during the handshake") from exc
        if not data:
            raise StoreError(f"{where} closed the connection during the handshake")
        reader.feed(data)


async def _open_socket(host: str, port: int, where: str) -> socket.socket:
    """A connected non-blocking socket to ``host:port`` (first address that answers)."""
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise StoreError(f"cannot resolve the {where}: {exc}") from exc
    errors: list[str] = []
    for family, type_, proto, _, sockaddr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            err = sock.connect_ex(sockaddr)
            if err in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
                await anyio.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == 0:
                return sock
            errors.append(f"{sockaddr}: {os.strerror(err)}")
        except OSError as exc:
            errors.append(f"{sockaddr}: {exc}")
        except BaseException:
            sock.close()
            raise
        sock.close()
    raise StoreError(f"cannot connect to the {where}: {'; '.join(errors) or 'no address'}")
