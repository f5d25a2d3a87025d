"""Hostile and careless clients: each hole the store's limits close, under a bounded load.

Every test drives one misbehaving client against a live loopback server (or the core, for the
semantics ``MemoryStore`` shares) and asserts what the limits promise: the offender is refused
or dropped with the documented ``limit`` (or ``auth``) error, and a well-behaved client is
served meanwhile. Nothing here asserts a timing.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable

import anyio
import pytest
from store_helpers import TOKEN, RunningServer, World
from store_helpers import healthy as _healthy

from m2n_async import StoreClient, StoreServer, current_generation, next_generation
from m2n_async._proto.errors import AuthenticationError, StoreError
from m2n_async._store import _auth
from m2n_async._store._claims import claim_rank
from m2n_async._store._client import parse_address
from m2n_async._store._core import StoreLimitError
from m2n_async._store._server import _ServerProtocol
from m2n_async._store._wire import (
    STORE_PROTO_VERSION,
    AuthOk,
    ClientAuth,
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
from m2n_async.testing import MemoryStore

pytestmark = pytest.mark.asyncio
DEADLINE = 20.0


async def healthy(server: StoreServer) -> None:
    await _healthy(server, DEADLINE)


class Raw:
    """A hand-driven connection; ``rcvbuf`` shrinks its socket's receive buffer so that a
    client which stops reading backs up into the server quickly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames: FrameReader[ServerMessage] = FrameReader(
            ServerMessage, max_frame=2**31)  # type: ignore[arg-type]

    @classmethod
    async def open(cls, server: StoreServer, *, authenticate: bool, rcvbuf: int | None = None,
                   token: str = TOKEN) -> Raw:
        host, port = parse_address(server.address)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        raw = cls(reader, writer)
        if authenticate:
            hello = await raw.read()
            assert isinstance(hello, ServerHello)
            nonce = _auth.new_nonce()
            mac = _auth.client_proof(_auth.token_bytes(token), hello.nonce, nonce)
            raw.send(ClientAuth(STORE_PROTO_VERSION, nonce, mac))
            assert isinstance(await raw.read(), AuthOk)
        return raw

    def send(self, msg: object) -> None:
        self.writer.write(encode_frame(msg))  # type: ignore[arg-type]

    async def read(self) -> ServerMessage | None:
        """The next message, or None once the server closed the connection."""
        with anyio.fail_after(DEADLINE):
            while (msg := self.frames.next_message()) is None:
                data = await self.reader.read(1 << 20)
                if not data:
                    return None
                self.frames.feed(data)
            return msg

    async def last(self) -> ServerMessage | None:
        """Read to the end of the stream; the last message (the connection's error)."""
        last: ServerMessage | None = None
        while (msg := await self.read()) is not None:
            last = msg
        return last

    def close(self) -> None:
        self.writer.close()


