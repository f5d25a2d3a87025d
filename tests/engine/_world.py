"""A reusable pool of spawned rank processes plus a TCP store, for the engine tests.

Spawning a process that imports torch costs seconds on a 2-core machine, so the processes are
started once per test session and reused across cases: the parent sends each process a job
(a module-level coroutine function of ``tests/engine/_scenarios.py`` and its keyword
arguments); each job runs in a fresh event loop and reports its result or exception. A killed
process is replaced on the next use. The store runs in a thread of the test process.
(multiprocessing pickles jobs here: that is the test harness, not the library's wire.)
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

TOKEN = "engine-tests-secret"


def _child(index: int, jobs: Any, results: Any, events: Any) -> None:
    import importlib

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    while True:
        job = jobs.get()
        if job is None:
            return
        job_id, name, kwargs = job
        module, _, fn_name = name.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), fn_name)
            call = functools.partial(fn, **dict(kwargs, _events=events, _index=index))
            value = anyio.run(call)
            results.put((job_id, index, "ok", value))
        except BaseException as exc:
            try:
                results.put((job_id, index, "err", (exc, traceback.format_exc())))
            except Exception:  # unpicklable: send the text
                results.put((job_id, index, "err", (RuntimeError(repr(exc)),
                                                    traceback.format_exc())))


class RankPool:
    """``size`` spawned processes; ``run`` gives job k to process k."""

    def __init__(self, size: int) -> None:
        self._ctx = mp.get_context("spawn")
        self.results = self._ctx.Queue()
        # scenarios -> test: ("name", index, payload). One queue per process: a process
        # killed while its feeder thread holds a queue's lock would wedge a shared queue.
        self._events: list[Any] = [None] * size
        self._procs: list[Any] = [None] * size
        self._jobs: list[Any] = [None] * size
        self._job_id = 0
        for i in range(size):
            self._start(i)

    def _start(self, i: int) -> None:
        self._jobs[i] = self._ctx.Queue()
        self._events[i] = self._ctx.Queue()
        p = self._ctx.Process(target=_child,
                              args=(i, self._jobs[i], self.results, self._events[i]),
                              daemon=True)
        p.start()
        self._procs[i] = p

    def pid(self, i: int) -> int:
        return int(self._procs[i].pid)

    def kill(self, i: int) -> None:
        os.kill(self.pid(i), signal.SIGKILL)
        self._procs[i].join(10)

    def ensure_alive(self) -> None:
        for i, p in enumerate(self._procs):
            if not p.is_alive():
                self._start(i)

    def submit(self, jobs: Sequence[tuple[str, dict[str, Any]]]) -> int:
        self.ensure_alive()
        for q in self._events:
            self._drain(q)
        self._job_id += 1
        for i, (name, kwargs) in enumerate(jobs):
            self._jobs[i].put((self._job_id, name, kwargs))
        return self._job_id

    def collect(self, job_id: int, n: int, timeout: float,
                expect_dead: Sequence[int] = ()) -> list[tuple[str, Any]]:
        """Results of ``n`` jobs (index order); a killed process's slot is ("dead", None)."""
        out: dict[int, tuple[str, Any]] = {i: ("dead", None) for i in expect_dead}
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i in range(n) if i not in out]
                for i in missing:  # a hung rank: kill it so the pool stays usable
                    if self._procs[i].is_alive():
                        self.kill(i)
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s")
            try:
                jid, index, kind, value = self.results.get(timeout=min(left, 0.5))
            except queue.Empty:
                for i in range(n):
                    if i not in out and not self._procs[i].is_alive():
                        out[i] = ("dead", None)
                continue
            if jid == job_id:
                out[index] = (kind, value)
        return [out[i] for i in range(n)]

    def run(self, jobs: Sequence[tuple[str, dict[str, Any]]], timeout: float = 60.0
            ) -> list[tuple[str, Any]]:
        return self.collect(self.submit(jobs), len(jobs), timeout)

    def wait_event(self, name: str, timeout: float) -> tuple[int, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {name!r} event within {timeout} s; results so far: "
                                     f"{self._peek_results()}")
            for q in self._events:
                try:
                    ev, index, payload = q.get(timeout=0.05)
                except queue.Empty:
                    continue
                if ev == name:
                    return index, payload

    def _peek_results(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    @staticmethod
    def _drain(q: Any) -> None:
        while True:
            try:
                q.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        for i, p in enumerate(self._procs):
            if p is not None and p.is_alive():
                self._jobs[i].put(None)
        for p in self._procs:
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()


@contextmanager
def store_thread() -> Iterator[str]:
    """A ``StoreServer`` on 127.0.0.1 in a background thread; yields its address."""
    from m2n_async._store import StoreServer

    ready: queue.Queue[str | BaseException] = queue.Queue()
    stop: list[Any] = []

    async def serve() -> None:
        try:
            async with StoreServer("127.0.0.1", 0, token=TOKEN) as server:
                done = anyio.Event()
                stop.append((anyio.lowlevel.current_token(), done))
                ready.put(server.address)
                await done.wait()
        except BaseException as exc:
            ready.put(exc)
            raise

    t = threading.Thread(target=lambda: anyio.run(serve), daemon=True)
    t.start()
    got = ready.get(timeout=30)
    if isinstance(got, BaseException):
        raise got
    try:
        yield got
    finally:
        token, done = stop[0]
        anyio.from_thread.run_sync(done.set, token=token)
        t.join(10)
