"""``StoreClient.set(..., ack=False)``: unacknowledged sets (TCPStore's ``set`` semantics).

What is checked: the write is applied in order (the same client reads it back at once); a
failure is raised by the next call to start (which then does nothing) or by ``flush()``; the
client's bookkeeping stays bounded; a reply proves earlier unacknowledged sets settled; a
server that answers one with anything but an error is a protocol violation; a set cancelled
under back-pressure sent nothing.
"""

from __future__ import annotations

import anyio
import anyio.abc
import pytest
from store_helpers import TOKEN

from m2n_async import RemoteProtocolError, StoreClient, StoreError, StoreServer
from m2n_async._store import _auth
from m2n_async._store._client import MAX_UNACKED
from m2n_async._store._core import StaleGenerationError
from m2n_async._store._wire import (
    STORE_PROTO_VERSION,
    AuthOk,
    ClientAuth,
    ClientMessage,
    FrameReader,
    Ok,
    ServerHello,
    Set,
    encode_frame,
)

pytestmark = pytest.mark.asyncio
DEADLINE = 10


async def stale_generation(c: StoreClient) -> None:
    """Move job ``j`` to generation 2: keys under ``j/1/`` are then refused."""
    assert await c.add("j/generation") == 1
    assert await c.add("j/generation") == 2


async def test_unacked_set_is_applied_in_order(server: StoreServer) -> None:
    async with await StoreClient.connect(server.address, token=TOKEN) as c, \
            await StoreClient.connect(server.address, token=TOKEN) as other:
        with anyio.fail_after(DEADLINE):
            for i in range(200):
                await c.set("k", b"%d" % i, ack=False)
            assert await c.get("k") == b"199"  # same connection: ordered after the sets
            assert len(c._unacked) == 0  # the get's reply settled all of them
            await c.set("eph", b"x", ephemeral=True, ack=False)
            await c.flush()
            assert await other.get("eph") == b"x"
            await c.flush()  # nothing pending: no round trip, no error


async def test_failure_is_raised_by_the_next_call_which_does_nothing(server: StoreServer
                                                                      ) -> None:
    async with await StoreClient.connect(server.address, token=TOKEN) as c:
        with anyio.fail_after(DEADLINE):
            await stale_generation(c)
            await c.set("j/1/x", b"v", ack=False)  # returns: the failure comes later
            await c.get("j/2/y")  # its reply proves the failure has arrived
            with pytest.raises(StaleGenerationError) as info:
                await c.add("counter")
            assert info.value.generation == 1 and info.value.current == 2
            assert any("'j/1/x'" in note for note in info.value.__notes__)
            assert await c.get("counter") is None  # the add that raised did nothing
            assert await c.add("counter") == 1  # reported once; the client stays usable


async def test_flush_raises_the_first_failure_and_counts_the_rest(server: StoreServer) -> None:
    async with await StoreClient.connect(server.address, token=TOKEN) as c:
        with anyio.fail_after(DEADLINE):
            await stale_generation(c)
            await c.set("j/1/a", b"v", ack=False)
            await c.set("ok", b"v", ack=False)
            await c.set("j/1/b", b"v", ack=False)
            with pytest.raises(StaleGenerationError) as info:
                await c.flush()
            notes = " ".join(info.value.__notes__)
            assert "'j/1/a'" in notes and "1 later unacknowledged set(s)" in notes
            await c.flush()  # reported: nothing left
            assert await c.get("ok") == b"v"


async def test_outstanding_unacked_sets_are_bounded(server: StoreServer) -> None:
    async with await StoreClient.connect(server.address, token=TOKEN) as c:
        with anyio.fail_after(DEADLINE):
            for i in range(3 * MAX_UNACKED):
                await c.set(f"b/{i % 7}", b"v", ack=False)
                assert len(c._unacked) <= MAX_UNACKED
            assert len(c._unacked) > 0  # without a reply they are outstanding
            await c.flush()
            assert len(c._unacked) == 0 and c._unacked_keys == {}


async def authenticate(stream: anyio.abc.SocketStream,
                       reader: FrameReader[ClientMessage]) -> None:
    nonce = _auth.new_nonce()
    await stream.send(encode_frame(ServerHello(STORE_PROTO_VERSION, nonce)))
    while (auth := reader.next_message()) is None:
        reader.feed(await stream.receive())
    assert isinstance(auth, ClientAuth)
    key = _auth.token_bytes(TOKEN)
    await stream.send(encode_frame(AuthOk(_auth.server_proof(key, nonce, auth.nonce), 7)))


async def test_a_reply_to_an_unacked_set_breaks_the_connection() -> None:
    async def script(stream: anyio.abc.SocketStream) -> None:
        reader: FrameReader[ClientMessage] = FrameReader(ClientMessage)  # type: ignore[arg-type]
        await authenticate(stream, reader)
        while (msg := reader.next_message()) is None:
            reader.feed(await stream.receive())
        assert isinstance(msg, Set) and not msg.reply
        await stream.send(encode_frame(Ok(msg.rid)))  # wrong: it asked for no reply
        await anyio.sleep(5)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, script)
            client = await StoreClient.connect(("127.0.0.1", port), token=TOKEN)
            await client.set("k", b"v", ack=False)
            # The Ok breaks the connection, whether it arrives before the get is sent (then
            # the get refuses to start) or while the get waits (then the get fails with it).
            with anyio.fail_after(DEADLINE), \
                    pytest.raises((RemoteProtocolError, StoreError),
                                  match="unacknowledged set of 'k'"):
                await client.get("k")
            assert isinstance(client._broken, RemoteProtocolError)
            with pytest.raises(StoreError, match="unusable"):
                await client.get("k")
            await client.aclose()
            tg.cancel_scope.cancel()


async def test_unacked_set_cancelled_under_back_pressure_sent_nothing() -> None:
    """A server that authenticates and then stops reading: our writes pile up until the
    transport pauses; a set waiting there can be cancelled, and then it was never sent."""
    stop = anyio.Event()

    async def script(stream: anyio.abc.SocketStream) -> None:
        reader: FrameReader[ClientMessage] = FrameReader(ClientMessage)  # type: ignore[arg-type]
        await authenticate(stream, reader)
        await stop.wait()

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, script)
            client = await StoreClient.connect(("127.0.0.1", port), token=TOKEN)
            big = b"x" * (1 << 20)
            with anyio.fail_after(DEADLINE):
                while client._protocol.writable is None:  # fill the socket and our buffer
                    await client.set("big", big, ack=False)
            outstanding = len(client._unacked)
            with anyio.move_on_after(0.2) as scope:
                await client.set("late", b"v", ack=False)
            assert scope.cancelled_caught
            assert len(client._unacked) == outstanding
            assert "late" not in client._unacked_keys.values()
            await client.aclose()
            stop.set()
            tg.cancel_scope.cancel()


async def test_held_back_set_goes_out_when_the_task_yields_or_closes(server: StoreServer
                                                                      ) -> None:
    """An unacknowledged set waits for company (the next request) only until its task yields;
    ``aclose`` hands it to the socket before closing."""
    async with await StoreClient.connect(server.address, token=TOKEN) as other:
        c = await StoreClient.connect(server.address, token=TOKEN)
        await c.set("alone", b"1", ack=False)
        with anyio.fail_after(DEADLINE):
            # No flush and no other call on c: the set goes out once this task waits here.
            assert await other.get("alone", wait=True) == b"1"
            await c.set("last", b"2", ack=False)
            await c.aclose()
            assert await other.get("last", wait=True) == b"2"
