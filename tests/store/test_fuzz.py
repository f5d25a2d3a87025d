"""Hypothesis fuzzing of raw frames against a live server.

The server runs in a background thread (its own event loop) for the whole module; each example
opens a raw socket, optionally authenticates, throws bytes at the server — random garbage,
random length prefixes, valid headers over random bodies, and mutated valid frames — and
closes. After every example the server must still be alive and serve a well-behaved client,
and it must not keep the fuzzing connection (bounded memory: nothing is held for it).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import anyio
import anyio.from_thread
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import TOKEN

from m2n_async import StoreClient, StoreServer
from m2n_async._store import _auth
from m2n_async._store._client import parse_address
from m2n_async._store._wire import (
    STORE_PROTO_VERSION,
    Add,
    Cancel,
    ClientAuth,
    CompareSet,
    Delete,
    DeletePrefix,
    FrameReader,
    Gather,
    Get,
    ServerHello,
    ServerMessage,
    Set,
    Wait,
    encode_frame,
)

MAX_FRAME = 64 * 1024  # small limit so the fuzzer reaches it


class LiveServer:
    def __init__(self, portal: anyio.from_thread.BlockingPortal, server: StoreServer) -> None:
        self.portal = portal
        self.server = server
        host, port = parse_address(server.address)
        self.host, self.port = host, port

    def check_healthy(self) -> None:
        async def probe() -> None:
            with anyio.fail_after(10):
                async with await StoreClient.connect(self.server.address, token=TOKEN) as c:
                    n = await c.add("fuzz/health")
                    await c.set("fuzz/last", b"%d" % n)
                    assert await c.get("fuzz/last") == b"%d" % n

        self.portal.call(probe)

    def connections(self) -> int:
        async def count() -> int:
            return self.server.connections

        return self.portal.call(count)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with anyio.from_thread.start_blocking_portal() as portal:
        server = StoreServer("127.0.0.1", 0, token=TOKEN, max_frame=MAX_FRAME,
                             auth_timeout=2.0)
        with portal.wrap_async_context_manager(server):
            yield LiveServer(portal, server)


def raw_connect(live: LiveServer, authenticate: bool) -> socket.socket:
    sock = socket.create_connection((live.host, live.port), timeout=10)
    reader: FrameReader[ServerMessage] = FrameReader(ServerMessage)  # type: ignore[arg-type]
    hello = None
    while hello is None:
        reader.feed(sock.recv(4096))
        hello = reader.next_message()
    assert isinstance(hello, ServerHello)
    if authenticate:
        nonce = _auth.new_nonce()
        mac = _auth.client_proof(_auth.token_bytes(TOKEN), hello.nonce, nonce)
        sock.sendall(encode_frame(ClientAuth(STORE_PROTO_VERSION, nonce, mac)))
        ok = None
        while ok is None:
            reader.feed(sock.recv(4096))
            ok = reader.next_message()
    return sock


keys = st.text(max_size=12)
values = st.binary(max_size=64)
watch = st.lists(keys, max_size=3).map(tuple)
rids = st.integers(1, 2**63 - 1)
valid_messages = st.one_of(
    st.builds(Set, rids, keys, values, st.booleans()),
    st.builds(Get, rids, keys, st.just(False), watch),
    st.builds(Add, rids, keys, st.integers(-(2**63), 2**63 - 1)),
    st.builds(CompareSet, rids, keys, st.none() | values, values),
    st.builds(Delete, rids, keys),
    st.builds(DeletePrefix, rids, st.text(min_size=1, max_size=8).map(lambda s: "fz/" + s)),
    st.builds(Gather, rids, st.just("fz/none/"), st.just(0), watch),
    st.builds(Wait, rids, st.lists(keys, max_size=0).map(tuple), watch),
    st.builds(Cancel, rids),
)
msgpack_any = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=5),
    max_leaves=12,
)


@st.composite
def hostile_streams(draw: st.DrawFn) -> bytes:
    parts: list[bytes] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["garbage", "prefix", "body", "mutated", "valid"]))
        if kind == "garbage":
            parts.append(draw(st.binary(min_size=1, max_size=256)))
        elif kind == "prefix":
            parts.append(struct.pack(">I", draw(st.integers(0, 2**32 - 1))))
        elif kind == "body":
            body = msgspec.msgpack.encode(draw(msgpack_any))
            parts.append(struct.pack(">I", len(body)) + body)
        elif kind == "mutated":
            frame = bytearray(encode_frame(draw(valid_messages)))
            for _ in range(draw(st.integers(1, 4))):
                i = draw(st.integers(0, len(frame) - 1))
                frame[i] = draw(st.integers(0, 255))
            cut = draw(st.integers(1, len(frame)))
            parts.append(bytes(frame[:cut]))
        else:
            parts.append(encode_frame(draw(valid_messages)))
    return b"".join(parts)


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=hostile_streams(), authenticate=st.booleans())
def test_fuzzed_frames_never_kill_the_server(live: LiveServer, data: bytes,
                                             authenticate: bool) -> None:
    sock = raw_connect(live, authenticate)
    try:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(10)
            while sock.recv(65536):  # the server answers and/or closes; never hangs
                pass
        except OSError:
            pass  # reset by the server mid-send: also a close
    finally:
        sock.close()
    live.check_healthy()
    deadline = time.monotonic() + 10
    while live.connections() > 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert live.connections() == 0, "the server kept a fuzzing connection open"


def test_fuzz_fixture_serves_clients(live: LiveServer) -> None:
    live.check_healthy()