def assert_limit(msg: ServerMessage | None, limit: str) -> None:
    assert isinstance(msg, Error) and msg.rid == 0, msg
    assert (msg.kind, msg.key) == ("limit", limit), msg
    assert limit in msg.message


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll a server counter (they have no event to await) until ``condition`` holds."""
    with anyio.fail_after(DEADLINE):
        while True:
            if condition():
                return
            await anyio.sleep(0.01)


# --- memory per connection -----------------------------------------------------------------


async def test_waiter_completions_to_a_client_that_does_not_read_are_bounded() -> None:
    # 300 parked gets of a 60 KiB value: 18 MB of completions against a 1 MiB output budget
    # (plus what the kernel's socket buffers take). The connection is dropped, not grown.
    runner = RunningServer(max_frame=64 * 1024)
    server = await runner.start()
    try:
        hostile = await Raw.open(server, authenticate=True, rcvbuf=4096)
        for rid in range(1, 301):
            hostile.send(Get(rid, "big", wait=True))
        await hostile.writer.drain()
        await until(lambda: server.core.pending_waiters == 300, "the gets are parked")
        with anyio.fail_after(DEADLINE):
            async with await StoreClient.connect(server.address, token=TOKEN) as writer:
                await writer.set("big", b"x" * 60_000)  # acknowledged: the writer is served
                await until(lambda: server.connections == 1, "the hostile client is dropped")
                assert await writer.get("big") == b"x" * 60_000
        # Its error frame queued behind replies it never read, so the close grace ran out and
        # the connection was aborted: it sees the stream end short of its 300 replies.
        replies = []
        while (msg := await hostile.read()) is not None:
            replies.append(msg)
        assert len(replies) < 300
        if isinstance(replies[-1], Error):
            assert_limit(replies[-1], "max_output")
        await healthy(server)
    finally:
        await runner.stop()


@pytest.mark.parametrize("kind", ["memory", "tcp"])
async def test_gather_past_the_reply_limit_is_refused_before_it_is_built(kind: str) -> None:
    runner = RunningServer(max_frame=64 * 1024)
    memory = MemoryStore(max_reply=64 * 1024)
    store = memory
    if kind == "tcp":
        server = await runner.start()
        store = await StoreClient.connect(server.address, token=TOKEN)  # type: ignore[assignment]
    try:
        for i in range(6):
            await store.set(f"big/{i}", b"v" * 10_000)
        assert len(await store.gather("big/", 6)) == 6  # 60 KB: fits a 64 KiB reply
        await store.set("big/6", b"v" * 10_000)
        with pytest.raises(StoreLimitError, match="max_reply") as info:
            await store.gather("big/", 0)
        assert info.value.limit == "max_reply" and "'big/'" in str(info.value)
        await store.delete("big/6")
        other = memory.session() if kind == "memory" else await StoreClient.connect(
            server.address, token=TOKEN)
        # A waiting gather that the next key pushes past the limit fails the same way.
        caught: list[BaseException] = []

        async def gather() -> None:
            try:
                await other.gather("big/", 7)
            except StoreLimitError as exc:
                caught.append(exc)

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(gather)
                await anyio.sleep(0.05)
                await store.set("big/6", b"v" * 10_000)
        assert len(caught) == 1
        # Fewer keys fit, and the store (and both sessions) keep serving.
        assert await store.delete_prefix("big/") == 7
        await store.set("big/0", b"v")
        assert await store.gather("big/", 1) == {"big/0": b"v"}
        await other.aclose()
    finally:
        await store.aclose()
        if kind == "tcp":
            await runner.stop()


# The store-wide budget of queued replies: 200 KB values, each connection may hold 4 MiB and
# all together 4 MiB. The kernel takes a few MB per connection before the server's own buffer
# holds anything (loopback send buffers autotune), so the tests feed replies one key at a time
# until the server's count says what they need; the cap bounds the load however large that is.
VALUE = b"v" * 200_000
OUTPUT_LIMITS = {"max_frame": 256 * 1024, "max_output": 4 << 20, "max_output_bytes": 4 << 20}
MAX_KEYS = 100  # replies parked per connection: 20 MB, whatever the kernel absorbs


async def park(server: StoreServer, prefix: str) -> Raw:
    """A connection that parks one ``get(wait=True)`` per key ``prefix/0..MAX_KEYS-1`` and
    never reads (until the test makes it)."""
    before = server.core.pending_waiters
    raw = await Raw.open(server, authenticate=True, rcvbuf=4096)
    for i in range(MAX_KEYS):
        raw.send(Get(i + 1, f"{prefix}/{i}", wait=True))
    await raw.writer.drain()
    await until(lambda: server.core.pending_waiters == before + MAX_KEYS, "the gets are parked")
    return raw


def protocol_of(server: StoreServer, raw: Raw) -> _ServerProtocol:
    port = raw.writer.get_extra_info("sockname")[1]
    [proto] = [p for p in server._protocols
               if p._transport is not None and p._transport.get_extra_info("peername")[1] == port]
    return proto


async def feed(writer: StoreClient, prefix: str, start: int,
               done: Callable[[], bool]) -> int:
    """Complete the parked gets ``prefix/start, ...`` one per acknowledged ``set`` until
    ``done()``; the next index. (A set's completions are written before its ack.)"""
    for i in range(start, MAX_KEYS):
        if done():
            return i
        await writer.set(f"{prefix}/{i}", VALUE)
    assert done(), f"{MAX_KEYS} replies of {len(VALUE)} bytes did not get there"
    return MAX_KEYS


async def read_replies(raw: Raw, count: int) -> None:
    for _ in range(count):
        assert isinstance(await raw.read(), Value)


async def test_unread_replies_past_the_store_wide_budget_drop_the_connection_holding_most(
        caplog: pytest.LogCaptureFixture) -> None:
    # A hoarder is fed until it holds 3 MiB of unread replies; then a second client that does
    # not read is fed until one of its replies passes the 4 MiB budget. The hoarder (3 MiB)
    # is dropped, not the connection whose reply passed it (1 MiB, give or take a reply).
    budget = OUTPUT_LIMITS["max_output_bytes"]
    runner = RunningServer(**OUTPUT_LIMITS)
    server = await runner.start()
    try:
        hoarder, tipper = await park(server, "hoard"), await park(server, "tip")
        hoarding, tipping = protocol_of(server, hoarder), protocol_of(server, tipper)
        with anyio.fail_after(DEADLINE):
            async with await StoreClient.connect(server.address, token=TOKEN) as writer:
                fed = await feed(writer, "hoard", 0, lambda: server.output_bytes >= 3 << 20)
                assert not hoarding._closing and server.output_bytes <= budget
                tipped = await feed(writer, "tip", 0, lambda: hoarding._closing)
                assert not tipping._closing, "the connection whose reply passed it is kept"
                assert 0 < tipping._queued < hoarding._queued
                assert await writer.get("hoard/0") == VALUE  # a reader is served meanwhile
                await healthy(server)
        # The hoarder's error frame is queued behind what it held; reading, it gets it.
        await read_replies(hoarder, fed)
        assert_limit(await hoarder.last(), "max_output_bytes")
        # The other one was only behind: it reads its replies and is served on.
        await read_replies(tipper, tipped)
        tipper.send(Get(MAX_KEYS + 1, "hoard/0", wait=False))
        assert await tipper.read() == Value(MAX_KEYS + 1, VALUE)
        drops = [r for r in caplog.records if "max_output_bytes" in r.getMessage()]
        assert len(drops) == 1, drops
        await until(lambda: server.output_bytes == 0, "nothing queued: the count is back at 0")
        tipper.close()
    finally:
        await runner.stop()


async def test_unread_error_replies_count_toward_the_store_wide_budget() -> None:
    # Two connections that never read park waiters watching long keys; the keys are then
    # lost, so every waiter fails with a peer_lost error naming its key (~40 KB a frame).
    # Those replies count like any other: past the budget the connection holding the most
    # is dropped, and the store-wide count never stays above the budget.
    budget = OUTPUT_LIMITS["max_output_bytes"]
    long_key = "w/" + "x" * 40_000  # named whole in the key field, cut short in the message
    groups, per_group = 40, 8
    runner = RunningServer(**OUTPUT_LIMITS)
    server = await runner.start()
    # More waiters a session than max_reply (256 KiB here) lets it index: room for enough
    # unread errors to fill the kernel's buffers and pass the budget with two connections.
    server.core._max_reply = 64 << 20
    try:
        with anyio.fail_after(DEADLINE):
            async with await StoreClient.connect(server.address, token=TOKEN) as writer:
                for g in range(groups):
                    await writer.set(f"{long_key}{g}", b"1")
                raws = [await Raw.open(server, authenticate=True, rcvbuf=4096)
                        for _ in range(2)]
                rid = 0
                for g in range(groups):  # even groups watched by one, odd by the other
                    for _ in range(per_group):
                        rid += 1
                        raws[g % 2].send(Get(rid, f"never/{rid}", True, (f"{long_key}{g}",)))
                for raw in raws:
                    await raw.writer.drain()
                await until(lambda: server.core.pending_waiters == groups * per_group,
                            "the waiters are parked")
                protos = [protocol_of(server, raw) for raw in raws]
                # The documented bound: the budget plus the one reply being written when it
                # passes it (an error frame quoting a 40 KB key) and, for each connection
                # below its high-water mark (64 KiB), what it holds uncounted.
                bound = budget + 2 * (64 << 10) + 4 * len(long_key) + 1024
                for g in range(groups):
                    await writer.delete(f"{long_key}{g}", lost=True)
                    assert server.output_bytes <= bound, (g, server.output_bytes)
                    if any(p._closing for p in protos):
                        break
                assert [p._closing for p in protos].count(True) == 1, "one dropped"
                assert server.output_bytes <= bound
                await healthy(server)
        for raw in raws:
            raw.close()
        await until(lambda: server.output_bytes == 0, "all gone")
    finally:
        await runner.stop()


async def test_the_queued_output_count_returns_to_zero_however_connections_end() -> None:
    budget = OUTPUT_LIMITS["max_output_bytes"]
    runner = RunningServer(**OUTPUT_LIMITS)
    server = await runner.start()
    try:
        drainer, closer = await park(server, "drain"), await park(server, "close")
        draining, closing = protocol_of(server, drainer), protocol_of(server, closer)
        with anyio.fail_after(DEADLINE):
            async with await StoreClient.connect(server.address, token=TOKEN) as writer:
                fed = await feed(writer, "drain", 0, lambda: draining._queued > 0)
                await feed(writer, "close", 0, lambda: closing._queued > 0)
                assert server.output_bytes == draining._queued + closing._queued
                # A client that catches up is no longer counted ...
                await read_replies(drainer, fed)
                await until(lambda: server.output_bytes == closing._queued, "drained")
                # ... nor one that closes without reading.
                closer.close()
                await until(lambda: server.output_bytes == 0, "closed")
                # A dropped connection's bytes count until the room is needed again: then
                # its grace ends and they are freed at once.
                hoarder, tipper = await park(server, "hoard"), await park(server, "tip")
                hoarding, tipping = protocol_of(server, hoarder), protocol_of(server, tipper)
                await feed(writer, "hoard", 0, lambda: server.output_bytes >= 3 << 20)
                tipped = await feed(writer, "tip", 0, lambda: hoarding._closing)
                assert hoarding._queued > 0  # dropped, its error frame queued, still held
                await feed(writer, "tip", tipped, lambda: hoarding._queued == 0)
                assert not tipping._closing and server.output_bytes == tipping._queued
                assert server.output_bytes <= budget
                assert hoarding not in server._output_holders
                tipper.close()
                await until(lambda: server.output_bytes == 0, "all gone")
                assert server._output_holders == {}
                await healthy(server)
        for raw in (drainer, hoarder):
            raw.close()
    finally:
        await runner.stop()
    assert server.output_bytes == 0


async def test_the_queued_output_budget_must_hold_one_connections_max_output() -> None:
    with pytest.raises(ValueError, match="max_output_bytes must be >= max_output"):
        StoreServer(token="t", max_frame=1 << 20, max_output=8 << 20,
                    max_output_bytes=(8 << 20) - 1)
    assert StoreServer(token="t", max_frame=1 << 20, max_output=8 << 20,
                       max_output_bytes=8 << 20)._max_output_bytes == 8 << 20
    assert StoreServer(token="t")._max_output_bytes == 256 << 20
    assert StoreServer(token="t", max_frame=1 << 28)._max_output_bytes == 4 << 28


async def test_a_partial_frame_must_arrive_within_frame_timeout() -> None:
    runner = RunningServer(frame_timeout=0.3)
    server = await runner.start()
    try:
        hostile = await Raw.open(server, authenticate=True)
        hostile.writer.write((100_000).to_bytes(4, "big") + b"\x00" * 50_000)  # half a frame
        assert_limit(await hostile.last(), "frame_timeout")
        await healthy(server)
    finally:
        await runner.stop()


async def test_partial_frames_past_the_store_wide_budget_drop_the_connection_passing_it(
        caplog: pytest.LogCaptureFixture) -> None:
    # Six connections each send all but the last byte of a ~50 KB set. The budget holds three
    # such partial frames and all but one byte of a fourth, so each connection past the
    # third passes it with its last byte read (nothing left unread: its error frame is not
    # lost to a reset) and is dropped; the three within it are served when they finish.
    frames = [encode_frame(Set(1, f"parked/{i}", b"v" * 50_000)) for i in range(6)]
    held = len(frames[0]) - 1
    runner = RunningServer(max_frame=64 * 1024, max_partial_bytes=4 * held - 1)
    server = await runner.start()
    try:
        parkers = [await Raw.open(server, authenticate=True) for _ in frames]
        for i, (raw, frame) in enumerate(zip(parkers, frames, strict=True)):
            raw.writer.write(frame[:-1])
            if i < 3:
                await until(functools.partial(lambda n: server.partial_bytes == n * held, i + 1),
                            "the partial frame is held")
            else:
                assert_limit(await raw.last(), "max_partial_bytes")
                assert server.partial_bytes == 3 * held  # the dropped one's bytes are freed
        await healthy(server)  # requests that arrive whole never count against the budget
        await until(lambda: server.connections == 3, "only the three within it are open")
        for raw, frame in zip(parkers[:3], frames[:3], strict=True):
            raw.writer.write(frame[-1:])
            assert isinstance(await raw.read(), Ok)
        assert server.partial_bytes == 0
        drops = [r for r in caplog.records if "max_partial_bytes" in r.getMessage()]
        assert 1 <= len(drops) <= 3, drops  # logged, but not once per drop
        # With the budget free again, a frame larger than one read gets through.
        with anyio.fail_after(DEADLINE):
            async with await StoreClient.connect(server.address, token=TOKEN) as c:
                await c.set("big", b"x" * 60_000)
                assert await c.get("big") == b"x" * 60_000
        for raw in parkers:
            raw.close()
    finally:
        await runner.stop()


async def test_the_partial_frame_budget_must_hold_one_frame() -> None:
    with pytest.raises(ValueError, match="max_partial_bytes must be >= max_frame"):
        StoreServer(token="t", max_frame=1 << 20, max_partial_bytes=1 << 20)
    assert StoreServer(token="t")._max_partial_bytes == 256 << 20
    assert StoreServer(token="t", max_frame=1 << 28)._max_partial_bytes == 2 << 28


async def test_an_idle_connection_is_dropped_after_idle_timeout_but_a_waiting_one_is_not() -> None:
    runner = RunningServer(idle_timeout=0.3)
    server = await runner.start()
    try:
        idle = await Raw.open(server, authenticate=True)
        async with await StoreClient.connect(server.address, token=TOKEN) as waiting:
            async with anyio.create_task_group() as tg:
                got: list[bytes | None] = []

                async def wait() -> None:
                    got.append(await waiting.get("k", wait=True))

                tg.start_soon(wait)
                assert_limit(await idle.last(), "idle_timeout")  # 0.3 s idle
                await anyio.sleep(0.5)  # the waiting client is past its idle_timeout too
                async with await StoreClient.connect(server.address, token=TOKEN) as writer:
                    await writer.set("k", b"v")
            assert got == [b"v"]
    finally:
        await runner.stop()


# --- connections ---------------------------------------------------------------------------


async def test_connections_waiting_to_authenticate_are_capped_oldest_evicted() -> None:
    runner = RunningServer(max_unauthenticated=4)
    server = await runner.start()
    try:
        silent = [await Raw.open(server, authenticate=False) for _ in range(10)]
        await until(lambda: server.unauthenticated <= 4 and server.connections <= 4,
                    "the oldest are evicted")
        for raw in silent[:6]:  # the first six were evicted, after their challenge
            assert isinstance(await raw.read(), ServerHello)
            assert_limit(await raw.last(), "max_unauthenticated")
        await healthy(server)  # a token holder gets in past a full waiting room
        for raw in silent:
            raw.close()
    finally:
        await runner.stop()


async def test_connections_past_max_connections_are_refused_with_a_limit_error() -> None:
    runner = RunningServer(max_connections=3)
    server = await runner.start()
    try:
        clients = [await StoreClient.connect(server.address, token=TOKEN) for _ in range(3)]
        with anyio.fail_after(DEADLINE), pytest.raises(StoreLimitError) as info:
            await StoreClient.connect(server.address, token=TOKEN)
        assert info.value.limit == "max_connections"
        await clients.pop().aclose()
        await until(lambda: server.connections == 2, "the slot is free")
        await healthy(server)
        for c in clients:
            await c.aclose()
    finally:
        await runner.stop()


async def test_a_wrong_token_is_answered_late_and_holds_a_waiting_slot_meanwhile() -> None:
    runner = RunningServer(auth_fail_delay=30.0)
    server = await runner.start()
    try:
        guess = await Raw.open(server, authenticate=False)
        hello = await guess.read()
        assert isinstance(hello, ServerHello)
        nonce = _auth.new_nonce()
        guess.send(ClientAuth(STORE_PROTO_VERSION, nonce, _auth.client_proof(
            b"wrong", hello.nonce, nonce)))
        await until(lambda: any(p._rejected for p in server._protocols), "the guess is judged")
        assert server.unauthenticated == 1  # the guess still costs its slot
        await healthy(server)  # and a token holder is served meanwhile
        assert server.unauthenticated == 1
    finally:
        await runner.stop()
    fast = RunningServer(auth_fail_delay=0.05)
    server = await fast.start()
    try:
        with anyio.fail_after(DEADLINE), pytest.raises(AuthenticationError, match="wrong token"):
            await StoreClient.connect(server.address, token="wrong")
        await healthy(server)
    finally:
        await fast.stop()


_EXHAUST = textwrap.dedent("""
    import asyncio, logging, resource, socket, sys
    from m2n_async import StoreClient, StoreServer
    logging.basicConfig(level=logging.WARNING)

    async def main():
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))
        async with StoreServer("127.0.0.1", 0, token="t", max_connections=10_000,
                               max_unauthenticated=10_000) as server:
            host, port = server.address.rsplit(":", 1)
            hogs = []
            for _ in range(200):  # more than the process may open: accept fails with EMFILE
                try:
                    s = socket.socket()
                except OSError:
                    break
                s.setblocking(False)
                try:
                    s.connect((host, int(port)))
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    break
                hogs.append(s)
            await asyncio.sleep(1.5)  # the server meets EMFILE, over and over
            for s in hogs:
                s.close()
            async with asyncio.timeout(30):
                async with await StoreClient.connect(server.address, token="t") as c:
                    await c.set("k", b"v")
                    print("SERVED", await c.get("k"), flush=True)

    asyncio.run(main())
""")


async def test_out_of_file_descriptors_backs_off_and_logs_rarely() -> None:
    with anyio.fail_after(90):
        done = await anyio.run_process([sys.executable, "-c", _EXHAUST], check=False)
    out = subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(),
                                      done.stderr.decode())
    assert "SERVED b'v'" in out.stdout, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    trouble = [line for line in out.stderr.splitlines() if "cannot accept" in line]
    assert 1 <= len(trouble) <= 2, out.stderr[-2000:]  # one line per 10 s, not per attempt


