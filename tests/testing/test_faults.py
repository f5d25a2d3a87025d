"""Every fault point, driven through a real 2 + 2 world of processes, and the assertions
(including that they fail when the contract is broken).

Short deadlines keep each case a few seconds long on a 2-core host.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import pytest

from m2n_async import PeerLostError, PreflightError, TransferError
from m2n_async._engine import _faults
from m2n_async.testing import (
    Fault,
    InjectedFault,
    LocalWorld,
    RankResult,
    WorldResult,
    assert_committed,
    assert_not_committed,
    assert_same_failure,
)

from ._ranks import toy_rank

World = Callable[[int, int], LocalWorld]
FAST = {"phase_timeout": 3.0, "round_timeout": 2.0, "abort_grace": 1.0}


def _run(world: LocalWorld, *faults: Fault, rounds: int = 1, timeout: float = 30.0
         ) -> WorldResult:
    return world.run(toy_rank, kwargs={"rounds": rounds, "config": FAST}, faults=faults,
                     timeout=timeout)


def test_points_are_off_by_default_and_match_only_their_coordinates() -> None:
    assert _faults.armed is False  # nothing armed in a plain process: each point is one read
    f = Fault("round.bucket", "die", rank=3, round=1, bucket=0)
    assert f.matches("round.bucket", {"rank": 3, "round": 1, "bucket": 0})
    assert not f.matches("round.bucket", {"rank": 3, "round": 1, "bucket": 1})
    assert not f.matches("round.start", {"rank": 3, "round": 1})
    assert Fault.from_json(f.to_json()) == f
    with pytest.raises(ValueError, match="unknown fault point"):
        Fault("round.middle")
    with pytest.raises(ValueError, match="synchronous"):
        Fault("round.commit", "hang")


def test_handshake_raise_is_one_preflight_error_naming_the_rank(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("handshake.phase", "raise", rank=1, phase="source"))
    exc = assert_same_failure(res, PreflightError, culprit=1, phase="source")
    assert "injected fault" in str(exc)
    assert_not_committed(res, 1)


def test_handshake_hang_is_one_preflight_error_naming_the_rank(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("handshake.phase", "hang", rank=2, phase="destination"))
    # The hung rank reports its own overrun before the deadline, so it raises it too.
    exc = assert_same_failure(res, PreflightError, culprit=2, phase="destination")
    assert "local step failed: TimeoutError: did not finish within" in str(exc)


def test_handshake_die_is_peer_lost_naming_the_rank(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("handshake.phase", "die", rank=3, phase="data_plane"))
    assert res[3].status == "dead"
    exc = assert_same_failure(res, PeerLostError, culprit=3)
    assert "preflight phase 'data_plane'" in str(exc) and "rank 3 was lost" in str(exc)
    # Who saw it, and in which call of its group, stays with each rank, as a note.
    assert [res[r].error.__notes__[0].startswith(f"seen by rank {r}:") for r in (0, 1, 2)
            ] == [True] * 3


def test_a_worker_dying_at_a_bucket_is_lost_and_a_replacement_joins(m2n_world: World
                                                                      ) -> None:
    world = m2n_world(2, 2)
    res = _run(world, Fault("round.bucket", "die", rank=3, round=1, bucket=1))
    assert res[3].status == "dead" and res[3].faults[0][0] == "round.bucket"
    assert res[3].signal == signal.SIGKILL  # the fault's own kill, in the exit code
    assert_same_failure(res, TransferError, culprit=3, cause="lost", round=1)
    assert_not_committed(res, 1)
    # The same job again: a replacement process for rank 3, a new generation for everyone.
    again = world.run(toy_rank, kwargs={"config": FAST}, job=world.job, timeout=30)
    assert [v["versions"] for v in again.values] == [[1]] * 4


def test_a_frozen_trainer_is_named_at_the_deadline(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("round.bucket", "freeze", rank=1, round=1, bucket=0))
    assert res[1].status == "frozen"
    assert_same_failure(res, TransferError, culprit=1, cause="deadline")
    assert_not_committed(res, 1)


def test_a_cancel_at_a_bucket_is_named_cancelled(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("round.bucket", "cancel", rank=2, round=1, bucket=1))
    assert isinstance(res[2].error, asyncio.CancelledError)  # the caller's own cancel
    assert_same_failure(res, TransferError, culprit=2, cause="cancelled", ranks=[0, 1, 3])
    assert_not_committed(res, 1)


def test_a_slow_bucket_still_commits(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("round.bucket", "slow", rank=0, bucket=0, seconds=0.3,
                                      times=2), rounds=2)
    assert [r.value["versions"] for r in res] == [[1, 2]] * 4
    assert_committed(res, 2)
    assert len(res[0].faults) == 2
    with pytest.raises(AssertionError, match="version 2 was committed on ranks"):
        assert_not_committed(res, 2)
    with pytest.raises(AssertionError, match="did not raise"):
        assert_same_failure(res)


def test_a_rank_frozen_between_rounds_keeps_the_first_version(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("round.start", "freeze", rank=3, round=2), rounds=2)
    assert_committed(res, 1)
    assert_same_failure(res, TransferError, culprit=3, cause="deadline", round=2)
    assert_not_committed(res, 2)
    with pytest.raises(AssertionError, match="culprit is 3, expected 2"):
        assert_same_failure(res, TransferError, culprit=2)
    with pytest.raises(AssertionError, match="not PreflightError"):
        assert_same_failure(res, PreflightError)


def test_a_raise_at_round_start_is_that_ranks_error(m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("round.start", "raise", rank=0, round=1))
    assert_same_failure(res, TransferError, culprit=0, cause="error", round=1)


def test_a_raise_at_round_commit_is_raised_as_is_after_every_rank_committed(
        m2n_world: World) -> None:
    res = _run(m2n_world(2, 2), Fault("round.commit", "raise", rank=3, round=1))
    assert type(res[3].error) is InjectedFault, res[3].error  # itself, not a group
    assert "injected fault at round.commit" in str(res[3].error)
    assert_committed(res, 1)  # the commit came first, on every rank
    assert [res[r].value["versions"] for r in (0, 1, 2)] == [[1]] * 3


def test_the_assertion_sees_ranks_that_disagree() -> None:
    def failed(rank: int, culprit: int) -> RankResult:
        return RankResult(rank, "trainer" if rank < 2 else "worker", "error",
                          error=TransferError("round 1 failed", rank=culprit, cause="lost",
                                              round=1))

    res = WorldResult([failed(0, 3), failed(1, 3), failed(2, 0), RankResult(3, "worker",
                                                                             "dead")])
    with pytest.raises(AssertionError, match="ranks differ in culprit") as info:
        assert_same_failure(res, TransferError)
    assert "rank 2 (worker): error TransferError(rank=0" in str(info.value)  # the table
    assert_same_failure(res, TransferError, culprit=3, ranks=[0, 1])


def test_the_assertion_shows_where_an_unexpected_error_was_raised() -> None:
    # The integration's own bug on one rank: the report carries that rank's traceback.
    tb = 'Traceback (most recent call last):\n  File "integ.py", line 9, in my_rank\n'
    res = WorldResult([
        RankResult(0, "trainer", "error", error=TransferError("round 1 failed", rank=1,
                                                              cause="error", round=1)),
        RankResult(1, "worker", "error", error=KeyError("lm_head"), traceback=tb)])
    with pytest.raises(AssertionError, match="rank 1 raised KeyError") as info:
        assert_same_failure(res, TransferError)
    assert "rank 1's traceback:" in str(info.value) and "in my_rank" in str(info.value)


def test_a_fault_for_a_rank_outside_the_world_is_refused(m2n_world: World) -> None:
    with pytest.raises(ValueError, match="rank 7 is outside this world of 3 ranks"):
        _run(m2n_world(1, 2), Fault("round.bucket", "raise", rank=7, round=1))


def test_a_fault_that_fired_on_no_rank_is_a_warning(m2n_world: World) -> None:
    # Bucket 99 of a one-bucket plan: the run succeeds, and says the fault tested nothing.
    with pytest.warns(UserWarning, match="fired on no rank in this run"):
        res = _run(m2n_world(1, 2), Fault("round.bucket", "raise", rank=1, round=1,
                                          bucket=99))
    assert all(r.status == "ok" for r in res)
