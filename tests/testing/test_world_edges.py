"""The world where its processes misbehave or the test process is odd: a rank that hangs while
starting, acting on a rank whose process is gone or still starting, a pool that fails part
way through starting, a test process without stdout or stderr, a rank killed while its job
was still being written to it."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from m2n_async.testing import LocalWorld, RankExitedError, RankPool

from ._ranks import hangs_on, returns_rank

World = Callable[[int, int], LocalWorld]
REPO = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a user's script (its own main module, as spawn re-imports it)."""
    path = tmp_path / "my_script.py"
    path.write_text(textwrap.dedent(body))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    # The bound only keeps a regression from stalling the suite (the world's default wait
    # for a start is 120 s); every wait the script makes is shorter.
    return subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90)


# -- a rank that hangs while starting --------------------------------------------------------


def test_a_rank_that_hangs_while_starting_fails_the_run_at_the_ready_deadline(
        tmp_path: Path) -> None:
    # Alive yet never ready: code at the script's top level that waits, in every rank.
    proc = _script(tmp_path, """
        import multiprocessing as mp
        import sys
        import time

        from m2n_async.testing import LocalWorld, RankStartError, RankStartTimeout

        def wait_for_the_license_server():
            print("waiting for the license server", file=sys.stderr, flush=True)
            time.sleep(600)

        if mp.current_process().name != "MainProcess":
            wait_for_the_license_server()

        async def fn(ctx):
            return ctx.rank

        if __name__ == "__main__":
            with LocalWorld(1, 1, ready_timeout=2.0) as world:
                try:
                    world.run(fn, timeout=60)
                except RankStartTimeout as exc:
                    assert isinstance(exc, RankStartError)
                    print("ranks", exc.ranks, "waited", exc.waited, "rank", exc.rank)
                    print("outputs", exc.outputs)
                    print("stacks", all("wait_for_the_license_server" in exc.stacks[r]
                                        for r in exc.ranks))
                    print(exc)
                else:
                    print("no error")
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "ranks (0, 1) waited 2.0 rank 0", proc.stdout[-3000:]
    assert lines[1] == ("outputs {0: 'waiting for the license server', "
                        "1: 'waiting for the license server'}")
    assert lines[2] == "stacks True", proc.stdout[-3000:]
    assert "ranks [0, 1] were not ready for a job within 2.0 s" in proc.stdout
    assert "--- rank 1 ---" in proc.stdout and "in wait_for_the_license_server" in proc.stdout
    assert 'if __name__ == "__main__":' in proc.stdout


def test_the_ready_deadline_is_a_positive_number() -> None:
    with pytest.raises(ValueError, match="ready_timeout"):
        RankPool(1, ready_timeout=0)


# -- acting on a rank whose process is gone or still starting --------------------------------


@pytest.mark.parametrize("act", ["freeze", "stacks"])
def test_acting_on_a_rank_whose_process_exited_says_so(m2n_world: World, act: str) -> None:
    world = m2n_world(1, 1)
    world.run(returns_rank, timeout=60)
    world.kill(1)
    with pytest.raises(RankExitedError, match=r"rank 1's process exited \(killed by signal "
                       r"9\)") as info:
        getattr(world, act)(1)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
    assert world.run(returns_rank, timeout=60).values == [0, 1]  # replaced, as before


def test_killing_a_rank_whose_process_is_gone_signals_nothing(
        m2n_world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world = m2n_world(1, 1)
    world.run(returns_rank, timeout=60)
    world.kill(0)  # killed and reaped: its pid is free for any new process to take
    sent: list[tuple[int, int]] = []
    real_kill = os.kill

    def recording_kill(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", recording_kill)
    world.kill(0)
    monkeypatch.undo()
    assert sent == []
    assert world.run(returns_rank, timeout=60).values == [0, 1]


def test_a_rank_restarted_in_the_middle_of_a_run_is_dead_in_its_results(
        m2n_world: World) -> None:
    world = m2n_world(1, 1)
    run = world.start(hangs_on, kwargs={"rank": 1})
    world.restart(1)
    # Its fresh process never gets this run's job: collect must not wait for its result.
    res = world.collect(run, timeout=30)
    assert [r.status for r in res] == ["ok", "dead"], res
    assert res[1].exitcode == -signal.SIGKILL
    assert world.run(returns_rank, timeout=60).values == [0, 1]


def test_the_stacks_of_a_rank_still_starting_leave_it_running(m2n_world: World) -> None:
    world = m2n_world(1, 1)
    world.restart(0)  # a fresh process, importing torch for a while yet
    pid = world.pool.pid(0)
    text = world.stacks(0)
    # Its stack dump handler is not installed yet: SIGUSR1 would have ended it.
    assert world.pool.alive(0) and world.pool.pid(0) == pid, text
    assert world.run(returns_rank, timeout=60).values == [0, 1]
    assert world.pool.pid(0) == pid  # the same process took the job


# -- a pool that fails part way through starting ---------------------------------------------


def test_a_pool_that_fails_to_start_a_process_stops_those_it_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    real_spawn = RankPool._spawn

    def spawn_two_then_fail(self: RankPool, p: Any, i: int) -> None:
        if i == 2:
            raise OSError("no more processes")
        real_spawn(self, p, i)
        started.append(p.pid)

    monkeypatch.setattr(RankPool, "_spawn", spawn_two_then_fail)
    try:
        with pytest.raises(OSError, match="no more processes"):
            RankPool(3)
        assert len(started) == 2
        for pid in started:  # killed and reaped by the pool: no child of ours by that pid
            with pytest.raises(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    finally:
        for pid in started:  # a regression must not leave them running
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


# -- a test process without stdout or stderr -------------------------------------------------


@pytest.mark.parametrize("fd", [1, 2])
def test_a_world_starts_in_a_process_whose_stdout_or_stderr_is_closed(tmp_path: Path,
                                                                       fd: int) -> None:
    report = tmp_path / "report.txt"
    proc = _script(tmp_path, """
        import os
        import sys

        import m2n_async.testing._world as _world
        from m2n_async.testing import LocalWorld

        async def fn(ctx):
            print(f"rank {ctx.rank} prints", flush=True)  # to nowhere, without failing
            print(f"rank {ctx.rank} warns", file=sys.stderr, flush=True)
            return ctx.rank

        if __name__ == "__main__":
            fd, report = int(sys.argv[1]), sys.argv[2]
            os.close(fd)
            with LocalWorld(1, 1) as world:
                values = world.run(fn, timeout=60).values

            def is_closed():
                try:
                    os.fstat(fd)
                    return "closed no"
                except OSError:
                    return "closed"

            out = [str(values), is_closed()]
            try:
                LocalWorld(1, 1, ready_timeout=0)  # fails after its store started
            except ValueError:
                out.append(is_closed())

            def no_store(token):
                raise OSError("no port")

            _world.store_thread = no_store
            try:
                LocalWorld(1, 1)
            except OSError:
                out.append(is_closed())
            with open(report, "w") as f:
                f.write(" ".join(out))
        """, str(fd), str(report))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # The toolkit leaves it closed, after a world and after one that failed to start.
    assert report.read_text() == "[0, 1] closed closed closed"


# -- a rank killed while its job was still being written to it -------------------------------


async def takes_a_blob(*, blob: bytes, **_: Any) -> int:
    return len(blob)


def test_closing_a_pool_whose_process_died_before_taking_its_job_returns() -> None:
    pool = RankPool(1)
    assert pool.run([(takes_a_blob, {"blob": b""})], timeout=60) == [("ok", 0)]
    # Far more than a pipe holds: the queue's feeder thread is still writing it when the
    # process is killed, and nobody will ever read the rest.
    pool.submit([(takes_a_blob, {"blob": b"x" * (64 << 20)})])
    os.kill(pool.pid(0), signal.SIGKILL)
    closer = threading.Thread(target=pool.close, daemon=True)
    closer.start()
    closer.join(60)  # a bound for a regression only: close takes well under a second
    assert not closer.is_alive(), "close() waits for a job nobody will read"


def test_a_closed_world_closes_again_quietly_and_refuses_to_run() -> None:
    world = LocalWorld(1, 1)
    run = world.start(returns_rank)
    world.close()
    world.close()  # as a with-block's end after an explicit close
    for call in (lambda: world.run(returns_rank, timeout=60), lambda: world.stacks(0),
                 lambda: world.collect(run, timeout=60), lambda: world.kill(0),
                 lambda: world.wait_event("x", timeout=60), lambda: list(world.events(run))):
        with pytest.raises(RuntimeError, match="this pool is closed"):
            call()


# -- a wait that could never end -------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda w: w.run(returns_rank, timeout=math.nan),
    lambda w: w.run(returns_rank, timeout=-1.0),
    lambda w: w.run(returns_rank, fail_grace=math.nan),
    lambda w: w.collect(w.start(returns_rank), timeout=math.nan),
    lambda w: list(w.events(w.start(returns_rank), timeout=math.nan)),
    lambda w: w.wait_event("never", timeout=math.nan),
], ids=["run", "run-negative", "fail_grace", "collect", "events", "wait_event"])
def test_a_timeout_that_is_nan_or_negative_is_refused(m2n_world: World,
                                                      call: Callable[[LocalWorld], Any]) -> None:
    world = m2n_world(1, 1)
    failure: list[BaseException] = []

    def attempt() -> None:
        try:
            call(world)
        except BaseException as exc:
            failure.append(exc)

    # NaN compares false with every deadline: a regression spins forever, in this thread.
    waiting = threading.Thread(target=attempt, daemon=True)
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive(), "the wait never ends"
    assert len(failure) == 1 and isinstance(failure[0], ValueError), failure
    assert "is seconds >= 0" in str(failure[0])
    assert world.run(returns_rank, timeout=60).values == [0, 1]


def test_closing_a_pool_kills_a_process_still_starting_rather_than_wait_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = RankPool(1)  # its process imports torch for a while yet: it would stop only then
    killed: list[int] = []
    real_kill = RankPool.kill

    def recording_kill(self: RankPool, i: int) -> None:
        killed.append(i)
        real_kill(self, i)

    monkeypatch.setattr(RankPool, "kill", recording_kill)
    pool.close()
    assert killed == [0]
