"""Store bench: m2n_async's store vs torch.distributed.TCPStore on loopback, side by side.

What it measures, in one run, with both servers in their own process:

1. Op latency (one client, sequential): ``set``, ``get``, ``add`` and a write then a read of
   it (``set+get``), TCPStore and ours interleaved round by round (load from elsewhere on the
   box then hits both alike; the ratio is the median of the rounds' ratios). Round trips per
   call, as the wire shows them (strace of a TCPStore client, torch 2.13): TCPStore's ``set``
   sends and waits for nothing; its ``get`` is two round trips (a wait check, then the get);
   its ``add`` one. Ours: one round trip each, and ``set(..., ack=False)`` — our
   unacknowledged set, TCPStore's semantics, not the default — none. Our default ``set`` is
   acknowledged, so the ``set`` and ``set+get`` rows compare an acknowledged write with an
   unacknowledged one; the ``ack=False`` rows compare like with like. Our client runs on
   asyncio (anyio's default) and, when uvloop is installed, on uvloop too; our server is the
   ``m2n-async store`` command (uvloop when installed, ``--server-loop`` picks). Where the
   scheduler puts the processes moves the figures more than anything else on a small box:
   a client and a server on one CPU hand over without a cross-CPU wake-up (TCPStore's ``add``
   ~12 us), on two CPUs they pay one per message (~26-35 us). ``--pin same|split`` fixes the
   placement for the latency phase, for both stores alike; the default leaves it to the
   scheduler. The ``echo (floor)`` row is a bare 16-byte round trip between the same client
   loop and an echo server on our server's loop — no store code at all — against TCPStore's
   one-round-trip ``add``: the least that any Python asyncio store pays on this box.
2. All-gather of a 1 KB envelope across 64 ranks: ours is ``ControlGroup.all_gather`` (one
   server-side gather per rank per call); the baseline is the vLLM ``StatelessProcessGroup``
   pattern on TCPStore — each rank broadcasts its pickled object under its own key and reads
   every other rank's with a blocking ``get`` (one TCPStore broadcast per source rank).
   Ranks are spread over ``--procs`` processes (threads inside each for TCPStore, tasks on one
   event loop for ours); the figure is wall time per all-gather, the slowest process counted.

Usage: ``python bench/store_bench.py [--ranks 64] [--procs 4] [--rounds 20] [--ops 2000]
[--repeat 3] [--lat-rounds 20] [--server-loop auto|asyncio|uvloop]
[--pin none|same|split]``
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import anyio
import msgspec

from m2n_async._store._cli import pick_loop

TOKEN = secrets.token_hex(16)
PAYLOAD = 1024


class Envelope(msgspec.Struct, frozen=True, tag=True):
    rank: int
    blob: bytes


# --- servers -------------------------------------------------------------------------------


def start_ours(token_file: str, loop: str = "auto") -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([sys.executable, "-m", "m2n_async.cli", "store", "--port", "0",
                             "--token-file", token_file, "--loop", loop],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    address = proc.stdout.readline().decode().strip()
    if not address:
        raise RuntimeError("m2n-async store did not start")
    return proc, address


TCP_SERVER = """
import datetime, sys, time
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=600),
             wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
"""


def start_tcpstore() -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-c", TCP_SERVER], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def tcp_client(port: int) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=600))


# --- op latency ----------------------------------------------------------------------------

OPS = ("set", "set ack=False", "get", "add", "set+get", "set ack=False+get", "echo (floor)")
# TCPStore's set is always unacknowledged: its figure stands for both kinds of set.
# "echo (floor)": a bare round trip of 16 bytes to an echo server on the same event loop as
# our server, from the same client loop as ours — no store code at all — against TCPStore's
# one-round-trip add: what any Python asyncio design pays at least on this box.
TCP_OP = {"set": "set", "set ack=False": "set", "get": "get", "add": "add",
          "echo (floor)": "add",
          "set+get": "set+get", "set ack=False+get": "set+get"}


def batch(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


async def abatch(fn: Callable[[], Coroutine[Any, Any, object]], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        await fn()
    return (time.perf_counter() - t0) / n * 1e6


ECHO_SERVER = """
import asyncio, sys
class Echo(asyncio.BufferedProtocol):
    def connection_made(self, transport):
        self.transport = transport
        self.view = memoryview(bytearray(65536))
    def get_buffer(self, sizehint):
        return self.view
    def buffer_updated(self, nbytes):
        self.transport.write(bytes(self.view[:nbytes]))
