"""Store wire format: frames, messages and a sans-IO frame reader.

Theory of operation: a frame is a big-endian u32 length followed by that many bytes of
msgpack holding exactly one message of a msgspec tagged union. The length is checked against
the limit as soon as its four bytes have arrived, *before* any of the body is buffered, so a
hostile prefix cannot make us allocate. ``FrameReader`` is pure (bytes in, messages out; no
sockets, no clocks) so that the server, the client and the fuzz tests share one parser.

Every request carries a request id (``rid``, a positive int chosen by the client); every reply
echoes it. The client correlates replies by id, which is what makes cancelling a request safe:
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

STORE_PROTO_VERSION: Final[int] = 1
DEFAULT_MAX_FRAME: Final[int] = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")

# Request ids: positive and within int64 so msgpack keeps them compact and exact.
Rid = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


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
    rid: Rid
    key: str
    value: bytes
    ephemeral: bool = False


class Get(_Msg, frozen=True):
    rid: Rid
    key: str
    wait: bool = False
    watch: tuple[str, ...] = ()


class Wait(_Msg, frozen=True):
    rid: Rid
    keys: tuple[str, ...]
    watch: tuple[str, ...] = ()


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


class DeletePrefix(_Msg, frozen=True):
    rid: Rid
    prefix: str


class Gather(_Msg, frozen=True):
    rid: Rid
    prefix: str
    n: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    watch: tuple[str, ...] = ()


class Exchange(_Msg, frozen=True):
    """Delete ``delete``, set ``key``, then gather ``prefix`` — one atomic round trip."""

    rid: Rid
    key: str
    value: bytes
    delete: str | None
    prefix: str
    n: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    watch: tuple[str, ...] = ()


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
    key: str | None = None  # peer_lost: the lost key; stale_generation: the job
    generation: int | None = None  # stale_generation: the refused generation
    current: int | None = None  # stale_generation: the job's current generation


ServerMessage = ServerHello | AuthOk | Ok | Value | Int | Swapped | Flag | Count | Items | Error

_encoder = msgspec.msgpack.Encoder()


def encode_frame(msg: _Msg) -> bytes:
    """One message as one length-prefixed frame."""
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


M = TypeVar("M")


class FrameReader(Generic[M]):
    """Incremental frame parser: ``feed`` received bytes, then drain ``next_message``.

    Raises ``RemoteProtocolError`` on an oversized length prefix (before buffering the body)
    or on a body that is not exactly one message of the expected union. After an error the
    reader is unusable: a framing error leaves the stream position unknowable, so the caller
    must close the connection.
    """

    def __init__(self, message_type: type[M], *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if max_frame < 1 or max_frame > 2**32 - 1:
            raise ValueError(f"max_frame must be in [1, 2**32 - 1], got {max_frame}")
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(message_type)
        self._max = max_frame
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame being read, once known
        self._broken = False

    @property
    def buffered(self) -> int:
        """Bytes held for a partial frame (bounded by ``max_frame + 4`` plus one feed)."""
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        if self._broken:
            raise RemoteProtocolError("frame reader used after a framing error")
        self._buf += data

    def next_message(self) -> M | None:
        """The next complete message, or ``None`` until more bytes arrive."""
        if self._broken:
            raise RemoteProtocolError("frame reader used after a framing error")
        if self._need is None:
            if len(self._buf) < _HEADER.size:
                return None
            (need,) = _HEADER.unpack_from(self._buf)
            if need > self._max:
                self._broken = True
                raise RemoteProtocolError(
                    f"store frame of {need} bytes exceeds the limit of {self._max} bytes")
            self._need = need
            del self._buf[: _HEADER.size]
        if len(self._buf) < self._need:
            return None
        body = bytes(self._buf[: self._need])
        del self._buf[: self._need]
        self._need = None
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            self._broken = True
            raise RemoteProtocolError(f"invalid store message: {exc}") from None
        except msgspec.DecodeError as exc:
            self._broken = True
            raise RemoteProtocolError(f"undecodable store frame: {exc}") from None
