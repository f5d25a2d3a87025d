"""Store cost: what one acknowledged round trip spends in Python, with no process wake-ups.

``bench/store_bench.py`` compares the store with TCPStore across processes, where wake-ups
and cache misses dominate. This script takes them out, to show how much of a round trip is
our code and how much any Python asyncio round trip costs. Everything runs in one process on
one event loop (uvloop when installed, else asyncio), so the wall time of a call is the CPU
time of both sides:

1. ``echo``: a 16-byte round trip between a ``BufferedProtocol`` client and an echo server
   over loopback. No store code at all: the floor of an asyncio round trip.
2. ``add`` and ``get`` on a ``StoreClient`` against a ``StoreServer`` on the same loop and
   over loopback. The full client and server paths, without the wake-ups.
3. ``server add``: ``add`` requests fed straight into one server connection's protocol, with
   a transport that drops the replies. This is the server's share: parsing, dispatch, the
   core and the reply's encoding.

Usage: ``python bench/store_cost.py [--calls 20000] [--loop auto|asyncio|uvloop]``
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

from store_bench import _EchoClient  # the same client loop side as store_bench's echo row

from m2n_async import StoreClient, StoreServer
from m2n_async._store._cli import pick_loop
from m2n_async._store._server import _ServerProtocol
from m2n_async._store._wire import Add, encode_frame

TOKEN = "store-cost"


class _Echo(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.view = memoryview(bytearray(65536))
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        assert self.transport is not None
        self.transport.write(bytes(self.view[:nbytes]))


class _DropTransport:
    """A transport that takes the server's replies and drops them."""

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:  # a turn's end (_TURN_S): the frames are fed by hand
        pass

    def resume_reading(self) -> None:
        pass


async def _per_call(fn: Callable[[], Awaitable[object]], calls: int) -> float:
    for _ in range(min(calls // 10, 1000)):  # warm-up
        await fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _server_add(server: StoreServer, calls: int) -> float:
    proto = _ServerProtocol(server)
    proto._transport = _DropTransport()  # type: ignore[assignment]
    proto._session = server.core.open_session()
    # One frame fed again and again: an add never stays pending, so its id may repeat.
    frame = memoryview(encode_frame(Add(1, "cost/n", 1)))
    t0 = time.perf_counter()
    for _ in range(calls):
        proto.data_received(frame)
    return (time.perf_counter() - t0) / calls * 1e6


async def _main(calls: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    echo_server = await loop.create_server(_Echo, "127.0.0.1", 0)
    port = echo_server.sockets[0].getsockname()[1]
    echo_transport, echo = await loop.create_connection(_EchoClient, "127.0.0.1", port)

    async def echo_once() -> None:
        echo.waiter = loop.create_future()
        echo_transport.write(b"x" * 16)
        await echo.waiter

    out: dict[str, float] = {}
    async with StoreServer(token=TOKEN) as server:
        client = await StoreClient.connect(server.address, token=TOKEN)
        await client.set("cost/v", b"v" * 64)
        for _ in range(2):  # twice, interleaved: the second pass is the one reported
            out["echo (floor)"] = await _per_call(echo_once, calls)
            out["add"] = await _per_call(lambda: client.add("cost/n", 1), calls)
            out["get"] = await _per_call(lambda: client.get("cost/v"), calls)
        out["server add (no I/O)"] = _server_add(server, calls)
        await client.aclose()
    echo_transport.close()
    echo_server.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    args = ap.parse_args()
    loop = pick_loop(args.loop)
    if loop == "uvloop":
        import uvloop

        out = uvloop.run(_main(args.calls))
    else:
        out = asyncio.run(_main(args.calls))
    print(f"# store cost: one process, one {loop} loop, {args.calls} calls per row; "
          "us per call = CPU of client and server together")
    print("| path | us per call |")
    print("|---|---:|")
    for name, us in out.items():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
