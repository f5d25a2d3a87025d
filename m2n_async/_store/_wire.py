"""Store wire format: frames, messages and a sans-IO frame reader.

Theory of operation: a frame is a big-endian u32 length followed by that many bytes of
msgpack holding exactly one message of a msgspec tagged union. The length is checked against
the limit as soon as its four bytes have arrived, *before* any of the body is buffered, so a
hostile prefix cannot make us allocate. ``FrameReader`` is pure (bytes in, messages out; no
sockets, no clocks) so that the server, the client and the fuzz tests share one parser.

Every request carries a request id (``rid``, a positive int chosen by the client); every reply
echoes it (except a ``Set`` sent with ``reply=False``, which is answered only by an ``Error``
if it fails). The client correlates replies by id, which is what makes cancelling a request safe:
a late reply for an abandoned id is dropped instead of being handed to the next caller (the
redis-py CVE-2023-28858 failure mode). ``Cancel(rid)`` tells the server to forget a blocking
request; it has no reply. ``rid == 0`` in an ``Error`` means the error is about the connection,
not one request, and the server closes the connection after sending it.

Messages are ``array_like`` (positional) for compactness; the tag is the class name. Store
messages are private to the store and deliberately separate from the engine envelopes in
``_proto/messages.py``: the store moves opaque bytes and never decodes what it carries.
"""

from __future__ import annotations

import struct
from typing import Annotated, Final, Generic, Literal, TypeVar

import msgspec

from m2n_async._proto.errors import RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "STORE_PROTO_VERSION",
    "Add",
    "AuthOk",
    "Cancel",
    "ClientAuth",
    "ClientMessage",
    "CompareSet",
    "Count",
    "Delete",
    "DeletePrefix",
    "Error",
    "ErrorKind",
    "Exchange",
    "Flag",
    "FrameReader",
    "Gather",
    "Get",
    "MAX_REQUEST_KEYS",
    "Int",
    "Items",
    "ItemsRaw",
    "Ok",
    "Request",
    "ServerHello",
    "ServerMessage",
    "Set",
    "Swapped",
    "Value",
    "Wait",
    "encode_frame",
]

STORE_PROTO_VERSION: Final[int] = 2  # 2: Set.reply
DEFAULT_MAX_FRAME: Final[int] = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")

# Request ids: positive and within int64 so msgpack keeps them compact and exact.
Rid = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
#: The most keys one request may list (a ``wait``'s keys, a ``watch``): enough for a watch of
#: every rank's liveness key at the engine's largest world (2**17) and a bell. A frame of
#: short keys decodes to ~20x its size; checked by msgspec from the list's header, before any
#: key is decoded, so at most this many (~7.5 MB of objects) are built from one list.
MAX_REQUEST_KEYS: Final[int] = 1 << 18
Keys = Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_REQUEST_KEYS)]


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True, tag=True):
    pass


# --- handshake ---------------------------------------------------------------------------


class ServerHello(_Msg, frozen=True):
    """First frame on every connection: the server's protocol version and challenge."""

    version: int
    nonce: Nonce


class ClientAuth(_Msg, frozen=True):
    """HMAC(token, "client" + server nonce + client nonce) proves the client knows the token."""

    version: int
    nonce: Nonce
    mac: Mac


class AuthOk(_Msg, frozen=True):
    """HMAC(token, "server" + client nonce + server nonce): the server proves it too."""

    mac: Mac
    session: int


# --- requests ----------------------------------------------------------------------------


class Set(_Msg, frozen=True):
    """``reply=False``: an unacknowledged set — the server answers only if it fails."""

    rid: Rid
    key: str
    value: bytes
    ephemeral: bool = False
    reply: bool = True


class Get(_Msg, frozen=True):
    rid: Rid
    key: str
    wait: bool = False
    watch: Keys = ()


class Wait(_Msg, frozen=True):
    rid: Rid
    keys: Keys
    watch: Keys = ()


class Add(_Msg, frozen=True):
    rid: Rid
    key: str
    delta: Int64 = 1


class CompareSet(_Msg, frozen=True):
    rid: Rid
    key: str
    expected: bytes | None
    desired: bytes


class Delete(_Msg, frozen=True):
    rid: Rid
    key: str
    lost: bool = False  # remove as if its session ended: watchers get PeerLostError


class DeletePrefix(_Msg, frozen=True):
    rid: Rid
    prefix: str


class Gather(_Msg, frozen=True):
    rid: Rid
    prefix: str
    n: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    watch: Keys = ()


class Exchange(_Msg, frozen=True):
    """Delete ``delete``, set ``key``, then gather ``prefix`` — one atomic round trip."""

    rid: Rid
    key: str
    value: bytes
    delete: str | None
    prefix: str
    n: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    watch: Keys = ()


class Cancel(_Msg, frozen=True):
    """Forget blocking request ``rid`` (no reply; unknown ids are ignored: it may have won)."""

    rid: Rid


Request = Set | Get | Wait | Add | CompareSet | Delete | DeletePrefix | Gather | Exchange
ClientMessage = (
    ClientAuth | Set | Get | Wait | Add | CompareSet | Delete | DeletePrefix | Gather | Exchange
    | Cancel
)

# --- replies -----------------------------------------------------------------------------


class Ok(_Msg, frozen=True):
    rid: int


class Value(_Msg, frozen=True):
    rid: int
    value: bytes | None


class Int(_Msg, frozen=True):
    rid: int
    value: int


class Swapped(_Msg, frozen=True):
    rid: int
    swapped: bool
    current: bytes | None


class Flag(_Msg, frozen=True):
    rid: int
    value: bool


