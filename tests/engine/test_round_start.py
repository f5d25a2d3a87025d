"""A round's start key (``RoundDriver.publish_start`` and ``close_job``, ``Round.start_taken``):
written once, by compare-and-set, so every rank reads the same start. Whichever of trainer
rank 0's round start and its closing start lands first stands; a start another process
wrote fails the round alike on every rank. Two drivers (rank 0 and a worker) over one
``MemoryStore``; no data plane."""

from __future__ import annotations

import anyio
import pytest

from m2n_async import TransferError
from m2n_async._engine._round import JobEnded, RoundDriver
from m2n_async._proto.messages import PROTO_VERSION, RoundStart, decode_as, encode
from m2n_async._store import ControlGroup, next_generation
from m2n_async.testing import MemoryStore

pytestmark = pytest.mark.asyncio

NS = "j/1"


async def drivers() -> tuple[RoundDriver, RoundDriver]:
    store = MemoryStore()
    assert await next_generation(store, "j") == 1
    out = []
    for rank in (0, 1):
        conn = store.session()
        group = ControlGroup(conn, rank, 2, NS)
        await group.join()
        out.append(RoundDriver(store=conn, group=group, namespace=NS, generation=1,
                               rank=rank, world_size=2, trainer_ranks=1, abort_grace=1.0))
    return out[0], out[1]


def start(round_: int = 1, version: int = 1, closing: bool = False) -> RoundStart:
    return RoundStart(PROTO_VERSION, 1, round_, version, 10.0, closing)


async def test_a_published_start_stands_and_close_job_reports_it() -> None:
    rank0, worker = await drivers()
    await rank0.publish_start(start())
    await rank0.publish_start(start())  # the same record again: nothing to disagree about
    # close() beside that sync_weights: the round has begun, the caller must end it.
    assert await rank0.close_job(1, 0, 10.0) is False
    with anyio.fail_after(5):
        got = await worker.wait_start(1, limit=5.0, missed_is_failure=False)
    assert got == start()
    # A closing start already there (a second close): the job is closed either way.
    assert await rank0.close_job(2, 1, 10.0) is True
    assert await rank0.close_job(2, 1, 10.0) is True


async def test_a_start_after_the_closing_start_raises_and_records_nothing() -> None:
    rank0, worker = await drivers()
    assert await rank0.close_job(1, 0, 10.0) is True
    with pytest.raises(TransferError) as info:
        await rank0.publish_start(start())
    err = info.value
    assert (err.rank, err.cause, err.round, err.generation) == (0, "left", 1, 1)
    assert str(err) == ("round 1 of generation 1 failed; first failure on rank 0 (trainer) "
                        "(left): trainer rank 0 closed its engine before round 1 of "
                        "generation 1 started; no rank runs it")
    keys = rank0.core(1).keys
    raw = await rank0.store.get(keys.start)
    assert raw is not None and decode_as(raw, RoundStart).closing  # not overwritten
    assert await rank0.store.get(keys.abort) is None
    with anyio.fail_after(5), pytest.raises(JobEnded, match="closed the job"):
        await worker.wait_start(1, limit=5.0, missed_is_failure=False)


@pytest.mark.parametrize("foreign", [encode(start(version=7)), b"\x00not a start"],
                         ids=["another start", "not a start"])
async def test_a_start_another_process_wrote_fails_the_round_alike_everywhere(
        foreign: bytes) -> None:
    rank0, worker = await drivers()
    await rank0.store.set(rank0.core(1).keys.start, foreign)
    with pytest.raises(TransferError) as info:
        await rank0.publish_start(start())
    err = info.value
    assert (err.rank, err.cause) == (0, "protocol"), err
    assert "trainer rank 0 found the start key of round 1 of generation 1 already" in str(err)
    # The worker reads the same start key, and the record beside it: the same error.
    with anyio.fail_after(5), pytest.raises(TransferError) as seen:
        await worker.wait_start(1, limit=5.0, missed_is_failure=False)
    assert str(seen.value) == str(err) and seen.value.rank == 0
