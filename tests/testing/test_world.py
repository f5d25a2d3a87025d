"""The local world itself: results and exceptions per rank, hangs with stacks, restarts,
events, a function the ranks cannot import."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from m2n_async.testing import LocalWorld, WorldHangError

from ._ranks import hangs_on, returns_rank, tells

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


def test_a_hang_is_reported_with_every_stuck_ranks_stacks(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    with pytest.raises(WorldHangError) as info:
        world.run(hangs_on, kwargs={"rank": 1}, timeout=2.0)
    assert list(info.value.stacks) == [1]
    assert "hangs_on" in info.value.stacks[1]  # the rank function's frame, by faulthandler
    assert world.run(returns_rank).values == [0, 1, 2, 3]  # the killed rank was replaced


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
