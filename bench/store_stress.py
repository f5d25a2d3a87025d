"""Hostile and careless clients against a live store server: what each attack costs it.

Usage: ``python bench/store_stress.py [--loop asyncio|uvloop|both] [--seconds S]
[--attacks NAME,...]``

The server runs in its own process (default limits, except ``frame_timeout=2`` so that the
partial-frame attack ends within the run; its open-files limit is 1,024, as on a default
Linux box). For each attack the bench samples the server's RSS (peak growth over the attack)
and its open file descriptors, and runs a well-behaved client in a third process that times
its connect and then its ``get`` round trips throughout (p50, p99, max). Attacks:

- ``idle``: 900 authenticated connections that send nothing (the open-files limit allows
  ~960); the server's RSS growth once they are open, per connection.
- ``waiters``: one connection parks 150 ``get(wait=True)`` and never reads; another client
  writes one 8 MiB value (its ack time is shown).
- ``output``: 40 connections that never read each park 4 ``get(wait=True)`` on a key of
  their own, then another client sets each key to 7 MiB (and deletes it): 28 MiB of replies
  per connection, within its ``max_output`` (32 MiB), 1.1 GiB in all. The store-wide
  ``max_output_bytes`` (256 MiB) holds the server to about that: the connections holding the
  most are dropped as the next ones fill (most are cut short: their room is needed again
  before their close grace ends).
- ``gather``: 40 x 15 MiB values, then one ``gather("big/", 0)`` (refused: ``max_reply``).
- ``fd_flood``: a token-less client holds 1,100 connections and reopens those dropped.
- ``partial``: 20 connections park 15 MiB of a 16 MiB frame: those past the store-wide
  ``max_partial_bytes`` (256 MiB) are dropped at once, the rest at ``frame_timeout``.
- ``guess``: wrong-token attempts from 200 concurrent connections (answered / s).
- ``backlog``: 400 simultaneous connects (p90 of connect-to-challenge).
- ``counter``: ``delete_prefix("job/")`` then ``next_generation`` (must not reuse 1).
- ``scans``: 100,000 keys outside every job, then one write of 400 pipelined ``gather``s,
  each on a new prefix outside every job (each scans every key: ~5 ms); how long they took
  in all. The legit client's longest round trip shows whether it was served between them.

A default run (both loops) takes about two and a half minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable

from m2n_async import StoreClient, StoreServer, next_generation
from m2n_async._proto.errors import StoreError
from m2n_async._store import _auth
from m2n_async._store._wire import (
    STORE_PROTO_VERSION,
    ClientAuth,
    FrameReader,
    Gather,
    Get,
    ServerMessage,
    encode_frame,
)

TOKEN = "stress-token"


# --- the processes ---------------------------------------------------------------------------


def serve(loop_name: str) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))

    async def main() -> None:
        async with StoreServer("127.0.0.1", 0, token=TOKEN, frame_timeout=2.0) as server:
            print(server.address, flush=True)
            await asyncio.Event().wait()

    _run(main(), loop_name)


def legit(address: str, seconds: float) -> None:
    async def main() -> None:
        t0 = time.perf_counter()
        try:
            client = await asyncio.wait_for(StoreClient.connect(address, token=TOKEN), 30)
        except (StoreError, TimeoutError) as exc:
            print(json.dumps({"error": str(exc)[:80]}), flush=True)
            return
        connect_ms = (time.perf_counter() - t0) * 1e3
        lat: list[float] = []
        end = time.perf_counter() + seconds
        async with client:
            await client.set("health", b"ok")
            while time.perf_counter() < end:
                t = time.perf_counter()
                await client.get("health")
                lat.append((time.perf_counter() - t) * 1e3)
                await asyncio.sleep(0.002)
        lat.sort()
        print(json.dumps({"connect_ms": connect_ms, "p50_ms": lat[len(lat) // 2],
                          "p99_ms": lat[int(len(lat) * 0.99)], "max_ms": lat[-1],
                          "calls": len(lat)}), flush=True)

    asyncio.run(main())


def _run(coro: Awaitable[None], loop_name: str) -> None:
    if loop_name == "uvloop":
        import uvloop
        uvloop.run(coro)  # type: ignore[arg-type]
    else:
        asyncio.run(coro)  # type: ignore[arg-type]


# --- measuring the server ------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Sampler:
    """Peak RSS and fd count of the server while an attack runs (a thread, every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = _rss_mb(pid)
        self.peak = self.base
        self.fds = _fds(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mb(self.pid))
            self.fds = max(self.fds, _fds(self.pid))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"rss_growth_mb": round(self.peak - self.base, 1), "peak_fds": self.fds}


