"""The store part of ``connect`` is bounded: an address that accepts the TCP connection and
then says nothing (a wrong port, a stalled server) fails with ``TimeoutError`` naming the
address and the bound, instead of holding the connect for good."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import anyio
import pytest
import torch

from m2n_async import EngineConfig, TrainerEngine, WorkerEngine
from m2n_async._proto.layout import Layout, Mesh
from m2n_async._proto.params import ParamSpec


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A listening socket that never accepts explicitly nor sends: the kernel completes the
    TCP handshake (backlog), so the client connects and then waits for the challenge."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        yield f"127.0.0.1:{srv.getsockname()[1]}"


SPEC = ParamSpec("w", "float32", (4, 4), Layout(Mesh((1, 1)), None))


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ["trainer", "worker"])
@pytest.mark.parametrize("bound", ["timeout", "phase_timeout"])
async def test_a_silent_store_address_fails_connect_in_bounded_time(
        silent_address: str, role: str, bound: str) -> None:
    cfg = EngineConfig(transport="gloo", phase_timeout=1.0 if bound == "phase_timeout" else 60)
    timeout = 1.0 if bound == "timeout" else None
    t0 = time.monotonic()
    with anyio.fail_after(30):  # the old behaviour: no bound at all
        with pytest.raises(TimeoutError) as info:
            if role == "trainer":
                await TrainerEngine.connect(params=[SPEC], address=silent_address, token="t",
                                            rank=0, trainer_ranks=1, world_size=2,
                                            config=cfg, timeout=timeout)
            else:
                await WorkerEngine.connect(
                    targets={"w": (torch.zeros(4, 4), None)}, address=silent_address,
                    token="t", rank=1, trainer_ranks=1, world_size=2, mesh_dims=(1, 1),
                    config=cfg, timeout=timeout)
    assert time.monotonic() - t0 < 20
    msg = str(info.value)
    assert silent_address in msg and "within 1 s" in msg, msg
    assert ("timeout=" if bound == "timeout" else "EngineConfig.phase_timeout") in msg, msg


@pytest.mark.asyncio
async def test_a_connect_past_its_timeout_names_the_step_and_the_ranks_missing() -> None:
    # The caller's bound, shorter than a phase's: not anyio's bare TimeoutError, but what
    # was under way and which ranks never joined (a PhaseTimeoutError, as a phase's).
    from m2n_async import PhaseTimeoutError
    from m2n_async.testing import MemoryStore

    cfg = EngineConfig(transport="gloo", phase_timeout=60)
    with anyio.fail_after(30), pytest.raises(PhaseTimeoutError) as info:
        await TrainerEngine.connect(params=[SPEC], store=MemoryStore().session(), rank=0,
                                    trainer_ranks=1, world_size=3, config=cfg, timeout=0.5)
    exc = info.value
    assert exc.ranks == (1, 2) and exc.phase == "hello", exc  # the handshake's phase
    msg = str(exc)
    assert "within its timeout of 0.5 s" in msg and "rank(s) [1, 2]" in msg, msg
    assert "in the handshake" in msg, msg
    assert type(exc.__cause__) is TimeoutError  # anyio's, kept as the cause


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ["trainer", "worker"])
async def test_a_world_size_past_the_largest_job_is_refused_at_once(role: str) -> None:
    # 2**70 ranks would build a liveness key per rank on the loop, past every timeout.
    from m2n_async import LocalProtocolError
    from m2n_async._engine._engine import MAX_WORLD_SIZE
    from m2n_async.testing import MemoryStore

    huge = 2**70
    with anyio.fail_after(5), pytest.raises(LocalProtocolError, match=f"<= {MAX_WORLD_SIZE}"):
        if role == "trainer":
            await TrainerEngine.connect(params=[SPEC], store=MemoryStore().session(), rank=0,
                                        trainer_ranks=1, world_size=huge)
        else:
            await WorkerEngine.connect(targets={"w": (torch.zeros(4, 4), None)},
                                       store=MemoryStore().session(), rank=1,
                                       trainer_ranks=1, world_size=huge, mesh_dims=(1, 1))
