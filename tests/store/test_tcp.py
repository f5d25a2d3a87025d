"""TCP-specific behaviour: authentication, binding, framing limits, bad input, cancellation."""

from __future__ import annotations

import functools
import socket
import struct
import time

import anyio
import anyio.abc
import msgspec
import pytest
from store_helpers import TOKEN, RunningServer, errors_while
from store_helpers import healthy as _healthy

from m2n_async import (
    AuthenticationError,
    RemoteProtocolError,
    StoreClient,
    StoreError,
    StoreServer,
)
from m2n_async._store import _auth
from m2n_async._store._client import parse_address
from m2n_async._store._wire import (
    STORE_PROTO_VERSION,
    AuthOk,
    ClientAuth,
    ClientMessage,
    Error,
    FrameReader,
    Get,
    Ok,
    ServerHello,
    ServerMessage,
    Set,
    Value,
    encode_frame,
)

pytestmark = pytest.mark.asyncio
DEADLINE = 10.0


async def healthy(server: StoreServer) -> None:
    await _healthy(server, DEADLINE)


class RawPeer:
    """A hand-driven client socket speaking raw frames (for bad input and exact sequences)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.reader: FrameReader[ServerMessage] = FrameReader(ServerMessage)  # type: ignore[arg-type]

    @classmethod
    async def connect(cls, server: StoreServer, *, authenticate: bool) -> RawPeer:
        host, port = parse_address(server.address)
        peer = cls(await anyio.connect_tcp(host, port))
        hello = await peer.read()
        assert isinstance(hello, ServerHello)
        if authenticate:
            nonce = _auth.new_nonce()
            mac = _auth.client_proof(_auth.token_bytes(TOKEN), hello.nonce, nonce)
            await peer.stream.send(encode_frame(ClientAuth(STORE_PROTO_VERSION, nonce, mac)))
            assert isinstance(await peer.read(), AuthOk)
        return peer

    async def read(self) -> ServerMessage | None:
        """Next message, or None once the server closed the connection."""
        with anyio.fail_after(DEADLINE):
            while True:
                msg = self.reader.next_message()
                if msg is not None:
                    return msg
                try:
                    data = await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                    return None
                self.reader.feed(data)

    async def read_until_closed(self) -> list[ServerMessage]:
        out: list[ServerMessage] = []
        while (msg := await self.read()) is not None:
            out.append(msg)
        return out


# --- authentication and binding --------------------------------------------------------------


@pytest.mark.parametrize("token", ["wrong", "", None, b"test-token-"])
async def test_wrong_or_missing_token(server: StoreServer, token: str | bytes | None) -> None:
    with anyio.fail_after(DEADLINE), pytest.raises(AuthenticationError, match="wrong token"):
        await StoreClient.connect(server.address, token=token)
    await healthy(server)


async def test_token_may_be_bytes(server: StoreServer) -> None:
    async with await StoreClient.connect(server.address, token=TOKEN.encode()) as c:
        assert await c.add("n") == 1


async def test_client_refuses_server_without_the_token() -> None:
    """An impostor that cannot compute the server proof is refused by the client."""

    async def impostor(stream: anyio.abc.SocketStream) -> None:
        reader: FrameReader[ClientMessage] = FrameReader(ClientMessage)  # type: ignore[arg-type]
        await stream.send(encode_frame(ServerHello(STORE_PROTO_VERSION, b"n" * 32)))
        while reader.next_message() is None:
            reader.feed(await stream.receive())
        await stream.send(encode_frame(AuthOk(b"\x00" * 32, 1)))  # a made-up proof
        await anyio.sleep(1)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, impostor)
            with anyio.fail_after(DEADLINE), pytest.raises(AuthenticationError,
                                                            match="failed to prove"):
                await StoreClient.connect(("127.0.0.1", port), token=TOKEN)
            tg.cancel_scope.cancel()


async def test_binds_exactly_the_given_address(server: StoreServer) -> None:
    host, port = parse_address(server.address)
    assert host == "127.0.0.1"
    # 127.0.0.2 is loopback too on Linux: a wildcard bind would accept it (TCPStore's bug).
    probe = socket.socket()
    try:
        probe.settimeout(2)
        assert probe.connect_ex(("127.0.0.2", port)) != 0
    finally:
        probe.close()


async def test_server_address_and_constructor_checks() -> None:
    with pytest.raises(ValueError, match="token"):
        StoreServer(token="")
    with pytest.raises(ValueError, match="host"):
        StoreServer("", token="t")
    with pytest.raises(ValueError, match="port"):
        StoreServer(port=70000, token="t")
    server = StoreServer(token="t")
    with pytest.raises(StoreError, match="address"):
        _ = server.address
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address(("h", 5)) == ("h", 5)
    with pytest.raises(ValueError):
        parse_address("nope")


async def test_connect_refused_is_a_store_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with anyio.fail_after(DEADLINE), pytest.raises(StoreError, match="cannot connect"):
        await StoreClient.connect(("127.0.0.1", port), token=TOKEN)


async def test_silent_client_is_dropped_after_auth_deadline() -> None:
    runner = RunningServer(auth_timeout=0.3)
    server = await runner.start()
    try:
        peer = await RawPeer.connect(server, authenticate=False)
        t0 = time.monotonic()
        msgs = await peer.read_until_closed()
        assert time.monotonic() - t0 < 5
        assert [type(m) for m in msgs] == [Error]
        assert isinstance(msgs[0], Error) and msgs[0].kind == "auth"
        with anyio.fail_after(DEADLINE):
            while server.connections:  # noqa: ASYNC110 - server-owned counter
                await anyio.sleep(0.01)
        await healthy(server)
    finally:
        await runner.stop()


async def test_connections_read_into_one_shared_buffer(server: StoreServer) -> None:
    """No connection owns a receive buffer (an idle one would hold 64 KiB for nothing): all
    read into the server's one buffer, the unauthenticated into 1 KiB of it; a large frame
    still arrives through it in many reads, while other connections read into it too."""
    waiting = [await RawPeer.connect(server, authenticate=False) for _ in range(3)]
    authed = await RawPeer.connect(server, authenticate=True)
    views = [p.get_buffer(-1) for p in server._protocols]
    assert sorted(v.nbytes for v in views) == [1024, 1024, 1024, 64 * 1024]
    assert all(v.obj is views[0].obj for v in views)
    for peer in waiting:  # interleave their reads with the big frame's
        await peer.stream.send(b"\x00\x00")
    big = b"b" * 300_000  # many reads on either side
    await authed.stream.send(encode_frame(Set(1, "big", big)))
    assert isinstance(await authed.read(), Ok)
    await authed.stream.send(encode_frame(Get(2, "big")))
    reply = await authed.read()
    assert isinstance(reply, Value) and reply.value == big
    for peer in [*waiting, authed]:
        await peer.stream.aclose()
    await healthy(server)


async def test_large_frames_of_many_connections_at_once_arrive_intact(
        server: StoreServer) -> None:
    """Sixteen clients write and read back distinct 200 KB values at the same time: their
    reads interleave in the one shared receive buffer, and no byte crosses over."""
    clients = [await StoreClient.connect(server.address, token=TOKEN) for _ in range(16)]

    async def one(i: int, c: StoreClient) -> None:
        value = bytes([i]) * 100_000 + bytes(range(256)) * 390 + bytes([255 - i]) * 160
        for round_ in range(3):
            await c.set(f"big/{i}/{round_}", value)
        for round_ in range(3):
            assert await c.get(f"big/{i}/{round_}") == value

    with anyio.fail_after(DEADLINE * 3):
        async with anyio.create_task_group() as tg:
            for i, c in enumerate(clients):
                tg.start_soon(one, i, c)
    for c in clients:
        await c.aclose()
    assert server.partial_bytes == 0


async def test_unauthenticated_frame_cannot_park_memory(server: StoreServer) -> None:
    """A frame announced before authentication may not grow past a few KiB on the server:
    one that tries (here: a 16 MiB length prefix, then its bytes) is refused at once."""
    peer = await RawPeer.connect(server, authenticate=False)
    # 5 KiB in all, so that the server has read everything when it refuses (unread bytes
    # would turn its close into a reset, which can discard the error frame).
    await peer.stream.send(struct.pack(">I", 16 << 20) + b"x" * (5 * 1024 - 4))
    msgs = await peer.read_until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], Error) and msgs[0].kind == "protocol"
    assert "before authenticating" in msgs[0].message
    await healthy(server)


async def test_request_before_authentication_is_refused(server: StoreServer) -> None:
    peer = await RawPeer.connect(server, authenticate=False)
    await peer.stream.send(encode_frame(Get(1, "k")))
    msgs = await peer.read_until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], Error) and msgs[0].rid == 0
    assert "authentication first" in msgs[0].message
    await healthy(server)


# --- framing limits and bad input ------------------------------------------------------------


async def test_oversized_length_prefix_closes_without_reading_body(server: StoreServer) -> None:
    peer = await RawPeer.connect(server, authenticate=True)
    await peer.stream.send(struct.pack(">I", 16 * 1024 * 1024 + 1))  # header only, no body
    msgs = await peer.read_until_closed()  # returns: the server did not wait for 16 MiB
    assert len(msgs) == 1 and isinstance(msgs[0], Error) and msgs[0].kind == "protocol"
    assert "exceeds the limit" in msgs[0].message
    await healthy(server)


async def test_client_frame_over_small_limit_breaks_only_that_client() -> None:
    runner = RunningServer(max_frame=4096)
    server = await runner.start()
    try:
        big = await StoreClient.connect(server.address, token=TOKEN)
        other = await StoreClient.connect(server.address, token=TOKEN)
        await other.set("alive", b"", ephemeral=True)
        with anyio.fail_after(DEADLINE), pytest.raises(RemoteProtocolError, match="limit"):
            await big.set("big", b"x" * 5000)
        with pytest.raises(StoreError):
            await big.get("anything")  # the connection is gone, and says so
        assert await other.get("alive") == b""
        await healthy(server)
        await big.aclose()
        await other.aclose()
    finally:
        await runner.stop()


async def test_reply_over_limit_fails_that_request_only() -> None:
    runner = RunningServer(max_frame=4096)
    server = await runner.start()
    try:
        async with await StoreClient.connect(server.address, token=TOKEN) as c:
            for i in range(4):
                await c.set(f"p/{i}", b"x" * 1500)
            with anyio.fail_after(DEADLINE), pytest.raises(StoreError, match="frame limit"):
                await c.gather("p/", 4)
            assert await c.get("p/0") == b"x" * 1500  # same connection still in step
    finally:
        await runner.stop()


async def test_client_refuses_reply_over_its_own_limit(server: StoreServer) -> None:
    async with await StoreClient.connect(server.address, token=TOKEN) as writer:
        await writer.set("v", b"y" * 10_000)
    c = await StoreClient.connect(server.address, token=TOKEN, max_frame=1024)
    with anyio.fail_after(DEADLINE), pytest.raises(RemoteProtocolError, match="exceeds"):
        await c.get("v")
    await c.aclose()
    await healthy(server)


@pytest.mark.parametrize("payload", [
    b"\x00\x00\x00\x03abc",                                   # not msgpack of the union
    b"\x00\x00\x00\x01\xc1",                                  # invalid msgpack byte
    encode_frame(Set(1, "k", b"v"))[:-1] + b"\x00\x00\x00\x00",  # truncated, then junk
    b"\x00\x00\x00\x00",                                      # empty body
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",                     # wrong protocol entirely
])
async def test_garbage_after_auth_closes_that_connection(server: StoreServer,
                                                         payload: bytes) -> None:
    bystander = await StoreClient.connect(server.address, token=TOKEN)
    await bystander.set("eph", b"1", ephemeral=True)
    peer = await RawPeer.connect(server, authenticate=True)
    await peer.stream.send(payload)
    if payload[:4] == encode_frame(Set(1, "k", b"v"))[:4]:
        await peer.stream.send_eof()  # truncated frame: the stream ends mid-frame
    msgs = await peer.read_until_closed()
    assert all(isinstance(m, Error) for m in msgs)
    assert await bystander.get("eph") == b"1"
    await bystander.aclose()
    await healthy(server)


@pytest.mark.parametrize("body", [
    msgspec.msgpack.encode(["Set", 0, "k", b"v", False]),      # rid must be >= 1
    msgspec.msgpack.encode(["Set", 1, 5, b"v", False]),        # key of the wrong type
    msgspec.msgpack.encode(["Launch", 1]),                     # unknown tag
    msgspec.msgpack.encode(["Add", 1, "k", 2**64 - 1]),       # delta outside int64
    msgspec.msgpack.encode(["Get", 1, "k", False, [], "extra"]),  # unknown trailing field
])
async def test_invalid_messages_close_with_error_frame(server: StoreServer, body: bytes) -> None:
    peer = await RawPeer.connect(server, authenticate=True)
    await peer.stream.send(struct.pack(">I", len(body)) + body)
    msgs = await peer.read_until_closed()
    assert len(msgs) == 1 and isinstance(msgs[0], Error) and msgs[0].kind == "protocol"
    await healthy(server)


async def test_waiter_limit_per_session() -> None:
    runner = RunningServer(max_waiters_per_session=3)
    server = await runner.start()
    try:
        async with await StoreClient.connect(server.address, token=TOKEN) as c:
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(functools.partial(c.get, f"w/{i}", wait=True))
                await anyio.sleep(0.1)
                with anyio.fail_after(DEADLINE), pytest.raises(StoreError, match="limit"):
                    await c.get("w/3", wait=True)
                tg.cancel_scope.cancel()
            assert await c.add("still-fine") == 1
    finally:
        await runner.stop()


# --- cancellation and correlation ------------------------------------------------------------


async def test_cancelled_request_never_leaves_connection_a_reply_behind() -> None:
    """The redis-py CVE-2023-28858 scenario, scripted exactly.

    Request 1 is cancelled while the server sits on it; the server then answers request 1
    *and* request 2. The client must hand request 2's reply to request 2.
    """
    got_second = anyio.Event()

    async def script(stream: anyio.abc.SocketStream) -> None:
        reader: FrameReader[ClientMessage] = FrameReader(ClientMessage)  # type: ignore[arg-type]

        async def read() -> ClientMessage:
            while (msg := reader.next_message()) is None:
                reader.feed(await stream.receive())
            return msg

        nonce = _auth.new_nonce()
        await stream.send(encode_frame(ServerHello(STORE_PROTO_VERSION, nonce)))
        auth = await read()
        assert isinstance(auth, ClientAuth)
        key = _auth.token_bytes(TOKEN)
        await stream.send(encode_frame(AuthOk(_auth.server_proof(key, nonce, auth.nonce), 7)))
        first = await read()
        assert isinstance(first, Get) and first.key == "slow"
        second = await read()  # arrives after the client gave up on the first
        assert isinstance(second, Get) and second.key == "fast"
        got_second.set()
        await stream.send(encode_frame(Value(first.rid, b"reply-to-slow")))
        await stream.send(encode_frame(Value(second.rid, b"reply-to-fast")))
        await anyio.sleep(5)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, script)
            client = await StoreClient.connect(("127.0.0.1", port), token=TOKEN)
            with anyio.move_on_after(0.2) as scope:
                await client.get("slow")
            assert scope.cancelled_caught
            with anyio.fail_after(DEADLINE):
                assert await client.get("fast") == b"reply-to-fast"
            assert got_second.is_set()
            await client.aclose()
            tg.cancel_scope.cancel()


async def test_random_cancellations_keep_replies_matched(server: StoreServer) -> None:
    """Many tasks share one client; a third of the calls are cancelled at random points."""
    import random

    rng = random.Random(1234)
    c = await StoreClient.connect(server.address, token=TOKEN)
    setter = await StoreClient.connect(server.address, token=TOKEN)
    for i in range(200):
        await setter.set(f"v/{i}", str(i).encode())
    mismatches: list[tuple[int, bytes | None]] = []

    async def worker(w: int) -> None:
        for j in range(60):
            i = rng.randrange(400)  # half of the keys exist, half are waited for
            wait = i >= 200
            with anyio.move_on_after(rng.choice([0, 0.0002, 0.0005, 0.002, 0.05]) if wait else 5):
                value = await c.get(f"v/{i}", wait=wait)
                if value is not None and value != str(i).encode():
                    mismatches.append((i, value))
            if j % 10 == 0:
                await setter.set(f"v/{200 + rng.randrange(200)}", b"late")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for w in range(20):
                tg.start_soon(worker, w)
    assert [m for m in mismatches if m[1] != b"late"] == []
    with anyio.fail_after(DEADLINE):
        while server.core.pending_waiters:  # noqa: ASYNC110 - every cancel reaches the server
            await anyio.sleep(0.01)
    assert await c.get("v/3") == b"3"
    await c.aclose()
    await setter.aclose()


async def test_server_shutdown_fails_waiters_instead_of_hanging() -> None:
    runner = RunningServer()
    server = await runner.start()
    c = await StoreClient.connect(server.address, token=TOKEN)
    errors = await errors_while(lambda: c.get("never", wait=True), runner.stop, StoreError,
                                pause=0.1, deadline=DEADLINE)
    assert len(errors) == 1 and "closed the connection" in str(errors[0])
    with pytest.raises(StoreError):
        await c.set("k", b"v")
    await c.aclose()


async def test_client_concurrent_set_while_gather_blocks(server: StoreServer) -> None:
    c = await StoreClient.connect(server.address, token=TOKEN)
    out: list[dict[str, bytes]] = []

    async def gatherer() -> None:
        out.append(await c.gather("cc/", 3))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(gatherer)
            for i in range(3):
                await anyio.sleep(0.01)
                await c.set(f"cc/{i}", b"%d" % i)  # same client, while its gather waits
    assert out == [{"cc/0": b"0", "cc/1": b"1", "cc/2": b"2"}]
    await c.aclose()


async def test_client_that_never_reads_is_throttled_not_buffered(server: StoreServer) -> None:
    """Requests for a 1 MiB value, never reading replies: the server stops executing them
    once its write buffer is full, instead of queueing 200 MiB of replies."""
    async with await StoreClient.connect(server.address, token=TOKEN) as c:
        await c.set("big", b"b" * (1 << 20))
    peer = await RawPeer.connect(server, authenticate=True)
    frames = b"".join(encode_frame(Get(i + 1, "big")) for i in range(200))
    with anyio.move_on_after(2):
        await peer.stream.send(frames)  # may block: the server stopped reading us
    await anyio.sleep(0.3)
    (proto,) = [p for p in server._protocols if p._session is not None]
    assert proto._transport is not None
    assert proto._transport.get_write_buffer_size() < 8 * (1 << 20)
    await healthy(server)
    await peer.stream.aclose()


async def test_both_ends_probe_idle_connections(server: StoreServer) -> None:
    """Keepalive on both ends: a host that dies silently (no FIN, no RST) must end its
    session (and its ephemeral keys), and a dead store host must fail a client's waits."""
    client = await StoreClient.connect(server.address, token=TOKEN)
    try:
        (proto,) = server._protocols
        assert proto._transport is not None
        ends = {"server": proto._transport.get_extra_info("socket"),
                "client": client._transport.get_extra_info("socket")}
        for end, sock in ends.items():
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1, end
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, end
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10, end
    finally:
        await client.aclose()
