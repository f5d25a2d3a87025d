"""Load callbacks on the GPU lanes (over the FAKE nccl runtime): a callback that raises is
named in the error, one that hangs does not hold the round past its deadline or an abort, and
a callback's shard is a view of the received bucket where it arrives whole (the staging stays
within the bucket's bytes)."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
import torch

from m2n_async._proto.errors import TransferError

from ._world import drive, expected, make_plan, raise_first, run_world, sources

pytestmark = pytest.mark.asyncio

ONE = make_plan([("w.bad", (8, 4), torch.float32, None, None)], (1, 1), (1, 1))


@pytest.mark.parametrize("lane", ["nccl", "m2n"])
async def test_a_callback_that_raises_is_named(fake_world: Any, lane: str) -> None:
    errors: dict[int, BaseException] = {}

    def cb(name: str, tensor: torch.Tensor) -> None:
        raise ValueError("boom")

    async def body(rank: int, t: Any) -> None:
        trainer = rank < ONE.trainer_ranks
        try:
            await drive(t, round=0, deadline=time.monotonic() + 30,
                        sources=sources(ONE, rank) if trainer else None,
                        sinks=None if trainer else {"w.bad": cb}, max_inflight=1)
        except Exception as exc:
            errors[rank] = exc

    raise_first(await run_world(lane, ONE, body=body))
    err = errors[1]
    assert isinstance(err, TransferError) and err.rank == 1 and err.round == 0, repr(err)
    assert "load callback for parameter 'w.bad' raised" in str(err) and "boom" in str(err)
    assert isinstance(err.__cause__, ValueError)


@pytest.mark.parametrize("lane", ["nccl", "m2n"])
async def test_a_hung_callback_does_not_hold_the_round(fake_world: Any, lane: str) -> None:
    # The callback sleeps 3 s; the round's deadline (as the engine's fail_after) is 0.5 s and
    # the watchdog aborts at 0.3 s: the worker must be back well before the callback is.
    took: dict[int, float] = {}

    def cb(name: str, tensor: torch.Tensor) -> None:
        time.sleep(3)

    async def body(rank: int, t: Any) -> None:
        trainer = rank < ONE.trainer_ranks
        t0 = time.monotonic()
        with anyio.move_on_after(0.5):
            async with anyio.create_task_group() as tg:
                if not trainer:
                    async def watchdog() -> None:
                        await anyio.sleep(0.3)
                        t.abort("watchdog")

                    tg.start_soon(watchdog)
                await drive(t, round=0, deadline=time.monotonic() + 0.5,
                            sources=sources(ONE, rank) if trainer else None,
                            sinks=None if trainer else {"w.bad": cb}, max_inflight=1)
        took[rank] = time.monotonic() - t0

    await run_world(lane, ONE, body=body)
    assert took[1] < 2.0, took


async def test_nccl_callbacks_get_views_of_the_bucket(fake_world: Any) -> None:
    # 1 + 1, two whole parameters in one bucket (one packed message): the callbacks get views
    # of the received message, so the staging is the bucket's bytes, not twice them.
    plan = make_plan([("a", (16, 8), torch.float32, None, None),
                      ("b", (16, 8), torch.float32, None, None)], (1, 1), (1, 1))
    got: dict[str, torch.Tensor] = {}
    kept: dict[int, list[Any]] = {}

    def cb(name: str, tensor: torch.Tensor) -> None:
        got[name] = tensor.clone()

    async def body(rank: int, t: Any) -> None:
        trainer = rank < plan.trainer_ranks
        await drive(t, round=0, deadline=time.monotonic() + 30,
                    sources=sources(plan, rank) if trainer else None,
                    sinks=None if trainer else {"a": cb, "b": cb}, max_inflight=1,
                    keep=kept.setdefault(rank, []))

    raise_first(await run_world("nccl", plan, body=body, bucket_bytes=1 << 20))
    assert sorted(got) == ["a", "b"]
    assert all(torch.equal(got[k], v) for k, v in expected(plan, 1).items())
    (st,) = kept[1]
    assert st.nbytes <= st.bucket.nbytes, (st.nbytes, st.bucket.nbytes)
