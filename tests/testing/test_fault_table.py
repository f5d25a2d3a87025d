"""Every row of docs/testing.md's table of fault actions, handshake and round, in a 1 + 2
world: what every rank raises, checked with ``assert_same_failure``'s full comparison (one
class, one text, one culprit, cause, phase and round).

Rank 1 (a worker) is the faulty one, but for a round hang on rank 2 (the last worker); short
deadlines keep a case a few seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from m2n_async import (
    PeerLostError,
    PhaseTimeoutError,
    PreflightError,
    StoreError,
    TransferError,
)
from m2n_async.testing import (
    Fault,
    LocalWorld,
    WorldResult,
    assert_committed,
    assert_not_committed,
    assert_same_failure,
)

from ._ranks import toy_rank
from .test_faults import FAST, World

BAD = 1


def _run(world: LocalWorld, fault: Fault, per_rank: Callable[[int], dict[str, Any]] | None
         = None) -> WorldResult:
    return world.run(toy_rank, kwargs={"config": FAST}, per_rank=per_rank, faults=[fault],
                     timeout=40)


def _handshake(action: str, phase: str, **kw: Any) -> Fault:
    return Fault("handshake.phase", action, rank=BAD, phase=phase, **kw)  # type: ignore[arg-type]


def _bucket(action: str, **kw: Any) -> Fault:
    return Fault("round.bucket", action, rank=BAD, round=1, bucket=0, **kw)  # type: ignore[arg-type]


def test_handshake_raise(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _handshake("raise", "source"))
    exc = assert_same_failure(res, PreflightError, culprit=BAD, phase="source")
    assert "InjectedFault: injected fault at handshake.phase" in str(exc)
    # On the faulty rank it is raised from the InjectedFault, and the chain survives the
    # trip to the test process.
    assert type(res[BAD].error.__cause__).__name__ == "InjectedFault", res[BAD].traceback
    assert_not_committed(res, 1)


def test_handshake_hang_is_the_hung_ranks_failure_even_when_its_deadline_passes_first(
        m2n_world: World) -> None:
    # The race forced: the hung rank's phase deadline passes 0.3 s before its peers' (in a
    # job, by the milliseconds it saw the previous phase end earlier). It reports its own
    # overrun before it gives up, so nobody sees it lost, nobody waits out a deadline.
    def earlier(r: int) -> dict[str, Any]:
        return {"config": {**FAST, "phase_timeout": 2.7}} if r == BAD else {}

    res = _run(m2n_world(1, 2), _handshake("hang", "data_plane"), per_rank=earlier)
    exc = assert_same_failure(res, PreflightError, culprit=BAD, phase="data_plane")
    assert f"rank {BAD}: local step failed: TimeoutError: did not finish within 2.03 s (the " \
           "phase deadline of 2.7 s less 0.675 s to report it)" in str(exc)


def test_handshake_freeze_times_out_naming_the_frozen_rank(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _handshake("freeze", "destination"))
    assert res[BAD].status == "frozen"
    exc = assert_same_failure(res, PhaseTimeoutError, culprit=BAD, phase="destination")
    assert isinstance(exc, TimeoutError)  # what code that predates the subclass catches
    assert str(exc).startswith("preflight phase 'destination' (generation ")
    assert f"rank(s) [{BAD}] did not arrive" in str(exc)


def test_handshake_die_is_peer_lost_naming_the_rank(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _handshake("die", "source"))
    assert res[BAD].status == "dead"
    exc = assert_same_failure(res, PeerLostError, culprit=BAD)
    assert str(exc).startswith("preflight phase 'source' (generation ")


def test_handshake_disconnect_is_peer_lost_naming_the_rank(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _handshake("disconnect", "source"))
    assert res[BAD].status == "error" and isinstance(res[BAD].error, StoreError)
    assert "severed: injected fault at handshake.phase" in str(res[BAD].error)
    exc = assert_same_failure(res, PeerLostError, culprit=BAD, ranks=[0, 2])
    assert str(exc).startswith("preflight phase 'source' (generation ")


def test_round_disconnect_is_lost_naming_the_rank(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _bucket("disconnect"))
    own = res[BAD].error
    assert isinstance(own, TransferError) and own.cause == "store", repr(own)
    exc = assert_same_failure(res, TransferError, culprit=BAD, cause="lost", round=1,
                              ranks=[0, 2])
    assert f"first failure on rank {BAD} (worker) (lost)" in str(exc)
    assert_not_committed(res, 1)


def test_handshake_slow_within_the_deadline_changes_nothing(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _handshake("slow", "hello", seconds=0.5))
    assert [r.value["versions"] for r in res] == [[1]] * 3
    assert_committed(res, 1)


def test_handshake_cancel_is_peer_lost_naming_the_rank(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _handshake("cancel", "runtime_ready"))
    assert isinstance(res[BAD].error, asyncio.CancelledError)  # the caller's own cancel
    exc = assert_same_failure(res, PeerLostError, culprit=BAD, ranks=[0, 2])
    assert str(exc).startswith("preflight phase 'runtime_ready' (generation ")


@pytest.mark.parametrize("action,cause", [("raise", "error"), ("hang", "deadline"),
                                          ("freeze", "deadline"), ("die", "lost"),
                                          ("cancel", "cancelled")])
def test_round(m2n_world: World, action: str, cause: str) -> None:
    res = _run(m2n_world(1, 2), _bucket(action))
    others = [0, 2] if action == "cancel" else None  # the cancelled rank: its CancelledError
    exc = assert_same_failure(res, TransferError, culprit=BAD, cause=cause, round=1,
                              ranks=others)
    assert f"first failure on rank {BAD} (worker) ({cause})" in str(exc)
    assert_not_committed(res, 1)


@pytest.mark.parametrize("inflight", [3, 1], ids=["buckets-in-flight", "more-buckets"])
@pytest.mark.parametrize("point,bucket", [("round.start", None), ("round.bucket", 0)])
def test_a_round_hang_on_the_last_worker_names_it(m2n_world: World, point: str,
                                                  bucket: int | None, inflight: int) -> None:
    # The trainer's ops to the healthy worker queued behind its blocked wait on the hung one
    # read "not completed" until waited; with more buckets than in flight, the healthy
    # worker waits on the trainer, which waits on the hung one. Either way the hung worker
    # is named, not the healthy one nor the trainer.
    where: dict[str, Any] = {"round": 1} if bucket is None else {"round": 1, "bucket": bucket}
    res = m2n_world(1, 2).run(toy_rank, kwargs={"config": {**FAST, "max_inflight": inflight}},
                              faults=[Fault(point, "hang", rank=2, **where)],  # type: ignore[arg-type]
                              timeout=40)
    exc = assert_same_failure(res, TransferError, culprit=2, cause="deadline", round=1)
    assert "first failure on rank 2 (worker) (deadline)" in str(exc)


def test_round_slow_within_the_deadline_changes_nothing(m2n_world: World) -> None:
    res = _run(m2n_world(1, 2), _bucket("slow", seconds=0.5))
    assert_committed(res, 1)
