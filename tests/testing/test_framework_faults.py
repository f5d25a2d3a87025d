"""The toolkit as a framework's tests use it from docs/testing.md: a rank process that ends
before it is ready, the world's own event names, faults that could never fire, fields an
exception lacks, acting on a rank by its number."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from m2n_async import PreflightError, PreflightPhase
from m2n_async.testing import (
    Fault,
    LocalWorld,
    RankContext,
    RankResult,
    assert_committed,
    assert_same_failure,
)

from ._ranks import returns_rank, toy_rank

World = Callable[[int, int], LocalWorld]
REPO = Path(__file__).resolve().parents[2]


# -- a rank process that ends before it is ready ---------------------------------------------


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a user's script (its own main module, as spawn re-imports it)."""
    path = tmp_path / "my_script.py"
    path.write_text(textwrap.dedent(body))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    # The bound only keeps a regression from stalling the suite: the world's own wait for a
    # start is 120 s, so a run that waits for it fails here instead.
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90)


def test_a_rank_that_exits_while_starting_fails_the_run_at_once(tmp_path: Path) -> None:
    # An unguarded statement at the script's top level runs again in each spawned rank.
    proc = _script(tmp_path, """
        import multiprocessing as mp
        import sys

        if mp.current_process().name != "MainProcess":
            print("no config file here", file=sys.stderr)
            sys.exit(3)

        from m2n_async.testing import LocalWorld, RankStartError

        async def fn(ctx):
            return ctx.rank

        with LocalWorld(1, 1) as world:
            try:
                world.run(fn, timeout=60)
            except RankStartError as exc:
                print("rank", exc.rank, "exitcode", exc.exitcode, "output", repr(exc.output))
                print(exc)
            else:
                print("no error")
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("rank ") and "exitcode 3 output 'no config file here'" in first
    assert "exited with code 3 before it was ready" in proc.stdout
    assert "it printed last:\nno config file here" in proc.stdout
    assert 'if __name__ == "__main__":' in proc.stdout


def test_a_script_that_starts_its_world_unguarded_is_told_why(tmp_path: Path) -> None:
    # Each rank re-imports the script, which starts a world of its own: refused there, so
    # the rank exits at once with that reason, and the parent's run names it.
    proc = _script(tmp_path, """
        from m2n_async.testing import LocalWorld, RankStartError

        async def fn(ctx):
            return ctx.rank

        with LocalWorld(1, 1) as world:
            try:
                world.run(fn, timeout=60)
            except RankStartError as exc:
                print("exitcode", exc.exitcode)
                print(exc.output)
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("exitcode 1\n"), proc.stdout[-3000:]
    assert "LocalWorld started while a spawned process imports its parent's main" in proc.stdout


def test_what_a_rank_prints_still_reaches_the_test_process(tmp_path: Path) -> None:
    # A start's output is held back (so that a failed start can be reported with it), then
    # written out once the rank is ready; a job's goes straight to the test's outputs.
    proc = _script(tmp_path, """
        import multiprocessing as mp
        import sys

        from m2n_async.testing import LocalWorld

        if mp.current_process().name != "MainProcess":
            print("starting up", file=sys.stderr)

        async def fn(ctx):
            print(f"out of rank {ctx.rank}", flush=True)
            print(f"err of rank {ctx.rank}", file=sys.stderr, flush=True)
            return ctx.rank

        if __name__ == "__main__":
            with LocalWorld(1, 1) as world:
                print(world.run(fn, timeout=60).values, flush=True)
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "out of rank 0" in proc.stdout and "out of rank 1" in proc.stdout
    assert "[0, 1]" in proc.stdout
    assert proc.stderr.count("starting up") == 2, proc.stderr[-3000:]
    assert "err of rank 0" in proc.stderr and "err of rank 1" in proc.stderr


# -- the world's own event names ------------------------------------------------------------


def test_wait_event_delivers_commits_and_faults(m2n_world: World) -> None:
    world = m2n_world(2, 2)
    slow = Fault("round.start", "slow", rank=2, round=1, seconds=0.0)
    run = world.start(toy_rank, kwargs={"rounds": 1}, faults=[slow])
    assert world.wait_event("commit", rank=3, timeout=60) == (3, 1)
    rank, (point, where, action) = world.wait_event("fault", timeout=60)
    assert (rank, point, where["round"], action) == (2, "round.start", 1, "slow")
    others = sorted(world.wait_event("commit", timeout=60) for _ in range(3))
    assert others == [(0, 1), (1, 1), (2, 1)]  # each commit once, none taken twice
    with pytest.raises(AssertionError, match="no 'commit' event: every process"):
        world.wait_event("commit", timeout=60)  # at once: every rank ended
    res = world.collect(run, timeout=60)
    assert [r.committed for r in res] == [(1,)] * 4  # waiting took nothing from the results
    assert res[2].faults == ((point, where, action),)


@pytest.mark.parametrize("name", ["", 3, None])
def test_wait_event_refuses_a_name_no_rank_can_send(m2n_world: World, name: object) -> None:
    with pytest.raises(ValueError, match="'commit', 'fault'"):
        m2n_world(1, 1).wait_event(name, timeout=1)  # type: ignore[arg-type]


def test_wait_event_refuses_a_rank_outside_the_world(m2n_world: World) -> None:
    with pytest.raises(ValueError, match=r"rank=2\): this world's ranks are 0 \.\. 1"):
        m2n_world(1, 1).wait_event("commit", timeout=1, rank=2)


@pytest.mark.parametrize("name", ["commit", "fault"])
def test_a_rank_cannot_send_the_worlds_own_event_names(name: str) -> None:
    ctx = RankContext(0, 1, 2, "127.0.0.1:1", "token", "job")
    with pytest.raises(ValueError, match="the world's own event names"):
        ctx.event(name, 5)  # it would read as a commit the engine never made


# -- faults that could never fire ----------------------------------------------------------


@pytest.mark.parametrize(("kw", "match"), [
    ({"point": "handshake.phase", "phase": "sorce"},
     r"unknown phase 'sorce': handshake.phase fires in hello, source, destination"),
    ({"point": "handshake.phase", "phase": PreflightPhase.CONNECTED},
     r"unknown phase 'connected'"),
    ({"point": "round.start", "round": 0}, r"round must be an int >= 1 .*got 0"),
    ({"point": "round.bucket", "bucket": -1}, r"bucket must be an int >= 0 .*got -1"),
    ({"point": "round.start", "rank": -1}, r"rank must be an int >= 0 .*got -1"),
    ({"point": "round.start", "rank": True}, r"rank must be an int >= 0 .*got True"),
    ({"point": "round.start", "round": "1"}, r"round must be an int >= 1 .*got '1'"),
    ({"point": "round.start", "bucket": 1},
     r"round.start has no coordinate 'bucket'.*its coordinates: rank, round"),
    ({"point": "round.commit", "phase": "hello"}, r"round.commit has no coordinate 'phase'"),
    ({"point": "handshake.phase", "round": 1}, r"handshake.phase has no coordinate 'round'"),
    ({"point": "round.start", "times": 0}, r"times must be an int >= 1, got 0"),
    ({"point": "round.start", "action": "slow", "seconds": -1.0}, r"seconds must be"),
])
def test_a_fault_that_can_never_fire_is_refused_where_it_is_written(
        kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Fault(**kw)  # type: ignore[arg-type]


def test_a_fault_for_a_rank_outside_the_world_is_refused_at_start(m2n_world: World) -> None:
    with pytest.raises(ValueError, match=r"rank 2 is outside this world of 2 ranks \(0 \.\. 1\)"):
        m2n_world(1, 1).start(returns_rank, faults=[Fault("round.start", rank=2)])


def test_faults_are_a_list(m2n_world: World) -> None:
    # One Fault where a list goes would fail as "not iterable", far from the cause.
    with pytest.raises(TypeError, match=r"a list of Fault"):
        m2n_world(1, 1).start(returns_rank, faults=Fault("round.start"))  # type: ignore[arg-type]


def test_a_preflight_phase_member_is_a_phase_name() -> None:
    fault = Fault("handshake.phase", rank=1, phase=PreflightPhase.SOURCE)
    assert fault == Fault("handshake.phase", rank=1, phase="source")
    assert fault.matches("handshake.phase", {"rank": 1, "phase": "source"})
    assert Fault.from_json(fault.to_json()) == fault  # its JSON form is the name
    res = [RankResult(r, "trainer", "error", error=PreflightError("source", {1: "bad"}))
           for r in range(2)]
    assert_same_failure(res, PreflightError, culprit=1, phase=PreflightPhase.SOURCE)
    with pytest.raises(ValueError, match="unknown phase 'sorce'; phases: hello, source"):
        assert_same_failure(res, PreflightError, phase="sorce")


def test_a_phase_member_fault_fires_in_a_world(m2n_world: World) -> None:
    fault = Fault("handshake.phase", "raise", rank=1, phase=PreflightPhase.SOURCE)
    res = m2n_world(1, 1).run(toy_rank, faults=[fault], timeout=60)
    assert_same_failure(res, PreflightError, culprit=1, phase=PreflightPhase.SOURCE)


# -- the failure contract: what an exception lacks -----------------------------------------


def _raised(*errors: BaseException) -> list[RankResult]:
    return [RankResult(r, "worker", "error", error=e) for r, e in enumerate(errors)]


@pytest.mark.parametrize(("kw", "match"), [
    ({"phase": "hello"}, r"rank 0: ValueError has no `phase` attribute, so its phase cannot be "
                         r"'hello'"),
    ({"culprit": 1}, r"rank 0: ValueError has no `rank`, `failures` or `ranks` attribute"),
    ({"cause": "lost"}, r"ValueError has no `cause` attribute"),
    ({"round": 1}, r"ValueError has no `round` attribute"),
])
def test_assert_same_failure_says_which_field_an_exception_lacks(
        kw: dict[str, object], match: str) -> None:
    res = _raised(ValueError("bad"), ValueError("bad"))
    with pytest.raises(AssertionError, match=match):
        assert_same_failure(res, ValueError, **kw)  # type: ignore[arg-type]
    assert_same_failure(res, ValueError)  # nothing asked of those fields: the same failure


def test_a_field_that_is_there_but_none_is_a_value_not_a_lack() -> None:
    class Blames(Exception):
        rank = None  # the store's failure: nobody to blame

    res = _raised(Blames("x"), Blames("x"))
    assert_same_failure(res, Blames, culprit=None)
    with pytest.raises(AssertionError, match=r"rank 0: culprit is None, expected 1"):
        assert_same_failure(res, Blames, culprit=1)


# -- acting on a rank by its number ----------------------------------------------------------


@pytest.mark.parametrize("act", ["kill", "freeze", "restart", "stacks"])
@pytest.mark.parametrize("rank", [-1, 2, True])
def test_acting_on_a_rank_outside_the_world_is_refused(m2n_world: World, act: str,
                                                       rank: object) -> None:
    world = m2n_world(1, 1)
    # -1 would have been the last rank's process, as a list index.
    with pytest.raises(ValueError, match=r"this world's ranks are 0 \.\. 1"):
        getattr(world, act)(rank)
    assert world.run(returns_rank, timeout=60).values == [0, 1]  # nothing was touched


def test_assert_committed_refuses_ranks_the_results_lack() -> None:
    res = [RankResult(r, "worker", "ok", committed=(1,)) for r in range(2)]
    assert_committed(res, 1, ranks=[0, 1])
    with pytest.raises(AssertionError, match=r"ranks \[5\] are not in the results"):
        assert_committed(res, 1, ranks=[1, 5])  # rank 5 would have passed unchecked


def test_a_fault_in_the_environment_that_can_never_fire_names_the_variable() -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
           "M2N_ASYNC_FAULTS": '[{"point": "round.start", "round": 0}]'}
    proc = subprocess.run([sys.executable, "-c", "import m2n_async._engine._faults"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "M2N_ASYNC_FAULTS=" in proc.stderr and "round must be an int >= 1" in proc.stderr


def test_a_fault_in_the_environment_that_is_no_list_is_named_as_such() -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
           "M2N_ASYNC_FAULTS": '{"point": "round.start"}'}  # one object, not a list of them
    proc = subprocess.run([sys.executable, "-c", "import m2n_async._engine._faults"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "M2N_ASYNC_FAULTS=" in proc.stderr, proc.stderr
    assert "expected a JSON list of fault objects" in proc.stderr, proc.stderr


@pytest.mark.parametrize("how", ["run", "collect"])
def test_the_warning_of_a_fault_that_never_fired_points_at_the_test(m2n_world: World,
                                                                    how: str) -> None:
    world = m2n_world(1, 1)
    never = Fault("round.start", rank=1, round=5)  # returns_rank has no rounds
    with pytest.warns(UserWarning, match="fired on no rank") as seen:
        if how == "run":
            world.run(returns_rank, faults=[never], timeout=60)
        else:
            world.collect(world.start(returns_rank, faults=[never]), timeout=60)
    assert [w.filename for w in seen] == [__file__]  # where -W filters and reports look


def test_every_phase_the_preflight_runs_is_one_a_fault_takes() -> None:
    from m2n_async._engine._preflight import _GATHERING

    for phase in _GATHERING:  # each has a local step, where handshake.phase is hit
        assert Fault("handshake.phase", phase=phase).phase == phase.value