async def test_the_listen_backlog_asked_for_is_in_force() -> None:
    runner = RunningServer(backlog=777)
    server = await runner.start()
    try:
        port = parse_address(server.address)[1]
        try:
            with anyio.fail_after(DEADLINE):
                ss = await anyio.run_process(["ss", "-ltnH", f"sport = :{port}"])
        except FileNotFoundError:
            pytest.skip("ss (iproute2) is not installed")
        # For a listening socket ss shows the backlog as Send-Q (the third column).
        assert ss.stdout.decode().split()[2] == "777", ss.stdout
        await healthy(server)
    finally:
        await runner.stop()


# --- protected keys and quotas (both stores) -----------------------------------------------


async def test_job_counters_and_claims_survive_ordinary_key_operations(world: World) -> None:
    s, other = await world.session(), await world.session()
    assert await next_generation(s, "job") == 1
    await s.set("job/1/x", b"state")
    await s.set("job/note", b"free")
    claim = await claim_rank(s, "job", 0, wait_s=1.0)
    assert await s.delete_prefix("job/") == 2  # job/1/x and job/note; not the counters
    assert "job/generation" in world.core.keys() and "job/claims/seq" in world.core.keys()
    assert claim.key in world.core.keys()
    assert await next_generation(s, "job") == 2  # never generation 1 again
    for op in (lambda: s.set("job/generation", b"1"), lambda: s.delete("job/generation"),
               lambda: s.compare_set("job/generation", b"2", b"1"),
               lambda: s.add("job/generation", -1), lambda: s.set("job/claims/seq", b"0")):
        with pytest.raises(StoreError, match="job counter"):
            await op()
    assert await current_generation(s, "job") == 2
    # A claim entry: ephemeral only, and only its holder may rewrite or delete it.
    with pytest.raises(StoreError, match="session"):
        await other.set(claim.key, b"mine now", ephemeral=True)
    with pytest.raises(StoreError, match="session"):
        await other.delete(claim.key)
    with pytest.raises(StoreError, match="ephemeral"):
        await other.set("job/claims/0/999", b"forever")
    await claim.joined(2)
    await claim.release()
    assert claim.key not in world.core.keys()