async def main():
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(1e9)
if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


def start_echo(loop: str) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, loop], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


class _EchoClient(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.view = memoryview(bytearray(65536))
        self.waiter: asyncio.Future[None] | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:  # 16 bytes on loopback: one read
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


Latency = tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float],
                dict[str, float]]


def latency(address: str, port: int, echo_port: int, n: int, rounds: int, loop: str
            ) -> Latency:
    """Interleaved: each round times a batch of TCPStore calls, then the same op on ours, so
    that load from elsewhere on the box hits both sides alike. Returns the medians over the
    rounds for TCPStore and ours (us per call) and the median of the per-round ratios; then
    the same for TCPStore called from the event loop through ``anyio.to_thread`` (what an
    asyncio caller must do: a blocking call on the loop stalls every other task) and ours
    against that."""
    from m2n_async import StoreClient

    tcp = tcp_client(port)
    value = b"v" * 64
    tcp.set("warm", value)

    def tcp_set_get() -> None:
        tcp.set("sg", value)
        tcp.get("sg")

    tcp_fns: dict[str, Callable[[], object]] = {
        "set": lambda: tcp.set("k", value), "get": lambda: tcp.get("warm"),
        "add": lambda: tcp.add("n", 1), "set+get": tcp_set_get}

    async def main() -> Latency:
        c = await StoreClient.connect(address, token=TOKEN)
        aloop = asyncio.get_running_loop()
        echo_transport, echo = await aloop.create_connection(_EchoClient, "127.0.0.1",
                                                             echo_port)

        async def echo_once() -> None:
            echo.waiter = aloop.create_future()
            echo_transport.write(b"x" * 16)
            await echo.waiter
        await c.set("warm", value)

        async def set_get() -> None:
            await c.set("sg", value)
            await c.get("sg")

        async def post_get() -> None:
            await c.set("sg", value, ack=False)
            await c.get("sg")

        ours: dict[str, Callable[[], Coroutine[Any, Any, object]]] = {
            "set": lambda: c.set("k", value), "set ack=False": lambda: c.set("k", value,
                                                                            ack=False),
            "get": lambda: c.get("warm"), "add": lambda: c.add("n", 1), "set+get": set_get,
            "set ack=False+get": post_get, "echo (floor)": echo_once}
        per = max(n // rounds, 1)
        theirs_t: dict[str, list[float]] = {op: [] for op in tcp_fns}
        theirs_a: dict[str, list[float]] = {op: [] for op in tcp_fns}
        ours_t: dict[str, list[float]] = {op: [] for op in OPS}
        ratios: dict[str, list[float]] = {op: [] for op in OPS}
        ratios_a: dict[str, list[float]] = {op: [] for op in OPS}
        for _ in range(rounds + 1):  # the first round warms up and is dropped
            for op in OPS:
                fn = tcp_fns[TCP_OP[op]]
                t = batch(fn, per)
                ta = await abatch(partial(anyio.to_thread.run_sync, fn), per)
                o = await abatch(ours[op], per)
                await c.flush()
                if op == TCP_OP[op]:
                    theirs_t[op].append(t)
                    theirs_a[op].append(ta)
                ours_t[op].append(o)
                ratios[op].append(o / t)
                ratios_a[op].append(o / ta)
        await c.aclose()
        echo_transport.close()
        med = statistics.median
        return ({op: med(v[1:]) for op, v in theirs_t.items()},
                {op: med(v[1:]) for op, v in ours_t.items()},
                {op: med(v[1:]) for op, v in ratios.items()},
                {op: med(v[1:]) for op, v in theirs_a.items()},
                {op: med(v[1:]) for op, v in ratios_a.items()})

    return anyio.run(main, backend_options={"use_uvloop": loop == "uvloop"})


# --- all-gather ----------------------------------------------------------------------------


def ag_ours_proc(address: str, token: str, ranks: list[int], world: int, rounds: int,
                 namespace: str, barrier: Any, out: Any) -> None:
    from m2n_async import ControlGroup, StoreClient

    async def main() -> float:
        clients = [await StoreClient.connect(address, token=token) for _ in ranks]
        groups = [ControlGroup(c, r, world, namespace) for c, r in zip(clients, ranks,
                                                                         strict=True)]
        for g in groups:
            await g.join()

        async def rank_loop(g: ControlGroup, n: int) -> None:
            env = Envelope(g.rank, os.urandom(PAYLOAD))
            for _ in range(n):
                got = await g.all_gather(env, Envelope)
                assert len(got) == world and got[g.rank] == env

        async def run(n: int) -> None:
            async with anyio.create_task_group() as tg:
                for g in groups:
                    tg.start_soon(rank_loop, g, n)

        await run(2)  # warm-up (also aligns all processes on one call)
        await anyio.to_thread.run_sync(barrier.wait)
        t0 = time.perf_counter()
        await run(rounds)
        elapsed = time.perf_counter() - t0
        for c in clients:
            await c.aclose()
        return elapsed

    out.put(anyio.run(main))


def ag_tcp_proc(port: int, ranks: list[int], world: int, rounds: int, barrier: Any,
                out: Any) -> None:
    clients = {r: tcp_client(port) for r in ranks}

    def all_gather_obj(c: Any, rank: int, obj: object, call: int) -> list[object]:
        # vLLM StatelessProcessGroup.all_gather_obj: one broadcast per source rank.
        got: list[object] = []
        for src in range(world):
            key = f"ag/{call}/{src}"
            if src == rank:
                c.set(key, pickle.dumps(obj))
                got.append(obj)
            else:
                got.append(pickle.loads(c.get(key)))
        return got

    def rank_loop(rank: int, first: int, n: int) -> None:
        obj = {"rank": rank, "blob": os.urandom(PAYLOAD)}
        for call in range(first, first + n):
            got = all_gather_obj(clients[rank], rank, obj, call)
            assert len(got) == world

    def run(first: int, n: int) -> None:
        threads = [threading.Thread(target=rank_loop, args=(r, first, n)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run(0, 2)
    barrier.wait()
    t0 = time.perf_counter()
    run(2, rounds)
    out.put(time.perf_counter() - t0)


def all_gather(kind: str, target: Any, world: int, procs: int, rounds: int) -> float:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    split = [list(range(world))[i::procs] for i in range(procs)]
    if kind == "ours":
        ns = f"bench/{secrets.token_hex(4)}"
        ps = [ctx.Process(target=ag_ours_proc, args=(target, TOKEN, ranks, world, rounds, ns,
                                                      barrier, out)) for ranks in split]
    else:
        ps = [ctx.Process(target=ag_tcp_proc, args=(target, ranks, world, rounds, barrier,
                                                     out)) for ranks in split]
    for p in ps:
        p.start()
    times: list[float] = []
    try:
        while len(times) < len(ps):
            try:
                times.append(out.get(timeout=1.0))
            except queue.Empty:
                failed = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"{kind} all-gather worker failed (exit {failed})"
                                       ) from None
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return max(times) / rounds * 1e3  # ms per all-gather


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` (TCPStore's server runs several) to ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3,
                    help="all-gather runs per side (0: latency only)")
    ap.add_argument("--lat-rounds", type=int, default=20,
                    help="interleaved latency rounds (--ops calls per op and side in all)")
    ap.add_argument("--pin", choices=("none", "same", "split"), default="none",
                    help="latency phase only: 'same' puts the client and both servers on one "
                    "CPU, 'split' the client on one CPU and both servers on another")
    ap.add_argument("--server-loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                    help="event loop of our store server (m2n-async store --loop)")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
        f.write(TOKEN)
    server_loop = pick_loop(args.server_loop)
    ours, address = start_ours(f.name, server_loop)
    theirs, port = start_tcpstore()
    echo_server, echo_port = start_echo(server_loop)
    try:
        print(f"# store bench: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
              f"ranks={args.ranks} procs={args.procs} rounds={args.rounds} ops={args.ops}")
        loops = ["asyncio"] + (["uvloop"] if pick_loop("auto") == "uvloop" else [])
        everywhere = os.sched_getaffinity(0)
        if args.pin != "none":
            first, second = sorted(everywhere)[:2]
            servers = {second} if args.pin == "split" else {first}
            set_affinity(os.getpid(), {first})
            for server in (ours, theirs, echo_server):  # the echo row's server too
                set_affinity(server.pid, servers)
        results = {loop: latency(address, port, echo_port, args.ops, args.lat_rounds, loop)
                   for loop in loops}
        for pid in (os.getpid(), ours.pid, theirs.pid, echo_server.pid):
            set_affinity(pid, everywhere)
        print(f"\nOp latency, us per call (one client, sequential): median of "
              f"{args.lat_rounds} rounds, each timing {args.ops // args.lat_rounds} calls on "
              "TCPStore then on ours; ratio = median of the rounds' ours/TCPStore. Our server: "
              f"{server_loop} event loop. CPU placement: {args.pin}.")
        print("The last two columns: TCPStore called from the same event loop through "
              "anyio.to_thread.run_sync, as an asyncio caller must (a blocking call on the "
              "loop stalls every other task), and ours against that.")
        for loop in loops:
            tcp_us, our_us, ratio, tcp_async_us, ratio_async = results[loop]
            print(f"\nOur client on {loop}:\n")
            print("| op | TCPStore (us) | m2n_async store (us) | ours / TCPStore | "
                  "TCPStore via to_thread (us) | ours / that |")
            print("|---|---:|---:|---:|---:|---:|")
            for op in OPS:
                print(f"| {op} | {tcp_us[TCP_OP[op]]:.1f} | {our_us[op]:.1f} | "
                      f"{ratio[op]:.2f}x | {tcp_async_us[TCP_OP[op]]:.1f} | "
                      f"{ratio_async[op]:.2f}x |")
        if args.repeat < 1:
            return
        runs: list[tuple[float, float]] = []
        for _ in range(args.repeat):  # alternate, so load changes hit both sides alike
            runs.append((all_gather("tcpstore", port, args.ranks, args.procs, args.rounds),
                         all_gather("ours", address, args.ranks, args.procs, args.rounds)))
        tcp_ms = statistics.median(t for t, _ in runs)
        our_ms = statistics.median(o for _, o in runs)
        ratios = ", ".join(f"{t / o:.1f}x" for t, o in runs)
        print(f"\n| all-gather, 1 KB envelope, {args.ranks} ranks (median of {args.repeat}) "
              "| ms per call |")
        print("|---|---:|")
        print(f"| TCPStore, vLLM pattern (one broadcast per source rank) | {tcp_ms:.1f} |")
        print(f"| m2n_async ControlGroup.all_gather (server-side gather) | {our_ms:.1f} |")
        speedup = statistics.median(t / o for t, o in runs)
        print(f"| speed-up, median of the runs' ratios ({ratios}) | {speedup:.1f}x |")
    finally:
        for proc in (ours, theirs, echo_server):
            proc.terminate()
        for proc in (ours, theirs, echo_server):
            proc.wait()
        os.unlink(f.name)


if __name__ == "__main__":
    main()
