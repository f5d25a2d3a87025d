"""Blocking engines that are never closed: collected, or still open at interpreter exit.

A ``BlockingTrainer``/``BlockingWorker`` dropped without ``close()`` warns (``ResourceWarning``
naming it) and is closed off the collecting thread: its engine reaches CLOSED, its peers are
told why, and its event loop thread ends. A connect started and never waited for is
cancelled the same way. One closed by its owner warns nothing. A process that exits with
engines still open closes them and exits. Waits here are deadlines on polls, never sleeps.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from m2n_async import (
    BlockingTrainer,
    BlockingWorker,
    EngineState,
    Layout,
    Mesh,
    ParamSpec,
    PeerLostError,
    SyncResult,
)

from ._world import TOKEN
from .test_blocking import CFG, SHAPE, _full, _pair

DEADLINE = 30.0  # generous: the machine is small and shared; a pass takes well under a second
NEVER_CLOSED = "was never closed"


def _until(what: str, done: Callable[[], bool]) -> None:
    # Polls with a collection each time: nothing here may depend on when a collector runs.
    end = time.monotonic() + DEADLINE
    while not done():
        if time.monotonic() > end:
            pytest.fail(f"{what}: not within {DEADLINE} s")
        gc.collect()
        time.sleep(0.02)


def _gone(thread: threading.Thread) -> Callable[[], bool]:
    def check() -> bool:
        return all(t is not thread for t in threading.enumerate())
    return check


def _loop_thread(engine: BlockingTrainer | BlockingWorker) -> threading.Thread:
    return engine.portal.call(threading.current_thread)


def _messages(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record
            if issubclass(w.category, ResourceWarning) and NEVER_CLOSED in str(w.message)]


def test_a_collected_pair_warns_closes_its_engines_and_stops_its_loops(
        store_address: str) -> None:
    trainer, worker, target = _pair(store_address, "blocking-gc-pair")
    with ThreadPoolExecutor(1) as ex:  # one round first: the engines really work
        got = ex.submit(worker.receive)
        trainer.sync_weights({"w": _full(1)})
        assert got.result(30).version == 1
    assert torch.equal(target, _full(1))
    engines = (trainer.engine, worker.engine)  # the async engines do not keep the facades
    threads = (_loop_thread(trainer), _loop_thread(worker))
    assert {t.name for t in threads} == {"m2n-async-trainer0", "m2n-async-worker1"}
    with pytest.warns(ResourceWarning, match=NEVER_CLOSED) as record:
        del trainer, worker, got
        gc.collect()
    messages = _messages(record.list)
    assert any(m.startswith("BlockingTrainer for rank 0 ") for m in messages), messages
    assert any(m.startswith("BlockingWorker for rank 1 ") for m in messages), messages
    for thread in threads:
        _until(f"{thread.name} ends", _gone(thread))
    _until("both engines close", lambda: all(e.state is EngineState.CLOSED for e in engines))


def test_a_collected_trainer_tells_its_workers_why(store_address: str) -> None:
    # Rank 0 dropped mid-job is no end of training: the worker's receive() names the cause
    # instead of ending as if the trainer had closed cleanly.
    trainer, worker, _target = _pair(store_address, "blocking-gc-rank0")
    try:
        thread = _loop_thread(trainer)
        with pytest.warns(ResourceWarning, match="BlockingTrainer for rank 0 .*" + NEVER_CLOSED):
            del trainer
            gc.collect()
        with pytest.raises(PeerLostError, match=NEVER_CLOSED):
            worker.receive(timeout=DEADLINE)
        _until("the trainer's loop thread ends", _gone(thread))
    finally:
        worker.close()


def test_a_facade_dropped_on_its_own_loop_thread_is_closed_from_another(
        store_address: str) -> None:
    # The last reference can go on the loop thread (a callback held it): the close cannot
    # wait there for that very thread, so it must happen elsewhere, and not deadlock.
    trainer, worker, _target = _pair(store_address, "blocking-gc-on-loop")
    try:
        portal, engine, thread = trainer.portal, trainer.engine, _loop_thread(trainer)
        holder = [trainer]
        del trainer
        with pytest.warns(ResourceWarning, match=NEVER_CLOSED):
            portal.call(holder.clear)
        _until("the trainer's loop thread ends", _gone(thread))
        assert engine.state is EngineState.CLOSED
    finally:
        worker.close()


def test_a_connect_never_waited_for_is_cancelled_when_collected(store_address: str) -> None:
    # No worker joins: the connect waits in its handshake until it is dropped.
    spec = ParamSpec("w", torch.float32, SHAPE, Layout(Mesh((1, 1)), None))
    pending = BlockingTrainer.start_connect(
        store_address, token=TOKEN, rank=0, trainer_ranks=1, world_size=2, params=[spec],
        config=dataclasses.replace(CFG, job="blocking-gc-connect"))
    thread = pending._loop.portal.call(threading.current_thread)
    assert not pending.done()
    with pytest.warns(ResourceWarning, match="connect of BlockingTrainer for rank 0 .*"):
        del pending
        gc.collect()
    _until("the connecting loop thread ends", _gone(thread))


def test_an_updates_iterator_dropped_half_way_never_blocks_the_thread_that_drops_it(
        store_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its async generator lives on the worker's loop. The drop (a collection, on any thread)
    # queues its close there; it must not wait for that loop, here held busy on purpose.
    trainer, worker, _target = _pair(store_address, "blocking-gc-updates")
    closed = threading.Event()
    inner = worker.engine.updates

    async def updates() -> AsyncIterator[SyncResult]:
        try:
            async for result in inner():
                yield result
        finally:
            closed.set()

    monkeypatch.setattr(worker.engine, "updates", updates)
    free = threading.Event()
    try:
        holder = [worker.updates()]
        with ThreadPoolExecutor(1) as ex:
            got = ex.submit(next, holder[0])
            trainer.sync_weights({"w": _full(1)})
            assert got.result(DEADLINE).version == 1
        busy = threading.Event()

        async def hold() -> None:  # blocks the loop thread itself: nothing else runs on it
            busy.set()
            free.wait(DEADLINE)

        held = worker.portal.start_task_soon(hold)
        assert busy.wait(DEADLINE)
        dropper = threading.Thread(target=holder.clear)
        dropper.start()
        dropper.join(10.0)  # the drop only queues work: it returns at once
        assert not dropper.is_alive(), "dropping the iterator waited for the busy loop"
        assert not closed.is_set()  # the loop is held: the close waits for it, not the drop
        free.set()
        held.result(DEADLINE)
        _until("the iterator's generator closes on the loop", closed.is_set)
        with ThreadPoolExecutor(1) as ex:  # and the worker goes on
            got = ex.submit(worker.receive)
            trainer.sync_weights({"w": _full(2)})
            assert got.result(DEADLINE).version == 2
    finally:
        free.set()
        trainer.close()
        worker.close()


def test_closed_facades_warn_nothing(store_address: str) -> None:
    trainer, worker, _target = _pair(store_address, "blocking-gc-closed")
    threads = (_loop_thread(trainer), _loop_thread(worker))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with trainer, worker:
            pass
        trainer.close()
        del trainer, worker
        gc.collect()
    assert _messages(record) == []
    for thread in threads:
        assert not thread.is_alive()


def _in_fork(child: Callable[[], bool]) -> None:
    """Run ``child`` in a forked copy of this process; fail unless it returns True there."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest, whatever happens
        code = 1
        try:
            code = 0 if child() else 1
        except BaseException:
            import traceback

            traceback.print_exc()  # the parent sees only the exit status: say why here
        finally:
            os._exit(code)
    end = time.monotonic() + DEADLINE
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed"
            return
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child did not finish within {DEADLINE} s")
        time.sleep(0.02)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_can_connect_while_a_thread_held_the_reaper_lock() -> None:
    # A lock held by another thread at the fork stays held in the child, where that thread
    # does not exist: the child must not wait for it to connect (or to exit).
    from m2n_async import blocking

    held, free = threading.Event(), threading.Event()

    def holder() -> None:
        with blocking._reaper_lock:
            held.set()
            free.wait(DEADLINE)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    try:
        assert held.wait(DEADLINE)

        def child() -> bool:
            blocking._start_reaper()  # as a connect in the child would
            blocking._close_at_exit()  # as the child's exit would
            return True

        _in_fork(child)
    finally:
        free.set()
        thread.join(DEADLINE)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_leaves_the_parents_engines_alone(store_address: str) -> None:
    # The child has none of the parent's loop threads: closing the engines it inherited
    # would wait for a thread that is not there, and they are the parent's to close.
    from m2n_async import blocking

    trainer, worker, _target = _pair(store_address, "blocking-gc-fork")
    try:
        def child() -> bool:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                blocking._start_reaper()  # as a connect in the child would
                blocking._close_at_exit()  # as the child's exit would
                closers = [t for t in threading.enumerate() if t.name == "m2n-async-closer"]
            return not closers and not _messages(record)

        _in_fork(child)
        with ThreadPoolExecutor(1) as ex:  # the parent's engines go on
            got = ex.submit(worker.receive)
            trainer.sync_weights({"w": _full(1)})
            assert got.result(DEADLINE).version == 1
    finally:
        trainer.close()
        worker.close()


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading
    sys.path.insert(0, sys.argv[1])
    from tests.engine._world import store_thread
    from tests.engine.test_blocking import _pair, _full

    engines = []
    # Registered before any engine exists, so it runs after what closes them at exit.
    atexit.register(lambda: print("at exit:", *(e.state.name for e in engines), flush=True))

    store = store_thread()
    address = store.__enter__()
    trainer, worker, target = _pair(address, "blocking-exit")
    engines += [trainer.engine, worker.engine]
    got = []
    t = threading.Thread(target=lambda: got.append(worker.receive()))
    t.start()
    trainer.sync_weights({"w": _full(1)})
    t.join()
    print("round", got[0].version, flush=True)
    # exits with both engines open, the store's thread still serving them
""")


@pytest.mark.slow  # a process of its own: importing torch there takes seconds
def test_engines_left_open_at_exit_are_closed_and_the_process_exits(tmp_path: Path) -> None:
    script = tmp_path / "left_open.py"
    script.write_text(EXIT_SCRIPT)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-W", "always::ResourceWarning", str(script), root],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "round 1" in proc.stdout
    assert "at exit: CLOSED CLOSED" in proc.stdout, proc.stdout
    assert f"BlockingTrainer for rank 0 (job 'blocking-exit', generation 1) {NEVER_CLOSED}" \
        in proc.stderr, proc.stderr
    assert f"BlockingWorker for rank 1 (job 'blocking-exit', generation 1) {NEVER_CLOSED}" \
        in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
