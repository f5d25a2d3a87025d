"""The local world itself: results and exceptions per rank, hangs with stacks, restarts,
events, a function the ranks cannot import."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from m2n_async.testing import LocalWorld, WorldHangError, process_counts

from ._ranks import (
    awaits_forever_on,
    counts_into,
    hangs_on,
    notices_a_freeze,
    raises_from_a_class_only_it_has,
    raises_one_that_does_not_unpickle,
    raises_while_stacks_are_taken,
    returns_rank,
    tells,
)

World = Callable[[int, int], LocalWorld]


def test_every_rank_returns_or_raises(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    assert world.run(returns_rank).values == [0, 1, 2, 3]
    res = world.run(returns_rank, per_rank=lambda r: {"fail_on": 2})
    assert [r.status for r in res] == ["ok", "ok", "error", "ok"]
    assert isinstance(res[2].error, ValueError) and "rank 2 fails" in res[2].traceback
    assert [r.role for r in res] == ["trainer", "trainer", "worker", "worker"]
    with pytest.raises(AssertionError, match=r"ranks 2 \(error"):
        _ = res.values


def test_a_cause_the_test_process_cannot_unpickle_keeps_the_error(m2n_world: World) -> None:
    # Only the cause is replaced (by a RuntimeError with its text): the error stays itself.
    res = m2n_world(1, 1).run(raises_from_a_class_only_it_has)
    for r in res:
        assert isinstance(r.error, ValueError) and f"rank {r.rank} failed" in str(r.error)
        cause = r.error.__cause__
        assert isinstance(cause, RuntimeError) and "the rank's own error" in str(cause)
        assert "did not unpickle in the test process" in str(cause)


def test_a_hang_is_reported_with_every_stuck_ranks_stacks(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    with pytest.raises(WorldHangError) as info:
        world.run(hangs_on, kwargs={"rank": 1}, timeout=2.0)
    assert list(info.value.stacks) == [1]
    assert "hangs_on" in info.value.stacks[1]  # the rank function's frame, by faulthandler
    assert world.run(returns_rank).values == [0, 1, 2, 3]  # the killed rank was replaced


def test_a_rank_stuck_on_an_await_shows_where_its_task_waits(m2n_world: World) -> None:
    # faulthandler shows its loop's thread in select(); the task dump shows the await.
    world = m2n_world(1, 1)
    with pytest.raises(WorldHangError) as info:
        world.run(awaits_forever_on, kwargs={"rank": 1}, timeout=2.0)
    stacks = info.value.stacks[1]
    assert "task(s) of the event loop" in stacks and "_waits_forever" in stacks, stacks


def test_restart_replaces_one_rank_and_events_reach_the_test(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    before = world.run(tells).values
    world.wait_event("hello", timeout=5)
    world.restart(3)
    after = world.run(tells).values
    assert after[:3] == before[:3] and after[3] != before[3]


def test_a_function_the_ranks_cannot_import_is_an_error_not_a_dead_pool(
        m2n_world: World) -> None:
    world = m2n_world(2, 2)
    res = world.run("no_such_module_here:fn", timeout=20)
    assert {r.status for r in res} == {"error"}
    assert all(isinstance(r.error, ModuleNotFoundError) for r in res)


def test_a_wait_for_an_event_that_never_comes_keeps_the_results(m2n_world: World) -> None:
    world = m2n_world(1, 1)
    run = world.start(returns_rank)
    with pytest.raises(AssertionError, match="no 'never' event"):
        world.wait_event("never", timeout=3.0)  # the results arrive meanwhile, and are shown
    assert world.collect(run, timeout=20).values == [0, 1]  # and still collected


def test_a_run_its_test_gave_up_on_does_not_hold_up_the_next(m2n_world: World) -> None:
    # A test that fails between start and collect leaves its job running; the next run on
    # the same (session) world replaces the processes still in it, instead of queueing
    # behind them until its timeout with the previous run's stacks.
    world = m2n_world(1, 1)
    world.start(hangs_on, kwargs={"rank": 0})
    with pytest.raises(AssertionError):
        world.wait_event("never", timeout=1.0)  # the test's own check fails here
    assert world.run(returns_rank, timeout=60).values == [0, 1]


def test_stacks_of_a_frozen_rank_leave_it_frozen(m2n_world: World, tmp_path: Path) -> None:
    world = m2n_world(1, 1)
    path = str(tmp_path / "counter")
    run = world.start(counts_into, kwargs={"path": path, "rank": 1})
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    world.freeze(1)
    time.sleep(0.2)
    assert "Current thread" in world.stacks(1)  # just looking
    a = Path(path).read_text()
    time.sleep(0.5)
    b = Path(path).read_text()
    world.restart(0)
    world.restart(1)
    del run
    assert a == b, f"rank 1 runs again after stacks(): its counter went {a} -> {b}"


def test_a_rank_that_raised_while_stacks_were_taken_is_not_reported_killed(
        m2n_world: World) -> None:
    world = m2n_world(1, 2)
    stacks = world.pool._stacks_path(1)
    res = world.run(raises_while_stacks_are_taken, kwargs={"stacks": stacks}, fail_grace=1,
                    timeout=60)
    assert [r.status for r in res] == ["error", "killed", "error"], [r.status for r in res]
    assert "second" in str(res[2].error)


def test_close_frees_the_worlds_threads_and_fds() -> None:
    # After close(), with the world object still referenced (a fixture, a framework): the
    # job queues' feeder threads and the processes' spawn pipes are gone too.
    with LocalWorld(1, 1) as warm:  # multiprocessing's resource tracker, first imports
        warm.run(returns_rank, timeout=60)
    before = process_counts()
    world = LocalWorld(1, 1)
    world.run(returns_rank, timeout=60)
    world.close()
    after = process_counts()
    # None left behind (a thread of an earlier test may end meanwhile: fewer is fine)
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)


def test_an_external_store_needs_its_token() -> None:
    with pytest.raises(ValueError, match="needs that store's token"):
        LocalWorld(1, 1, store_address="127.0.0.1:1")


class _ReprRaises(Exception):
    def __repr__(self) -> str:  # reads state this error does not have
        return f"_ReprRaises({self.detail})"  # type: ignore[attr-defined]


def test_a_cause_whose_repr_raises_does_not_lose_the_error() -> None:
    import pickle

    from m2n_async.testing._world import _error_pickle

    try:
        raise ValueError("the real error") from _ReprRaises("cause")
    except ValueError as exc:
        err, tb = pickle.loads(_error_pickle(exc, "tb"))
    assert isinstance(err, ValueError) and str(err) == "the real error"
    assert type(err.__cause__) is _ReprRaises and tb == "tb"


def test_an_error_that_does_not_unpickle_says_why(m2n_world: World) -> None:
    # A test expecting the class gets a RuntimeError; its text says why (not only the repr).
    res = m2n_world(1, 1).run(raises_one_that_does_not_unpickle)
    for r in res:
        assert isinstance(r.error, RuntimeError)
        assert f"rank {r.rank} failed" in str(r.error)
        assert "did not pickle in the rank" in str(r.error) and "what" in str(r.error)


def test_a_rank_frozen_from_outside_after_its_run_does_not_hold_up_the_next(
        m2n_world: World) -> None:
    # Frozen once its run ended: still alive, so no "dead" replacement; the next run
    # replaces it instead of waiting out its timeout on a process that never takes the job.
    world = m2n_world(1, 1)
    assert world.run(returns_rank).values == [0, 1]
    world.freeze(1)
    assert world.run(returns_rank, timeout=20).values == [0, 1]


def test_a_rank_frozen_from_outside_comes_back_killed_at_fail_grace(m2n_world: World) -> None:
    # Its stacks are taken before it is killed, which lets it run a moment: what it does
    # then (here: raise) is no result of its own, and it stays "killed", as documented.
    world = m2n_world(1, 1)
    run = world.start(notices_a_freeze, kwargs={"rank": 1})
    world.wait_event("ready", timeout=30)
    world.freeze(1)
    res = world.collect(run, timeout=30, fail_grace=0.5)
    assert res[0].status == "error"
    assert res[1].status == "killed", (res[1].status, res[1].error)
    assert "notices_a_freeze" in res[1].stacks
    assert world.run(returns_rank, timeout=20).values == [0, 1]


def test_a_wait_for_an_event_fails_as_soon_as_every_rank_ended(m2n_world: World) -> None:
    world = m2n_world(1, 1)
    run = world.start(returns_rank, per_rank=lambda r: {"fail_on": 1})
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="every process of the job ended") as info:
        world.wait_event("never", timeout=30)
    assert time.monotonic() - t0 < 15  # not the whole timeout
    text = str(info.value)
    assert "rank 0: returned 0" in text and "rank 1: raised ValueError('rank 1 fails')" in text
    assert 'in returns_rank' in text  # the first error's traceback
    assert world.collect(run, timeout=20)[1].status == "error"