async def test_a_malformed_generation_counter_is_a_clear_store_error() -> None:
    store = MemoryStore()
    store.core._data["job/generation"] = b"not a number"  # as a foreign writer could leave it
    with pytest.raises(StoreError, match=r"generation counter 'job/generation'.*non-integer"):
        await current_generation(store, "job")
    with pytest.raises(StoreError, match="job counter holds a non-integer"):
        await next_generation(store, "job")


@pytest.mark.parametrize("kind", ["memory", "tcp"])
async def test_byte_quotas_refuse_writes_naming_the_quota(kind: str) -> None:
    limits = {"max_bytes": 110_000, "max_job_bytes": 30_000}
    runner = RunningServer(**limits)
    store = MemoryStore(**limits)  # type: ignore[arg-type]
    if kind == "tcp":
        server = await runner.start()
        store = await StoreClient.connect(server.address, token=TOKEN)  # type: ignore[assignment]
    try:
        await store.set("a/1", b"x" * 25_000)
        with pytest.raises(StoreLimitError, match="max_job_bytes") as info:
            await store.set("a/2", b"x" * 10_000)
        assert info.value.limit == "max_job_bytes" and "'a'" in str(info.value)
        assert await store.get("a/2") is None  # nothing written
        for job in "bcd":
            await store.set(f"{job}/1", b"x" * 25_000)
        with pytest.raises(StoreLimitError, match="max_bytes") as info:
            await store.set("e/1", b"x" * 25_000)
        assert info.value.limit == "max_bytes"
        await store.delete("b/1")  # deleting frees quota; the store keeps serving
        await store.set("e/1", b"x" * 25_000)
        await store.set("a/1", b"y" * 20_000)  # overwriting with less always fits
        assert await store.get("e/1") == b"x" * 25_000
    finally:
        await store.aclose()
        if kind == "tcp":
            await runner.stop()


