"""Watching a run as it goes and ending it fast: live events, the first-failure grace, exit
codes, and processes that cannot wedge one another (each talks over a pipe of its own)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from m2n_async.testing import LocalWorld, RankEvent, WorldHangError

from ._ranks import (
    dies_holding_queue_locks,
    fails_while_others_hang,
    returns_rank,
    stops_halfway_through_a_message,
    tells_then_hangs,
    ticks_then_waits,
)

World = Callable[[int, int], LocalWorld]


def test_events_come_while_the_ranks_run_and_end_with_the_run(m2n_world: World,
                                                              tmp_path: Path) -> None:
    world = m2n_world(2, 2)
    flag = str(tmp_path / "answer")
    run = world.start(ticks_then_waits, kwargs={"flag": flag})
    seen: list[RankEvent] = []
    for ev in world.events(run, timeout=60):
        seen.append(ev)
        if ev.name == "asked":  # rank 0 waits for this answer: only a live event gets it
            Path(flag).touch()
    assert world.collect(run, timeout=30).values == [0, 1, 2, 3]  # the iteration ended them
    for r in range(4):
        assert [e.payload for e in seen if e.rank == r and e.name == "tick"] == [0, 1, 2]
    assert [e for e in seen if e.name == "asked"] == [RankEvent(0, "asked", None)]
    # A run without events: the iteration just ends with it.
    run = world.start(returns_rank)
    assert list(world.events(run, timeout=60)) == []
    assert world.collect(run, timeout=30).values == [0, 1, 2, 3]


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_after_the_first_failure_the_others_get_the_grace_then_are_killed(
        m2n_world: World, how: str) -> None:
    world = m2n_world(2, 2)
    # Without the grace this would wait out the timeout and raise WorldHangError.
    res = world.run(fails_while_others_hang, kwargs={"culprit": 2, "how": how},
                    timeout=120, fail_grace=1.0)
    if how == "raise":
        assert res[2].status == "error" and isinstance(res[2].error, ValueError)
        assert res[2].exitcode is None  # its process lives on for the next run
    else:
        assert res[2].status == "dead" and res[2].exitcode == 3 and res[2].signal is None
    assert res.ranks("killed") == [0, 1, 3]
    for r in (0, 1, 3):
        assert res[r].signal == signal.SIGKILL and res[r].exitcode == -signal.SIGKILL
        assert "fails_while_others_hang" in res[r].stacks  # where it was, from faulthandler
    assert world.run(returns_rank).values == [0, 1, 2, 3]  # every killed rank was replaced


def test_a_failure_only_the_test_sees_starts_the_grace(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    run = world.start(tells_then_hangs, kwargs={"rank": 1, "event": "wrong"})
    names = []
    for ev in world.events(run, timeout=120, fail_grace=0.5):
        names.append(ev.name)
        world.mark_failed()  # the test judges the run failed from the event
    res = world.collect(run, timeout=120, fail_grace=0.5)
    assert names == ["wrong"]
    assert [r.status for r in res] == ["ok", "killed", "ok", "ok"]
    assert "tells_then_hangs" in res[1].stacks


def test_a_hang_reports_every_ranks_result_too(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    with pytest.raises(WorldHangError) as info:
        world.run(tells_then_hangs, kwargs={"rank": 3, "event": "hello"}, timeout=5.0)
    res = info.value.results
    assert [r.status for r in res] == ["ok", "ok", "ok", "killed"]
    assert res[3].stacks == info.value.stacks[3] and res[3].signal == signal.SIGKILL


def test_a_rank_killed_from_outside_comes_back_with_its_signal(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    run = world.start(tells_then_hangs, kwargs={"rank": 0, "event": "ready"})
    world.wait_event("ready", timeout=60)
    world.kill(0)
    res = world.collect(run, timeout=60)
    assert [r.status for r in res] == ["dead", "ok", "ok", "ok"]
    assert res[0].exitcode == -signal.SIGKILL and res[0].signal == signal.SIGKILL


def test_a_rank_dying_with_every_queue_lock_held_silences_no_other(m2n_world: World,
                                                                   tmp_path: Path) -> None:
    world = m2n_world(2, 2)
    # A result queue shared by every process would stay locked: no other result could come.
    res = world.run(dies_holding_queue_locks, timeout=60,
                    kwargs={"rank": 1, "flag": str(tmp_path / "locked")})
    assert [r.status for r in res] == ["ok", "dead", "ok", "ok"]
    assert res[1].exitcode == 3
    assert [r.value for r in res if r.ok] == [0, 2, 3]
    assert world.run(returns_rank).values == [0, 1, 2, 3]


def test_a_rank_stopped_halfway_through_a_message_wedges_nothing(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    # The parent must never block on the half message: the others' results still come,
    # and the stopped rank is a hang like any other (stacks, then killed).
    with pytest.raises(WorldHangError) as info:
        world.run(stops_halfway_through_a_message, kwargs={"rank": 2}, timeout=5.0)
    res = info.value.results
    assert [r.status for r in res] == ["ok", "ok", "killed", "ok"]
    assert "stops_halfway_through_a_message" in res[2].stacks
    assert world.run(returns_rank).values == [0, 1, 2, 3]
    assert os.path.isdir(world.pool._dir)  # its stacks files stay until the world closes
