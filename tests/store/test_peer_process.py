"""A peer in a separate process is killed with SIGKILL while others wait on it.

No clean shutdown runs in the victim: the kernel closes its socket, the server ends its
session, and every waiter watching its liveness key gets ``PeerLostError`` at once — not a
timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import anyio
import pytest
from store_helpers import TOKEN, RunningServer, wait_ready

from m2n_async import ControlGroup, PeerLostError, StoreClient

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

VICTIM = """
import sys, anyio
from m2n_async import ControlGroup, StoreClient

async def main(address, token):
    client = await StoreClient.connect(address, token=token)
    group = ControlGroup(client, 1, 3, "job/1/g")
    await group.join()
    await client.set("victim/alive", b"", ephemeral=True)
    print("READY", flush=True)
    await anyio.sleep_forever()

anyio.run(main, sys.argv[1], sys.argv[2])
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
async def test_sigkilled_peer_fails_waiters_fast() -> None:
    runner = RunningServer()
    server = await runner.start()
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        async with await anyio.open_process(
                [sys.executable, "-c", VICTIM, server.address, TOKEN], env=env) as proc:
            await wait_ready(proc)
            a = await StoreClient.connect(server.address, token=TOKEN)
            b = await StoreClient.connect(server.address, token=TOKEN)
            groups = [ControlGroup(a, 0, 3, "job/1/g"), ControlGroup(b, 2, 3, "job/1/g")]
            for g in groups:
                await g.join()
            failures: dict[str, tuple[PeerLostError, float]] = {}

            async def plain_wait() -> None:
                try:
                    await a.get("victim/result", wait=True, watch=["victim/alive"])
                except PeerLostError as exc:
                    failures["plain"] = (exc, time.monotonic())

            async def collective(g: ControlGroup) -> None:
                try:
                    await g.all_gather_bytes(b"mine")
                except PeerLostError as exc:
                    failures[f"rank{g.rank}"] = (exc, time.monotonic())

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(plain_wait)
                    for g in groups:
                        tg.start_soon(collective, g)
                    await anyio.sleep(0.2)  # everyone is blocked on the victim
                    assert failures == {}
                    t_kill = time.monotonic()
                    proc.send_signal(signal.SIGKILL)
            await proc.wait()
            assert sorted(failures) == ["plain", "rank0", "rank2"]
            assert failures["plain"][0].key == "victim/alive"
            for name in ("rank0", "rank2"):
                exc = failures[name][0]
                assert exc.ranks == (1,), exc
                assert "rank 1" in str(exc)
            latency = max(t for _, t in failures.values()) - t_kill
            # Well under a second on loopback (typically a few ms); generous for busy CI.
            assert latency < 2.0, f"PeerLostError took {latency:.3f} s after SIGKILL"
            print(f"\nPeerLostError on all waiters {latency * 1000:.1f} ms after SIGKILL")
            await a.aclose()
            await b.aclose()
    finally:
        await runner.stop()