class Count(_Msg, frozen=True):
    rid: int
    value: int


class Items(_Msg, frozen=True):
    rid: int
    items: dict[str, bytes]


class ItemsRaw(_Msg, frozen=True, tag="Items"):
    """Encode-only twin of ``Items`` whose map is already msgpack (``msgspec.Raw``): the server
    encodes one gather snapshot once for all the waiters it completes."""

    rid: int
    items: msgspec.Raw


ErrorKind = Literal["store", "peer_lost", "stale_generation", "auth", "protocol", "limit"]


class Error(_Msg, frozen=True):
    """A request (``rid > 0``) or the whole connection (``rid == 0``) failed."""

    rid: int
    kind: ErrorKind
    message: str
    key: str | None = None  # peer_lost: lost key; stale_generation: job; limit: its name
    generation: int | None = None  # stale_generation: the refused generation
    current: int | None = None  # stale_generation: the job's current generation


ServerMessage = ServerHello | AuthOk | Ok | Value | Int | Swapped | Flag | Count | Items | Error

_encoder = msgspec.msgpack.Encoder()


_encode = _encoder.encode
_pack_header = _HEADER.pack
_unpack_header = _HEADER.unpack_from


def encode_frame(msg: _Msg) -> bytes:
    """One message as one length-prefixed frame (one buffer: the caller writes it once)."""
    body = _encode(msg)
    return _pack_header(len(body)) + body  # measured faster than encode_into for small frames


M = TypeVar("M")


class FrameReader(Generic[M]):
    """Incremental frame parser: ``feed`` received bytes, then drain ``next_message``.

    ``feed`` parses every complete frame of what it is given at once and keeps no reference to
    it (a driver may hand it a view of a receive buffer that it reuses, or that several
    connections share); only the trailing partial frame is copied. ``next_message`` then
    hands the parsed messages out in order.

    Raises ``RemoteProtocolError`` (from ``next_message``, after the messages that preceded the
    bad frame) on an oversized length prefix — detected before any of the body is kept — or on
    a body that is not exactly one message of the expected union. After an error the reader is
    unusable: a framing error leaves the stream position unknowable, so the caller must close
    the connection.
    """

    def __init__(self, message_type: type[M], *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if max_frame < 1 or max_frame > 2**32 - 1:
            raise ValueError(f"max_frame must be in [1, 2**32 - 1], got {max_frame}")
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(message_type)
        self._max = max_frame
        self._buf = bytearray()  # the partial frame that the last feed ended with
        # Parsed, not yet taken: _ready[_taken:]. At most one feed's worth (a driver stops
        # feeding while it stops taking), so this is bounded by the driver's receive size. A
        # list and an index, not a deque: an empty deque allocates a 64-slot block (~0.7 KiB),
        # which a server pays per idle connection.
        self._ready: list[M] = []
        self._taken = 0
        self._error: RemoteProtocolError | None = None  # raised once _ready is drained
        self._broken = False

    @property
    def buffered(self) -> int:
        """Bytes held for a partial frame (bounded by ``max_frame + 4`` plus one feed)."""
        return len(self._buf)

    def discard(self) -> None:
        """Drop the partial frame and the parsed messages; the reader is unusable afterwards
        (a driver that gives up on a connection frees its memory at once, not when the
        connection object is finally collected)."""
        self._buf = bytearray()
        self._ready = []
        self._taken = 0
        self._broken = True

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken or self._error is not None:
            raise RemoteProtocolError("frame reader used after a framing error")
        if not self._buf:
            # The common case: nothing pending, parse straight out of the caller's buffer
            # (through a view, so that a frame's body is sliced without a copy).
            view = data if isinstance(data, memoryview) else memoryview(data)
            size = len(view)
            if size > _HEADER.size:  # fast path: exactly one whole frame (a request, a reply)
                (need,) = _unpack_header(view)
                if need + _HEADER.size == size and need <= self._max:
                    try:
                        self._ready.append(self._decoder.decode(view[_HEADER.size:]))
                        return
                    except (msgspec.ValidationError, msgspec.DecodeError):
                        pass  # the general path below reports it
            used = self._parse(view)
            if used < size:
                self._buf += view[used:]
            return
        self._buf += data
        with memoryview(self._buf) as view:
            used = self._parse(view)
        del self._buf[:used]

    def _parse(self, data: memoryview) -> int:
        """Decode the complete frames at the start of ``data``; bytes consumed."""
        size = len(data)
        pos = 0
        while size - pos >= _HEADER.size:
            (need,) = _HEADER.unpack_from(data, pos)
            if need > self._max:
                self._error = RemoteProtocolError(
                    f"store frame of {need} bytes exceeds the limit of {self._max} bytes")
                return size  # the stream position is lost: keep nothing
            end = pos + _HEADER.size + need
            if end > size:
                break
            try:
                self._ready.append(self._decoder.decode(data[pos + _HEADER.size: end]))
            except msgspec.ValidationError as exc:
                self._error = RemoteProtocolError(f"invalid store message: {exc}")
                return size
            except msgspec.DecodeError as exc:
                self._error = RemoteProtocolError(f"undecodable store frame: {exc}")
                return size
            pos = end
        return pos

    def next_message(self) -> M | None:
        """The next complete message, or ``None`` until more bytes arrive."""
        ready = self._ready
        if ready:
            msg = ready[self._taken]
            self._taken += 1
            if self._taken == len(ready):
                ready.clear()
                self._taken = 0
            return msg
        if self._broken:
            raise RemoteProtocolError("frame reader used after a framing error")
        if self._error is not None:
            self._broken = True
            raise self._error
        return None
