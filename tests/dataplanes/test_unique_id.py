"""The GPU lanes' unique id over the fake runtime: rank 0 publishes it with its SHA-256 and the
generation, every rank checks both before ``Communicator.init`` (DESIGN §5, ``connected``)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from m2n_async._data._native import NativeThread
from m2n_async._data._transport import (
    Rendezvous,
    Transport,
    TransportContext,
    TransportSettings,
    create_transport,
)
from m2n_async._proto.errors import RemoteProtocolError
from m2n_async.testing import MemoryStore

from . import fake_nccl
from ._world import R, make_plan

pytestmark = pytest.mark.asyncio


class _Tampering:
    """A store session that flips the last byte of every value it writes (the unique id's
    envelope ends with the id): what a damaged or replaced store value looks like."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def set(self, key: str, value: bytes, **kw: Any) -> None:
        await self._inner.set(key, value[:-1] + bytes([value[-1] ^ 0xFF]), **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def _connect_all(tamper: bool) -> dict[int, BaseException | None]:
    plan = make_plan([("w", (8,), torch.float32, (R, 0), (R, 0))], (1, 1), (1, 1))
    settings = TransportSettings(max_inflight=1, device="cpu")
    store = MemoryStore()
    outcome: dict[int, BaseException | None] = {}

    async def rank(r: int) -> None:
        native = NativeThread(f"uid-r{r}")
        t: Transport = create_transport(
            "nccl", TransportContext(plan=plan, rank=r, generation=7, settings=settings,
                                     native=native, buckets=plan.buckets(1 << 20)))
        session: Any = store.session()
        if tamper and r == 0:
            session = _Tampering(session)
        try:
            await t.prepare()
            await t.connect(Rendezvous(session, "j/7/data/nccl/", rank=r, world_size=2,
                                       timeout=10))
            outcome[r] = None
        except Exception as exc:
            outcome[r] = exc
            t.abort(f"connect failed: {exc!r}")
        finally:
            with anyio.CancelScope(shield=True):
                await t.close()
            await anyio.to_thread.run_sync(native.close, 5.0)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(rank, r)
    return outcome


async def test_every_rank_inits_with_rank_0s_id(fake_world: fake_nccl.FakeWorld) -> None:
    assert await _connect_all(tamper=False) == {0: None, 1: None}
    uids = {c.uid for c in fake_world.comms}
    assert len(fake_world.comms) == 2 and len(uids) == 1
    assert len(next(iter(uids))) == 128  # the id itself, not its envelope


async def test_a_corrupted_id_fails_the_connect_naming_rank_0(
        fake_world: fake_nccl.FakeWorld) -> None:
    outcome = await _connect_all(tamper=True)
    assert outcome[0] is None  # rank 0 uses the id it made
    err = outcome[1]
    assert isinstance(err, RemoteProtocolError), err
    assert "rank 0's unique id does not match its SHA-256" in str(err)
    assert "generation 7" in str(err)
    assert [c.rank for c in fake_world.comms] == [0]  # rank 1 never joined with a bad id
