"""Request/reply correlation, fuzzed on each side of the wire separately.

Server side: several connections' ``_ServerProtocol`` objects, driven synchronously through a
fake transport with random request mixes, random cuts of the byte stream (partial frames),
``Cancel`` of pending, finished and never-blocking requests, back-pressure pauses and resumes,
and dropped connections. Every reply must arrive on the connection that asked, echo a request
id that connection has outstanding, exactly once, and have the type that request expects.

Client side: a scripted server answers in a random order, sometimes answers a request after
its ``Cancel`` arrived (as the real one can, when they cross); many tasks share one client
and are cancelled at random points. Every call must return its own request's answer and the
connection must never be judged broken.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import anyio
import pytest

from m2n_async import StoreClient, StoreServer
from m2n_async._store import _auth
from m2n_async._store._server import _ServerProtocol
from m2n_async._store._wire import (
    STORE_PROTO_VERSION,
    Add,
    AuthOk,
    Cancel,
    ClientAuth,
    ClientMessage,
    Delete,
    Error,
    Exchange,
    Flag,
    FrameReader,
    Gather,
    Get,
    Int,
    Items,
    Ok,
    ServerHello,
    ServerMessage,
    Set,
    Value,
    Wait,
    encode_frame,
)

pytestmark = pytest.mark.asyncio
TOKEN = "fuzz"
EXPECT: dict[type, type] = {Set: Ok, Get: Value, Wait: Ok, Gather: Items, Exchange: Items,
                            Add: Int, Delete: Flag}
BLOCKING = (Get, Wait, Gather, Exchange)


class FakeTransport(asyncio.Transport):
    """Captures what the server writes, decoded; reading can be paused like a real one."""

    def __init__(self) -> None:
        super().__init__()
        self.reader: FrameReader[ServerMessage] = FrameReader(ServerMessage)  # type: ignore[arg-type]
        self.replies: list[ServerMessage] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "the server wrote on a closed transport"
        self.reader.feed(bytes(data))
        while (msg := self.reader.next_message()) is not None:
            self.replies.append(msg)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0  # every write is taken at once

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class Conn:
    """One fuzzed connection: its protocol, transport, outstanding requests and unsent bytes."""

    def __init__(self, server: StoreServer) -> None:
        self.proto = _ServerProtocol(server)
        self.transport = FakeTransport()
        self.proto.connection_made(self.transport)
        hello = self.transport.replies.pop(0)
        assert isinstance(hello, ServerHello)
        nonce = _auth.new_nonce()
        mac = _auth.client_proof(_auth.token_bytes(TOKEN), hello.nonce, nonce)
        self.proto.data_received(encode_frame(ClientAuth(STORE_PROTO_VERSION, nonce, mac)))
        assert isinstance(self.transport.replies.pop(0), AuthOk)
        self.next_rid = 0
        self.outstanding: dict[int, type] = {}  # rid -> request type, until answered
        self.cancelled: set[int] = set()  # withdrawn by us: a crossing reply is allowed
        self.unacked: set[int] = set()  # Set(reply=False): answered only by an Error
        self.unsent = b""

    def request(self, rng: random.Random, keys: list[str]) -> None:
        self.next_rid += 1
        rid = self.next_rid
        watch = tuple(rng.sample(keys, rng.randrange(2)))
        msg = rng.choice([
            lambda: Set(rid, rng.choice(keys), b"v", rng.random() < 0.2),
            lambda: Get(rid, rng.choice(keys), False),
            lambda: Get(rid, rng.choice(keys) + rng.choice(["", "x"]), True, watch),
            lambda: Wait(rid, tuple(rng.sample(keys, 2)), watch),
            lambda: Gather(rid, "k/", rng.randrange(8), watch),
            lambda: Exchange(rid, rng.choice(keys), b"e", rng.choice([None, *keys]), "k/",
                             rng.randrange(8), watch),
            lambda: Add(rid, "count", 1),
            lambda: Delete(rid, rng.choice(keys)),
        ])()
        if rng.random() < 0.1:  # an unacknowledged set instead
            msg = Set(rid, rng.choice(keys), b"u", rng.random() < 0.2, False)
            self.unacked.add(rid)
        else:
            self.outstanding[rid] = type(msg)
        self.unsent += encode_frame(msg)

    def cancel(self, rng: random.Random) -> None:
        blocking = [r for r, t in self.outstanding.items() if t in BLOCKING]
        if blocking and rng.random() < 0.7:
            rid = rng.choice(blocking)
        elif self.next_rid:
            rid = rng.randrange(1, self.next_rid + 1)  # finished, or never blocking
        else:
            return
        if rid in self.outstanding:
            del self.outstanding[rid]
            self.cancelled.add(rid)
        self.unsent += encode_frame(Cancel(rid))

    def send_some(self, rng: random.Random) -> None:
        if not self.transport.reading or self.transport.closed:
            return
        cut = rng.randrange(len(self.unsent) + 1)
        chunk, self.unsent = self.unsent[:cut], self.unsent[cut:]
        self.proto.data_received(chunk)

    def check_replies(self, where: str) -> None:
        for msg in self.transport.replies:
            rid = getattr(msg, "rid", None)
            assert isinstance(rid, int) and rid > 0, f"{where}: connection-level {msg!r}"
            if rid in self.unacked:
                assert isinstance(msg, Error), f"{where}: unacknowledged set answered {msg!r}"
                self.unacked.discard(rid)
                continue
            req = self.outstanding.pop(rid, None)
            if req is None:
                assert rid in self.cancelled, f"{where}: {msg!r} answers nothing outstanding"
                self.cancelled.discard(rid)  # at most one crossing reply
                continue
            if not isinstance(msg, Error):
                assert isinstance(msg, EXPECT[req]), f"{where}: {req.__name__} got {msg!r}"
        self.transport.replies.clear()


@pytest.mark.parametrize("seed", range(12))
async def test_server_replies_stay_on_their_connection_and_request(seed: int) -> None:
    rng = random.Random(seed)
    server = StoreServer(token=TOKEN)
    keys = [f"k/{i}" for i in range(6)]
    conns = [Conn(server) for _ in range(4)]
    for step in range(2500):
        c = rng.choice(conns)
        action = rng.random()
        if action < 0.55:
            c.request(rng, keys)
        elif action < 0.7:
            c.cancel(rng)
        elif action < 0.75:
            c.proto.pause_writing()
        elif action < 0.8 and c.proto._paused:
            c.proto.resume_writing()
        if rng.random() < 0.35:
            c.send_some(rng)
        for i, cc in enumerate(conns):
            cc.check_replies(f"seed {seed} step {step} connection {i}")
        if rng.random() < 0.003:  # a connection drops; a new one takes its place
            i = rng.randrange(len(conns))
            conns[i].proto.connection_lost(None)
            conns[i] = Conn(server)
            for cc in conns:
                cc.check_replies(f"seed {seed} step {step} after a drop")
    for c in conns:
        c.proto.connection_lost(None)
    assert server.core.pending_waiters == 0


async def test_client_matches_replies_answered_out_of_order_and_across_cancels() -> None:
    rng = random.Random(99)
    done = anyio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames: FrameReader[ClientMessage] = FrameReader(ClientMessage)  # type: ignore[arg-type]
        nonce = _auth.new_nonce()
        writer.write(encode_frame(ServerHello(STORE_PROTO_VERSION, nonce)))
        queued: list[ServerMessage] = []

        async def answer() -> None:
            while True:
                await asyncio.sleep(rng.choice([0, 0, 0.0005]))
                rng.shuffle(queued)
                n = rng.randrange(len(queued) + 1)
                out, queued[:] = queued[:n], queued[n:]
                for m in out:
                    writer.write(encode_frame(m))

        async with anyio.create_task_group() as tg:
            while True:
                try:
                    data = await reader.read(65536)
                except ConnectionError:  # the client's aclose aborts
                    data = b""
                if not data:
                    break
                frames.feed(data)
                while (m := frames.next_message()) is not None:
                    if isinstance(m, ClientAuth):
                        proof = _auth.server_proof(_auth.token_bytes(TOKEN), nonce, m.nonce)
                        writer.write(encode_frame(AuthOk(proof, 1)))
                        tg.start_soon(answer)
                    elif isinstance(m, Cancel):
                        if rng.random() < 0.5:  # else: the answer crosses the Cancel
                            queued[:] = [q for q in queued if getattr(q, "rid", 0) != m.rid]
                    elif isinstance(m, Set):
                        queued.append(Ok(m.rid))
                    elif isinstance(m, Get):
                        queued.append(Value(m.rid, m.key.encode()))
                    elif isinstance(m, Add):
                        queued.append(Int(m.rid, m.delta))
                    elif isinstance(m, Gather):
                        queued.append(Items(m.rid, {m.prefix: b"x"}))
            tg.cancel_scope.cancel()
        writer.close()
        done.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = await StoreClient.connect(("127.0.0.1", port), token=TOKEN)

    async def worker(w: int) -> None:
        for i in range(150):
            op = rng.randrange(5)
            with anyio.move_on_after(rng.choice([0, 0.0002, 0.001, 0.01, 5])):
                if op == 0:
                    assert await client.set(f"k{w}", b"v") is None
                elif op == 1:
                    assert await client.get(f"g{w}/{i}") == f"g{w}/{i}".encode()
                elif op == 2:
                    assert await client.get(f"g{w}/{i}", wait=True) == f"g{w}/{i}".encode()
                elif op == 3:
                    assert await client.add("a", i) == i
                else:
                    assert await client.gather(f"p{w}/{i}/", 1) == {f"p{w}/{i}/": b"x"}

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for w in range(20):
                tg.start_soon(worker, w)
    assert client._broken is None
    await client.aclose()
    with anyio.fail_after(10):
        await done.wait()
    server.close()
    await server.wait_closed()
