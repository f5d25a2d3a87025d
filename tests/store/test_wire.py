"""The sans-IO frame reader: what the drivers rely on when they feed it views of a reused
receive buffer (``BufferedProtocol``)."""

from __future__ import annotations

import pytest

from m2n_async import RemoteProtocolError
from m2n_async._store._wire import (
    Add,
    ClientMessage,
    FrameReader,
    Get,
    Set,
    encode_frame,
)


def reader(max_frame: int = 1 << 20) -> FrameReader[ClientMessage]:
    return FrameReader(ClientMessage, max_frame=max_frame)  # type: ignore[arg-type]


def drain(r: FrameReader[ClientMessage]) -> list[ClientMessage]:
    out = []
    while (msg := r.next_message()) is not None:
        out.append(msg)
    return out


MSGS: list[ClientMessage] = [Get(1, "a"), Set(2, "b", b"x" * 300, True, False),
                             Add(3, "c", -5), Get(4, "d", True, ("w",))]
STREAM = b"".join(encode_frame(m) for m in MSGS)


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 7, 64, len(STREAM)])
def test_any_split_of_the_stream_gives_the_same_messages(chunk: int) -> None:
    r = reader()
    got = []
    for i in range(0, len(STREAM), chunk):
        r.feed(STREAM[i: i + chunk])
        got += drain(r)
    assert got == MSGS
    assert r.buffered == 0


def test_keeps_no_reference_to_the_fed_buffer() -> None:
    """The driver reuses its receive buffer for the next read: whatever the reader keeps (a
    partial frame) must be its own copy."""
    buf = bytearray(1024)
    view = memoryview(buf)
    r = reader()
    cut = len(encode_frame(MSGS[0])) + 10  # one whole frame and the start of the next
    buf[:cut] = STREAM[:cut]
    r.feed(view[:cut])
    buf[:] = b"\xff" * len(buf)  # the next read overwrites the buffer
    rest = STREAM[cut:]
    buf[: len(rest)] = rest
    r.feed(view[: len(rest)])
    assert drain(r) == MSGS


def test_messages_before_a_bad_frame_are_delivered_then_the_error() -> None:
    r = reader()
    r.feed(encode_frame(MSGS[0]) + b"\x00\x00\x00\x02\xc1\xc1" + encode_frame(MSGS[1]))
    assert r.next_message() == MSGS[0]
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        r.next_message()
    with pytest.raises(RemoteProtocolError, match="after a framing error"):
        r.next_message()
    with pytest.raises(RemoteProtocolError, match="after a framing error"):
        r.feed(encode_frame(MSGS[2]))


def test_oversized_prefix_is_refused_from_its_four_bytes_alone() -> None:
    r = reader(max_frame=100)
    r.feed((101).to_bytes(4, "big"))  # no body byte sent yet
    with pytest.raises(RemoteProtocolError, match="101 bytes exceeds the limit of 100"):
        r.next_message()
    assert r.buffered == 0


def test_a_wrong_single_frame_is_reported_not_skipped() -> None:
    """The one-whole-frame fast path must fall back to reporting a frame it cannot decode."""
    r = reader()
    r.feed(encode_frame(MSGS[0])[:4] + b"\x93" + b"\x00" * (len(encode_frame(MSGS[0])) - 5))
    with pytest.raises(RemoteProtocolError):
        r.next_message()


def test_partial_frame_is_buffered_up_to_its_length() -> None:
    r = reader()
    frame = encode_frame(Set(9, "big", b"v" * 5000))
    r.feed(frame[:3000])
    assert r.next_message() is None and r.buffered == 3000
    r.feed(frame[3000:])
    assert drain(r) == [Set(9, "big", b"v" * 5000)] and r.buffered == 0
