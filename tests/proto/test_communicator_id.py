"""The ``connected`` phase's unique-id envelope: the id travels with its SHA-256 and the
generation, and every check failure names rank 0 (``_proto.handshake``)."""

from __future__ import annotations

import msgspec
import pytest

from m2n_async._proto.errors import RemoteProtocolError
from m2n_async._proto.handshake import communicator_id, read_communicator_id
from m2n_async._proto.messages import PROTO_VERSION, CommunicatorId

UID = bytes(range(128))


def test_round_trip() -> None:
    assert read_communicator_id(communicator_id(4, UID), 4) == UID


def test_another_generation_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match=r"rank 0's unique id is of protocol "
                                                  rf"{PROTO_VERSION}, generation 3; expected"):
        read_communicator_id(communicator_id(3, UID), 4)


def test_a_damaged_id_fails_its_digest() -> None:
    good = msgspec.msgpack.decode(communicator_id(4, UID), type=CommunicatorId)
    bad = msgspec.msgpack.encode(CommunicatorId(good.proto_version, good.generation,
                                                good.digest, UID[:-1] + b"\xff"))
    with pytest.raises(RemoteProtocolError, match="does not match its SHA-256"):
        read_communicator_id(bad, 4)


@pytest.mark.parametrize("raw", [b"", b"\x01" * 128, msgspec.msgpack.encode({"digest": "x"})])
def test_bytes_that_are_not_the_envelope_name_rank_0(raw: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="rank 0 sent an invalid unique-id envelope"):
        read_communicator_id(raw, 4)
