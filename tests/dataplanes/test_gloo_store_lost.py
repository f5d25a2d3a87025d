"""The Gloo lane's connect when the store fails under it: the store's own error, not a group.

While a rank waits for the Gloo group to be built or for its pair check (``_build_watched``),
a task watches the peers' liveness keys in the store. When that watch fails because the
store connection broke, connect must raise what the store raised (or the build's
``TransferError`` quoting it), never anyio's bare ``ExceptionGroup``, whose text says nothing.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
import torch

from m2n_async._data._native import NativeThread
from m2n_async._data._transport import (
    Rendezvous,
    TransportContext,
    TransportSettings,
    create_transport,
)
from m2n_async._data.gloo import GlooTransport
from m2n_async._proto.errors import StoreError
from m2n_async.testing import MemoryStore

from ._world import DATA_PREFIX, make_plan

pytestmark = pytest.mark.asyncio

BROKEN = "store at 127.0.0.1:1 closed the connection"


class BreakingWatch:
    """A store session whose liveness watch (the wait on ``<prefix>never``) fails as a
    broken connection does, after ``after`` seconds."""

    def __init__(self, inner: Any, after: float) -> None:
        self._inner, self._after = inner, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def wait(self, keys: Any, **kw: Any) -> None:
        if keys and keys[0].endswith("never"):
            await anyio.sleep(self._after)
            raise StoreError(BROKEN)
        await self._inner.wait(keys, **kw)


async def test_a_store_lost_while_connecting_raises_the_stores_error(monkeypatch) -> None:
    # Rank 1's pair check is held, so rank 0 waits in its own check for rank 1 when its watch
    # fails (or still in the build on a slow box: then the build's TransferError quotes it).
    check = GlooTransport._check_pairs

    def held(self: GlooTransport, *a: Any) -> Any:
        if self.ctx.rank == 1:
            time.sleep(1.5)
        return check(self, *a)

    monkeypatch.setattr(GlooTransport, "_check_pairs", held)
    plan = make_plan([("p", (12, 6), torch.float32, None, None)], (1, 1), (1, 1))
    store = MemoryStore()
    setup = store.session()
    for r in range(2):
        await setup.set(f"alive/{r}", b"1")
    settings = TransportSettings(max_inflight=2, device="cpu", host="127.0.0.1")
    errors: dict[int, BaseException] = {}

    async def rank(r: int) -> None:
        native = NativeThread(f"test-r{r}")
        t = create_transport("gloo", TransportContext(
            plan=plan, rank=r, generation=1, settings=settings, native=native,
            buckets=plan.buckets(1 << 12)))
        try:
            await t.prepare()
            session = store.session()
            await t.connect(Rendezvous(BreakingWatch(session, 0.3) if r == 0 else session,
                                       DATA_PREFIX, rank=r, world_size=2, timeout=10.0,
                                       watch=("alive/0", "alive/1")))
        except Exception as exc:
            errors[r] = exc
            t.abort(f"rank {r}: {exc}")
        finally:
            with anyio.CancelScope(shield=True):
                await t.close()
            native.close(5.0)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(rank, r)
    err = errors.get(0)
    assert err is not None, "rank 0 connected although its store watch failed"
    assert not isinstance(err, BaseExceptionGroup), repr(err)
    assert BROKEN in str(err), repr(err)