# --- limits that must hold in bytes as well as in number, and per frame ---

async def test_frames_that_each_arrive_in_time_are_not_dropped() -> None:
    # frame_timeout bounds one frame's arrival, not the connection's: a client whose every
    # write ends mid-frame (pipelining) always holds part of one, yet each arrives in time.
    runner = RunningServer(frame_timeout=0.5)
    server = await runner.start()
    try:
        raw = await Raw.open(server, authenticate=True)
        frames = [encode_frame(Set(i + 1, f"k{i}", b"x" * 100)) for i in range(8)]
        stream = b"".join(frames)
        cuts, pos = [], 0
        for f in frames:
            cuts.append(pos + len(f) // 2)  # every write ends in the middle of a frame
            pos += len(f)
        cuts.append(len(stream))
        start = 0
        for cut in cuts:  # each frame completes 0.2 s after its first byte (limit 0.5 s)
            raw.writer.write(stream[start:cut])
            await raw.writer.drain()
            start = cut
            await anyio.sleep(0.2)
        replies = [await raw.read() for _ in frames]
        assert all(isinstance(r, Ok) for r in replies), replies
        raw.close()
    finally:
        await runner.stop()


async def test_silent_connections_cannot_lock_out_a_token_holder() -> None:
    # At max_connections, a connection that has not authenticated gives way to a new one,
    # even below max_unauthenticated (default 64): a token holder always gets in.
    runner = RunningServer(max_connections=8)
    server = await runner.start()
    try:
        silent = [await Raw.open(server, authenticate=False) for _ in range(8)]
        await healthy(server)
        assert_limit(await silent[0].last(), "max_connections")  # the oldest was evicted
        for raw in silent:
            raw.close()
    finally:
        await runner.stop()


async def test_a_job_counter_key_is_short() -> None:
    # A job counter is never deleted: a long one would pin max_bytes until a restart.
    runner = RunningServer(max_bytes=1_000_000)
    server = await runner.start()
    try:
        async with await StoreClient.connect(server.address, token=TOKEN) as c:
            with pytest.raises(StoreLimitError) as got:
                await c.add("j" * 2000 + "/generation", 0)
            assert got.value.limit == "max_counter_key"
            assert await c.add("job/generation", 1) == 1  # a real one is fine
            await c.delete_prefix("")
            assert server.core.nbytes < 200  # the counter left: its bytes and its entry
            await c.set("x/data", b"v" * 900_000)
    finally:
        await runner.stop()


async def test_parked_waiters_are_bounded_in_bytes() -> None:
    # One session's pending waiters index at most max_reply bytes of keys (64 bytes of
    # index per key counted): a Wait frame of short keys cannot hold tens of times its size.
    from m2n_async._store._wire import Wait

    runner = RunningServer(max_frame=1 << 20)  # max_reply = max_frame: 1 MiB
    server = await runner.start()
    try:
        raw = await Raw.open(server, authenticate=True)
        keys = 6000  # a ~55 KB frame indexing ~420 KB as counted: two fit, then refusals
        for rid in range(1, 11):
            raw.send(Wait(rid, tuple(f"{rid}/{i}" for i in range(keys))))
        await raw.writer.drain()
        refused = []
        while len(refused) < 8 and (msg := await raw.read()) is not None:
            assert isinstance(msg, Error), msg
            assert (msg.kind, msg.key) == ("limit", "max_reply"), msg
            refused.append(msg.rid)
        assert refused == list(range(3, 11)), refused
        assert server.core.pending_waiters == 2 * keys
        await healthy(server)
        raw.close()
        await until(lambda: server.core.pending_waiters == 0, "the session's waiters gone")
    finally:
        await runner.stop()


async def test_tombstones_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tombstones are outside max_bytes: their keys together stay under MAX_TOMBSTONE_BYTES
    # (here lowered to 4 MiB), the oldest forgotten first.
    from m2n_async._store import _core
    from m2n_async._store._wire import Delete, Flag

    monkeypatch.setattr(_core, "MAX_TOMBSTONE_BYTES", 4 << 20)
    runner = RunningServer(max_frame=1 << 20)
    server = await runner.start()
    try:
        raw = await Raw.open(server, authenticate=True)
        for rid in range(1, 11):  # lost deletes of absent 1 MB keys
            raw.send(Delete(rid, f"t/{rid}/" + "x" * 1_000_000, True))
            assert isinstance(await raw.read(), Flag)
        held = sum(len(k) for k in server.core._tombstones)
        assert 0 < held <= 4 << 20, held
        assert f"t/10/{'x' * 1_000_000}" in server.core._tombstones  # the newest kept
        raw.close()
    finally:
        await runner.stop()


# --- a client that falls behind, then reads again ---


async def _paused_then_read(server: StoreServer, tail: bytes) -> list[ServerMessage]:
    """Pipeline 40 reads of a 200 KB value and ``tail`` in one write without reading, until the
    server pauses the connection; then read everything it sends until it closes."""
    async with await StoreClient.connect(server.address, token=TOKEN) as writer:
        await writer.set("big", b"x" * 200_000)
    raw = await Raw.open(server, authenticate=True, rcvbuf=4096)
    raw.writer.write(b"".join(encode_frame(Get(rid, "big")) for rid in range(1, 41)) + tail)
    await raw.writer.drain()
    await until(lambda: any(p._paused for p in server._protocols), "the server pauses it")
    replies = []
    while (msg := await raw.read()) is not None:
        replies.append(msg)
    raw.close()
    return replies


async def test_a_framing_error_read_while_paused_comes_after_the_requests_before_it() -> None:
    # The bad frame arrives with the requests before it, while the client is not reading: once
    # it reads again every request before the bad frame is answered, then the framing error
    # itself is reported (not a reader "used after a framing error").
    runner = RunningServer(max_frame=1 << 20)
    server = await runner.start()
    try:
        replies = await _paused_then_read(server, b"\x00\x00\x00\x01\xc1")
        assert [type(r) for r in replies[:-1]] == [Value] * 40, replies[-1]
        last = replies[-1]
        assert isinstance(last, Error) and (last.rid, last.kind) == (0, "protocol"), last
        assert "undecodable store frame" in last.message, last
        await healthy(server)
    finally:
        await runner.stop()


async def test_a_request_that_drops_the_connection_as_it_resumes_leaves_no_traceback() -> None:
    # The requests left when the client reads again run after the transport's write callback,
    # not inside it: one that drops the connection (here a request id reused while pending)
    # closes the transport once, with nothing for the event loop to report.
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    runner = RunningServer(max_frame=1 << 20)
    server = await runner.start()
    try:
        parked = encode_frame(Get(1000, "absent", wait=True))
        replies = await _paused_then_read(server, parked + parked)
        assert [type(r) for r in replies[:-1]] == [Value] * 40, replies[-1]
        last = replies[-1]
        assert isinstance(last, Error) and last.kind == "protocol", last
        assert "reused while pending" in last.message, last
        await healthy(server)
        await asyncio.sleep(0.1)  # a second connection_lost would be called soon
        assert reported == [], reported
    finally:
        await runner.stop()
        loop.set_exception_handler(previous)


# --- errors about long keys ---


@pytest.mark.parametrize("case", ["claim", "stale", "non-integer", "lost", "lost, key kept"])
async def test_a_refusal_naming_a_key_nearly_a_frame_long_fits_a_frame(case: str) -> None:
    # An error quotes a key cut short: one nearly a frame long (its repr up to 4x that) is
    # refused with a frame its client reads, not one past the client's limit (which would
    # break the connection with a protocol error). A lost key is named whole in the error's
    # key field while that fits.
    from m2n_async import PeerLostError, StaleGenerationError

    max_frame = 64 * 1024
    runner = RunningServer(max_frame=max_frame)
    server = await runner.start()
    long = "j/1/" + "\x00" * (max_frame - (2000 if case == "lost, key kept" else 100))
    try:
        with anyio.fail_after(DEADLINE):
            async with await StoreClient.connect(server.address, token=TOKEN,
                                                 max_frame=max_frame) as client:
                if case == "claim":
                    with pytest.raises(StoreError, match="job claim entry"):
                        await client.add("j/claims/" + long[4:])
                elif case == "stale":
                    await next_generation(client, "j")
                    await next_generation(client, "j")
                    with pytest.raises(StaleGenerationError, match="stale") as stale:
                        await client.set(long, b"v")
                    assert stale.value.job == "j"
                elif case == "non-integer":
                    await client.set(long, b"x")
                    with pytest.raises(StoreError, match="non-integer"):
                        await client.add(long)
                else:
                    await client.delete(long, lost=True)
                    with pytest.raises(PeerLostError, match="was lost") as lost:
                        await client.get("j/absent", wait=True, watch=[long])
                    assert lost.value.key == (long if case == "lost, key kept" else None)
                await client.set("after", b"1")  # the connection still serves
                assert await client.get("after") == b"1"
        await healthy(server)
    finally:
        await runner.stop()


async def test_a_request_listing_too_many_keys_is_refused_before_they_are_decoded() -> None:
    # Short keys decode to ~20x their bytes on the wire; msgspec checks a list's length from
    # its header, so a frame listing past MAX_REQUEST_KEYS costs its connection, not memory.
    from m2n_async._store._wire import MAX_REQUEST_KEYS, Wait

    runner = RunningServer()
    server = await runner.start()
    try:
        raw = await Raw.open(server, authenticate=True)
        raw.send(Wait(1, ("k",) * (MAX_REQUEST_KEYS + 1)))
        last = await raw.last()
        assert isinstance(last, Error) and last.kind == "protocol", last
        assert f"length <= {MAX_REQUEST_KEYS}" in last.message, last
        assert server.core.pending_waiters == 0
        await healthy(server)
    finally:
        await runner.stop()


@pytest.mark.parametrize("kind", ["memory", "tcp"])
async def test_too_many_keys_in_one_list_is_a_limit_error_on_every_store(kind: str) -> None:
    # The same refusal from MemoryStore and from StoreClient (before it sends: its server
    # would drop the connection), naming the limit; the session stays usable.
    from m2n_async._engine._engine import MAX_WORLD_SIZE
    from m2n_async._store._wire import MAX_REQUEST_KEYS

    assert MAX_REQUEST_KEYS > MAX_WORLD_SIZE  # a watch of every rank's liveness key fits
    runner = RunningServer()
    server = await runner.start()
    try:
        store = (MemoryStore() if kind == "memory"
                 else await StoreClient.connect(server.address, token=TOKEN))
        many = [f"k/{i}" for i in range(MAX_REQUEST_KEYS + 1)]
        calls = {
            "wait": lambda: store.wait(many),
            "wait watch": lambda: store.wait(["k/a"], watch=many),
            "get": lambda: store.get("k/a", wait=True, watch=many),
            "get, not waiting": lambda: store.get("k/a", watch=many),  # a wire limit still
            "gather": lambda: store.gather("k/", 1, watch=many),
            "exchange": lambda: store.exchange("k/x", b"v", "k/", 5, watch=many),
        }
        for what, call in calls.items():
            with pytest.raises(StoreLimitError, match=f"past the store's limit of "
                               f"{MAX_REQUEST_KEYS}") as got:
                await call()
            assert got.value.limit == "max_request_keys", what
        assert await store.get("k/x") is None  # the refused exchange wrote nothing
        await store.set("k/a", b"v")
        await store.wait(["k/a"], watch=many[:1000])
        await store.aclose()
    finally:
        await runner.stop()


async def test_a_connections_pipelined_requests_take_turns_with_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The requests of one read ran back to back: 64 KiB of slow ones held every other client.
    # Past _TURN_S (here 0: one request a turn) a connection yields to the loop's next turn;
    # its own requests still run, and are answered, in order.
    from m2n_async._store import _server

    monkeypatch.setattr(_server, "_TURN_S", 0.0)
    order: list[tuple[str, int]] = []
    execute = _ServerProtocol._execute

    def logged(self: _ServerProtocol, session: object, msg: object) -> object:
        order.append(("b" if getattr(msg, "key", "") == "b/k" else "a", msg.rid))  # type: ignore[attr-defined]
        return execute(self, session, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(_ServerProtocol, "_execute", logged)
    runner = RunningServer()
    server = await runner.start()
    try:
        a = await Raw.open(server, authenticate=True)
        b = await Raw.open(server, authenticate=True)
        a.writer.write(b"".join(encode_frame(Set(rid, f"a/{rid}", b"v"))
                                for rid in range(1, 51)))
        b.send(Get(1, "b/k"))
        replies = [await a.read() for _ in range(50)]
        assert [r.rid for r in replies] == list(range(1, 51))  # type: ignore[union-attr]
        assert isinstance(await b.read(), Value)
        assert sorted(order) == sorted([("a", r) for r in range(1, 51)] + [("b", 1)])
        assert order.index(("b", 1)) < 50, order  # served between a's requests
        assert [rid for who, rid in order if who == "a"] == list(range(1, 51))
        await healthy(server)
    finally:
        await runner.stop()


async def test_a_backlog_the_server_defers_is_not_timed_as_a_slow_frame(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A client that sent every byte at once, whose requests the server runs a turn at a
    # time (_TURN_S, here 0), must not be dropped for frame_timeout: while its turn is over
    # the server, not the client, holds the rest of its frame back, so no deadline runs.
    from m2n_async._store import _server

    monkeypatch.setattr(_server, "_TURN_S", 0.0)
    timed_while_deferred: list[int] = []
    received = _ServerProtocol.data_received

    def watched(self: _ServerProtocol, data: bytes | memoryview) -> None:
        received(self, data)
        if self._yielded and self._frame_deadline is not None:
            timed_while_deferred.append(self._reader.buffered)

    monkeypatch.setattr(_ServerProtocol, "data_received", watched)
    runner = RunningServer()
    server = await runner.start()
    try:
        raw = await Raw.open(server, authenticate=True)
        n = 5_000  # ~250 kB: several reads, each ending mid-frame
        raw.writer.write(b"".join(encode_frame(Set(rid, f"a/{rid}", b"v" * 30, reply=False))
                                  for rid in range(1, n + 1)) + encode_frame(Get(n + 1, "a/1")))
        last = await raw.read()
        assert isinstance(last, Value) and last.rid == n + 1, last
        assert timed_while_deferred == []
        await healthy(server)
    finally:
        await runner.stop()


async def test_no_request_runs_after_the_server_aborted_its_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # StoreServer's exit aborts every connection; one whose next turn is already queued
    # (_end_turn) must not run it on the closing transport.
    aborted: set[int] = set()
    after: list[int] = []
    abort, execute = _ServerProtocol.abort, _ServerProtocol._execute

    def logged_abort(self: _ServerProtocol) -> None:
        aborted.add(id(self))
        abort(self)

    def logged_execute(self: _ServerProtocol, session: object, msg: object) -> object:
        if id(self) in aborted:
            after.append(msg.rid)  # type: ignore[attr-defined]
        return execute(self, session, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(_ServerProtocol, "abort", logged_abort)
    monkeypatch.setattr(_ServerProtocol, "_execute", logged_execute)
    runner = RunningServer()
    server = await runner.start()
    raw = await Raw.open(server, authenticate=True)
    raw.writer.write(b"".join(encode_frame(Set(rid, f"a/{rid}", b"v"))
                              for rid in range(1, 20_001)))
    assert isinstance(await raw.read(), Ok)  # its turns are under way
    await runner.stop()
    assert after == []