async def raw(address: str, *, token: str | None, rcvbuf: int | None = None
              ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    if token is not None:
        frames: FrameReader[ServerMessage] = FrameReader(ServerMessage)  # type: ignore[arg-type]
        hello = await _next(reader, frames)
        nonce = _auth.new_nonce()
        mac = _auth.client_proof(_auth.token_bytes(token), hello.nonce, nonce)  # type: ignore[union-attr]
        writer.write(encode_frame(ClientAuth(STORE_PROTO_VERSION, nonce, mac)))
        await _next(reader, frames)
    return reader, writer


async def _next(reader: asyncio.StreamReader, frames: FrameReader[ServerMessage]
                ) -> ServerMessage | None:
    while (msg := frames.next_message()) is None:
        data = await reader.read(65536)
        if not data:
            return None
        frames.feed(data)
    return msg


def _closed(writer: asyncio.StreamWriter) -> bool:
    return writer.transport.is_closing()


# --- the attacks ---------------------------------------------------------------------------


IDLE_CONNECTIONS = 900


async def attack_idle(address: str, pid: int) -> dict[str, object]:
    await asyncio.sleep(0.2)
    before = _rss_mb(pid)
    conns = [await raw(address, token=TOKEN) for _ in range(IDLE_CONNECTIONS)]
    await asyncio.sleep(0.5)  # every challenge answered, every session open
    grown = _rss_mb(pid) - before
    for _, writer in conns:
        writer.close()
    return {"idle_connections": IDLE_CONNECTIONS, "idle_rss_growth_mb": round(grown, 1),
            "rss_per_connection_kib": round(grown * 1024 / IDLE_CONNECTIONS, 1)}


async def attack_waiters(address: str) -> dict[str, object]:
    reader, writer = await raw(address, token=TOKEN, rcvbuf=4096)
    for rid in range(1, 151):
        writer.write(encode_frame(Get(rid, "big8", wait=True)))
    await writer.drain()
    await asyncio.sleep(0.3)
    async with await StoreClient.connect(address, token=TOKEN) as c:
        t = time.perf_counter()
        await c.set("big8", b"x" * (8 << 20))
        ack_ms = (time.perf_counter() - t) * 1e3
        await asyncio.sleep(6)  # the close grace of a client that does not read (5 s)
    received, dropped = 0, False
    try:  # now read what reached us: the stream ends (dropped) short of 150 x 8 MiB
        async with asyncio.timeout(10):
            while data := await reader.read(1 << 20):
                received += len(data)
            dropped = True
    except TimeoutError:
        pass
    writer.close()
    return {"writer_ack_ms": round(ack_ms, 1), "hostile_dropped": dropped,
            "hostile_received_mb": round(received / 2**20, 1)}


OUTPUT_CONNECTIONS = 40
OUTPUT_GETS = 4  # per connection, of one OUTPUT_VALUE each: 28 MiB, under max_output
OUTPUT_VALUE = 7 << 20


async def attack_output(address: str) -> dict[str, object]:
    conns = [await raw(address, token=TOKEN, rcvbuf=4096) for _ in range(OUTPUT_CONNECTIONS)]
    for i, (_, writer) in enumerate(conns):
        for rid in range(1, OUTPUT_GETS + 1):
            writer.write(encode_frame(Get(rid, f"out/{i}", wait=True)))
        await writer.drain()
    await asyncio.sleep(0.3)  # every get parked
    value = b"x" * OUTPUT_VALUE
    t = time.perf_counter()
    async with await StoreClient.connect(address, token=TOKEN) as c:
        for i in range(OUTPUT_CONNECTIONS):  # each set's completions are queued before its ack
            await c.set(f"out/{i}", value)
            await c.delete(f"out/{i}")  # the stored value is not what this measures
    feed_s = time.perf_counter() - t
    await asyncio.sleep(0.2)
    told = cut = kept = 0
    for reader, writer in conns:  # read what each was left: all of it, or a dropped stream
        tail = b""
        try:
            while True:
                data = await asyncio.wait_for(reader.read(1 << 20), 0.5)
                if not data:
                    break
                tail = (tail + data)[-4096:]
        except TimeoutError:  # all its replies read and the connection still open: kept
            kept += 1
        except OSError:
            cut += 1
        else:  # dropped: its error frame at the end, or (aborted when its room was needed
            # before its close grace ended) the stream ends with what the kernel had taken
            told += b"max_output_bytes" in tail
            cut += b"max_output_bytes" not in tail
        writer.close()
    return {"parked_mb": OUTPUT_CONNECTIONS * OUTPUT_GETS * OUTPUT_VALUE >> 20,
            "feed_s": round(feed_s, 2), "kept": kept, "dropped_told_max_output_bytes": told,
            "dropped_cut_short": cut}


async def attack_gather(address: str, pid: int) -> dict[str, object]:
    async with await StoreClient.connect(address, token=TOKEN) as c:
        for i in range(40):
            await c.set(f"big/{i}", b"v" * (15 << 20))
        await asyncio.sleep(0.1)
        during = Sampler(pid)  # the values themselves are legitimate data: not counted
        t = time.perf_counter()
        try:
            await c.gather("big/", 0)
            outcome = "served"
        except StoreError as exc:
            outcome = f"refused ({getattr(exc, 'limit', '?')})"
        refuse_ms = (time.perf_counter() - t) * 1e3
        await asyncio.sleep(0.1)
        growth = during.stop()["rss_growth_mb"]
        await c.delete_prefix("big/")
    return {"gather": outcome, "refused_in_ms": round(refuse_ms, 2),
            "gather_rss_growth_mb": growth, "stored_mb": 600}


async def attack_fd_flood(address: str, seconds: float) -> dict[str, object]:
    host, port = address.rsplit(":", 1)
    held: list[socket.socket] = []
    end = time.perf_counter() + seconds
    opened = 0
    while time.perf_counter() < end:
        held = [s for s in held if _alive(s)]
        while len(held) < 1100 and time.perf_counter() < end:
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect((host, int(port)))
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                break
            held.append(s)
            opened += 1
            if opened % 50 == 0:
                await asyncio.sleep(0)
        await asyncio.sleep(0.05)
    for s in held:
        s.close()
    return {"connections_opened": opened}


def _alive(s: socket.socket) -> bool:
    try:
        data = s.recv(65536, socket.MSG_DONTWAIT | socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        s.close()
        return False
    if data and b"limit" not in data and b"auth" not in data:
        return True
    s.close()
    return False


async def attack_partial(address: str) -> dict[str, object]:
    conns = [await raw(address, token=TOKEN) for _ in range(20)]
    for _, writer in conns:
        writer.write((16 << 20).to_bytes(4, "big") + b"\x00" * (15 << 20))
    drained = asyncio.gather(*(w.drain() for _, w in conns), return_exceptions=True)
    await asyncio.sleep(1.0)  # before frame_timeout (2 s in this bench)
    early = 0
    for reader, _ in conns:  # dropped by max_partial_bytes: its error (or a reset: it had
        try:                 # bytes the server never read)
            got = await asyncio.wait_for(reader.read(65536), 0.05)
            early += b"max_partial_bytes" in got
        except TimeoutError:
            pass
        except OSError:
            early += 1
    await drained
    await asyncio.sleep(2.5)
    open_after = 0
    for reader, writer in conns:
        try:  # a dropped connection has its limit error, then the end of the stream
            await asyncio.wait_for(reader.read(65536), 0.2)
        except TimeoutError:
            open_after += 1
        except OSError:
            pass
        writer.close()
    return {"dropped_by_max_partial_bytes": early, "still_open_after_3.5s": open_after}


async def attack_guess(address: str, seconds: float) -> dict[str, object]:
    answered = evicted = 0
    end = time.perf_counter() + seconds

    async def guesser() -> None:
        nonlocal answered, evicted
        while time.perf_counter() < end:
            try:
                reader, writer = await raw(address, token=None)
                frames: FrameReader[ServerMessage] = FrameReader(ServerMessage)  # type: ignore[arg-type]
                hello = await _next(reader, frames)
                nonce = _auth.new_nonce()
                mac = _auth.client_proof(b"guess", hello.nonce, nonce)  # type: ignore[union-attr]
                writer.write(encode_frame(ClientAuth(STORE_PROTO_VERSION, nonce, mac)))
                left = max(0.01, end - time.perf_counter())
                reply = await asyncio.wait_for(_next(reader, frames), left)
                kind = getattr(reply, "kind", None)
                answered += kind == "auth"  # a verdict on the guess
                evicted += kind == "limit"  # evicted first: it learned nothing
                writer.close()
            except (OSError, TimeoutError, AttributeError):
                await asyncio.sleep(0.01)

    await asyncio.gather(*(guesser() for _ in range(200)))
    return {"wrong_tokens_answered_per_s": round(answered / seconds, 1),
            "guesses_evicted_per_s": round(evicted / seconds, 1)}


async def attack_backlog(address: str) -> dict[str, object]:
    host, port = address.rsplit(":", 1)
    loop = asyncio.get_running_loop()

    async def one() -> float:
        t = time.perf_counter()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_recv(sock, 4096)  # the challenge: accepted and served
        took = (time.perf_counter() - t) * 1e3
        sock.close()
        return took

    times = sorted(await asyncio.gather(*(one() for _ in range(400))))
    return {"connect_p90_ms": round(times[int(len(times) * 0.9)], 1)}


async def attack_counter(address: str) -> dict[str, object]:
    async with await StoreClient.connect(address, token=TOKEN) as c:
        first = await next_generation(c, "stressjob")
        await c.delete_prefix("stressjob/")
        second = await next_generation(c, "stressjob")
    return {"generation_after_delete_prefix": f"{first} -> {second}"}


SCAN_KEYS = 100_000
SCAN_REQUESTS = 400


async def attack_scans(address: str) -> dict[str, object]:
    async with await StoreClient.connect(address, token=TOKEN) as c:
        for i in range(SCAN_KEYS):
            await c.set(f"fill{i}", b"", ack=False)
        await c.flush()
        await asyncio.sleep(0.5)
        reader, writer = await raw(address, token=TOKEN)
        frames: FrameReader[ServerMessage] = FrameReader(ServerMessage)  # type: ignore[arg-type]
        t = time.perf_counter()
        writer.write(b"".join(encode_frame(Gather(rid, f"zz{rid}", 0))
                              for rid in range(1, SCAN_REQUESTS + 1)))
        for _ in range(SCAN_REQUESTS):
            await _next(reader, frames)
        took = time.perf_counter() - t
        writer.close()
        await c.delete_prefix("fill")
    return {"scanning_requests": SCAN_REQUESTS, "keys": SCAN_KEYS,
            "scans_took_s": round(took, 2)}


# --- driver --------------------------------------------------------------------------------


def run_loop(loop_name: str, seconds: float, only: set[str] | None
             ) -> dict[str, dict[str, object]]:
    server = subprocess.Popen([sys.executable, __file__, "--serve", loop_name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None
    address = server.stdout.readline().strip()
    # The server logs (rate-limited) to stderr; read it so that a full pipe never blocks it.
    log_lines: list[str] = []
    threading.Thread(target=lambda: log_lines.extend(server.stderr or ()), daemon=True).start()
    try:
        results = asyncio.run(_attacks(address, server.pid, seconds, only))
    finally:
        server.terminate()
        server.wait()
    results["server_log"] = {"lines": len(log_lines),
                             "tracebacks": sum("Traceback" in line for line in log_lines)}
    return results


async def _attacks(address: str, pid: int, seconds: float, only: set[str] | None
                   ) -> dict[str, dict[str, object]]:
    # idle first: RSS growth is only seen on pages the process had not touched before
    attacks: dict[str, Callable[[], Awaitable[dict[str, object]]]] = {
        "baseline": lambda: asyncio.sleep(seconds, {}),
        "idle": lambda: attack_idle(address, pid),
        "waiters": lambda: attack_waiters(address),
        "output": lambda: attack_output(address),
        "gather": lambda: attack_gather(address, pid),
        "fd_flood": lambda: attack_fd_flood(address, seconds),
        "partial": lambda: attack_partial(address),
        "guess": lambda: attack_guess(address, seconds),
        "backlog": lambda: attack_backlog(address),
        "counter": lambda: attack_counter(address),
        "scans": lambda: attack_scans(address),
    }
    results: dict[str, dict[str, object]] = {}
    for name, attack in attacks.items():
        if only is not None and name not in only:
            continue
        sampler = Sampler(pid)
        good = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--legit", address, str(seconds),
            stdout=asyncio.subprocess.PIPE)
        await asyncio.sleep(0.2)  # let the legit client start its loop
        figures = await attack()
        out, _ = await good.communicate()
        figures.update(sampler.stop())
        try:
            figures.update(json.loads(out.decode() or "{}"))
        except json.JSONDecodeError:
            figures["legit"] = out.decode()[:80]
        figures["fds_after"] = _fds(pid)
        results[name] = figures
        await asyncio.sleep(0.5)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", default="both", choices=["asyncio", "uvloop", "both"])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of timed attacks")
    parser.add_argument("--attacks", help="comma-separated attacks to run (default: all)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--legit", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.legit:
        legit(args.legit[0], float(args.legit[1]))
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    loops = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
    only = set(args.attacks.split(",")) if args.attacks else None
    table = {name: run_loop(name, args.seconds, only) for name in loops}
    attacks = list(table[loops[0]])
    for attack in attacks:
        print(f"\n{attack}")
        keys = list(dict.fromkeys(k for name in loops for k in table[name][attack]))
        for key in keys:
            cells = "".join(f"{_fmt(table[name][attack].get(key)):>22}" for name in loops)
            print(f"  {key:<32}{cells}")
    print("\ncolumns: " + ", ".join(loops))
    print(json.dumps(table))


def _fmt(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
