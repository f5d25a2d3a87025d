"""A local world of trainer and worker ranks: spawned processes, Gloo, a loopback store.

Theory of operation: a test of how a framework's integration fails needs real processes — a
rank that dies must take its sockets with it, a frozen one must keep them — yet spawning a
process that imports torch costs seconds. So ``RankPool`` starts its processes once and
reuses them: the parent sends each process a job (a function and its keyword arguments),
each job runs in a fresh event loop (anyio, asyncio backend) and reports its result or
exception; a process that died is replaced before the next job. ``LocalWorld`` puts a
``StoreServer`` in a thread of the test process and gives each rank a ``RankContext``
(its rank, role, the store's address and token, a fresh job name) to connect with.

Every rank process arms ``m2n_async._engine._faults`` for the job: the faults the test
asked for, plus an observer that sends each committed version to the parent at once (over
the process's own pipe, synchronously, so a rank killed right after a commit still counts).
Outside a world the points cost one global read.

Hangs: ``collect`` waits at most ``timeout`` seconds; a rank that has not reported by then is
asked for its stacks (``faulthandler`` on ``SIGUSR1``, every thread), then killed so the pool
stays usable, and ``WorldHangError`` carries every missing rank's stacks. A rank that froze
itself through a ``freeze`` fault is not a hang: once every other rank reported, it is killed
and reported as ``"frozen"``.

multiprocessing pickles jobs and results here: that is the test harness, not the library's
wire. Exceptions cross as themselves when they pickle (every ``M2NError`` does), otherwise as
a ``RuntimeError`` carrying their ``repr``.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import secrets
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel

from m2n_async._engine import _faults
from m2n_async._engine._faults import Fault

__all__ = ["LocalWorld", "RankContext", "RankPool", "RankResult", "WorldHangError",
           "WorldResult", "store_thread"]

Target = str | Callable[..., Any]
Status = Literal["ok", "error", "dead", "frozen"]


class WorldHangError(AssertionError):
    """Ranks did not finish in time; ``stacks`` maps each to its threads' stacks."""

    def __init__(self, message: str, stacks: Mapping[int, str]) -> None:
        super().__init__(message)
        self.stacks = dict(stacks)


class _Events:
    """The child's end of its event pipe, with the ``put`` of a queue (scenarios call it).

    A pipe, not a queue: ``send`` writes before it returns, so an event sent just before the
    process stops or kills itself reaches the parent (a queue's feeder thread might not)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def put(self, item: tuple[str, int, Any]) -> None:
        self._conn.send(item)


def _resolve(target: Target) -> Callable[..., Any]:
    if callable(target):
        return target
    module, sep, name = target.partition(":")
    if not sep:
        module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _child(index: int, jobs: Any, results: Any, events_conn: Any, stacks_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stacks = open(stacks_path, "w")  # lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch

    torch.set_num_threads(1)
    events = _Events(events_conn)
    while True:
        job = jobs.get()
        if job is None:
            return
        job_id, payload, faults = job

        def observe(point: str, where: Mapping[str, Any], fault: Fault | None) -> None:
            if point == "round.commit":
                events.put(("commit", index, where.get("version")))
            if fault is not None:
                events.put(("fault", index, (point, dict(where), fault.action)))
        try:
            _faults.arm(faults, observe=observe)
            # Unpickled here, not by the queue: a function this process cannot import is
            # this job's error, not the end of the process.
            target, kwargs = pickle.loads(payload)
            fn = _resolve(target)
            call = functools.partial(fn, **dict(kwargs, _events=events, _index=index))
            value = anyio.run(call)
            results.put((job_id, index, "ok", value))
        except BaseException as exc:
            tb = traceback.format_exc()
            try:
                results.put((job_id, index, "err", (exc, tb)))
            except Exception:  # unpicklable: send the text
                results.put((job_id, index, "err", (RuntimeError(repr(exc)), tb)))
        finally:
            _faults.disarm()


class RankPool:
    """``size`` spawned processes; ``submit`` gives job k to process k.

    A job is ``(target, kwargs)``: ``target`` a module-level coroutine function or its
    ``"module:name"``; it is called with ``kwargs`` plus ``_events`` (``.put((name, index,
    payload))`` tells the parent, see ``wait_event``) and ``_index`` (the process's slot).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._ctx = mp.get_context("spawn")
        self.results = self._ctx.Queue()
        self._dir = tempfile.mkdtemp(prefix="m2n-world-")
        self._procs: list[Any] = [None] * size
        self._jobs: list[Any] = [None] * size
        self._events: list[Any] = [None] * size  # parent ends of the event pipes
        self._pending: list[tuple[str, int, Any]] = []  # events read but not yet waited for
        self._notes: dict[int, list[tuple[str, Any]]] = {}  # slot -> commit/fault events
        self._early: list[tuple[int, int, str, Any]] = []  # results read by a failed wait
        self._job_id = 0
        for i in range(size):
            self._start(i)

    def _stacks_path(self, i: int) -> str:
        return os.path.join(self._dir, f"stacks-{i}.txt")

    def _start(self, i: int) -> None:
        self._jobs[i] = self._ctx.Queue()
        parent, child = self._ctx.Pipe(duplex=False)
        self._events[i] = parent
        p = self._ctx.Process(target=_child, args=(i, self._jobs[i], self.results, child,
                                                    self._stacks_path(i)), daemon=True)
        p.start()
        child.close()
        self._procs[i] = p

    def pid(self, i: int) -> int:
        return int(self._procs[i].pid)

    def alive(self, i: int) -> bool:
        return bool(self._procs[i].is_alive())

    def kill(self, i: int) -> None:
        """SIGKILL process ``i`` (a stopped one too) and reap it."""
        try:
            os.kill(self.pid(i), signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._procs[i].join(10)

    def restart(self, i: int) -> None:
        """Replace process ``i`` with a fresh one (killing it first if it is alive)."""
        if self._procs[i] is not None and self._procs[i].is_alive():
            self.kill(i)
        self._start(i)

    def ensure_alive(self) -> None:
        for i, p in enumerate(self._procs):
            if not p.is_alive():
                self._start(i)

    def stacks(self, i: int, wait: float = 0.5) -> str:
        """Every thread's stack of process ``i`` (faulthandler), or why there is none."""
        path = self._stacks_path(i)
        try:
            before = os.path.getsize(path)
            os.kill(self.pid(i), signal.SIGCONT)  # a stopped process cannot dump
            os.kill(self.pid(i), signal.SIGUSR1)
        except (OSError, ProcessLookupError) as exc:
            return f"(no stacks: {exc})"
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if os.path.getsize(path) > before:
                time.sleep(0.05)  # let it finish writing
                break
        with open(path) as f:
            f.seek(before)
            return f.read() or "(no stacks written)"

    def submit(self, jobs: Sequence[tuple[Target, Mapping[str, Any]]],
               faults: Sequence[Fault] = ()) -> int:
        """Start one job per process (job k on process k); return the job's id."""
        if len(jobs) > self.size:
            raise ValueError(f"{len(jobs)} jobs for a pool of {self.size} processes")
        self.ensure_alive()
        self._pump()
        self._pending.clear()
        self._notes.clear()
        self._job_id += 1
        for i, (target, kwargs) in enumerate(jobs):
            payload = pickle.dumps((target, dict(kwargs)))
            self._jobs[i].put((self._job_id, payload, tuple(faults)))
        return self._job_id

    def notes(self, i: int) -> list[tuple[str, Any]]:
        """``("commit", version)`` and ``("fault", (point, where, action))`` of process ``i``
        in the current job, in order."""
        self._pump()
        return list(self._notes.get(i, ()))

    def _pump(self) -> None:
        for conn in self._events:
            try:
                while conn.poll():
                    ev, index, payload = conn.recv()
                    if ev in ("commit", "fault"):
                        self._notes.setdefault(index, []).append((ev, payload))
                    else:
                        self._pending.append((ev, index, payload))
            except (EOFError, OSError):  # the process died: its pipe is closed
                continue

    def _frozen(self, i: int) -> bool:
        return any(ev == "fault" and p[2] == "freeze" for ev, p in self._notes.get(i, ()))

    def collect(self, job_id: int, n: int, timeout: float,
                expect_dead: Sequence[int] = ()) -> list[tuple[str, Any]]:
        """Results of ``n`` jobs (index order): ``("ok", value)``, ``("err", (exc, tb))``,
        ``("dead", None)`` for a process that died (or is in ``expect_dead``) or
        ``("frozen", None)`` for one that froze itself through a fault (then killed).

        Raises ``WorldHangError`` (with every missing rank's stacks, after killing them) if
        some did not finish within ``timeout`` seconds.
        """
        out: dict[int, tuple[str, Any]] = {i: ("dead", None) for i in expect_dead}
        deadline = time.monotonic() + timeout
        while len(out) < n:
            self._pump()
            missing = [i for i in range(n) if i not in out]
            if missing and all(self._frozen(i) for i in missing):
                for i in missing:
                    self.kill(i)
                    out[i] = ("frozen", None)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                stacks = {i: self.stacks(i) for i in missing if self.alive(i)}
                for i in missing:  # a hung rank: kill it so the pool stays usable
                    if self.alive(i):
                        self.kill(i)
                text = "\n".join(f"--- rank {i} ---\n{s}" for i, s in stacks.items())
                raise WorldHangError(f"ranks {missing} did not finish within {timeout} s; "
                                     f"their stacks:\n{text}", stacks)
            try:
                jid, index, kind, value = (self._early.pop(0) if self._early
                                           else self.results.get(timeout=min(left, 0.2)))
            except queue.Empty:
                for i in range(n):
                    if i not in out and not self.alive(i):
                        out[i] = ("dead", None)
                continue
            if jid == job_id:
                out[index] = (kind, value)
        self._pump()
        return [out[i] for i in range(n)]

    def run(self, jobs: Sequence[tuple[Target, Mapping[str, Any]]], timeout: float = 60.0,
            faults: Sequence[Fault] = ()) -> list[tuple[str, Any]]:
        return self.collect(self.submit(jobs, faults), len(jobs), timeout)

    def wait_event(self, name: str, timeout: float) -> tuple[int, Any]:
        """The first ``name`` event of the current job: ``(index, payload)``."""
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            for k, (ev, index, payload) in enumerate(self._pending):
                if ev == name:
                    del self._pending[k]
                    return index, payload
            if time.monotonic() > deadline:
                raise AssertionError(f"no {name!r} event within {timeout} s; results so far: "
                                     f"{self._peek_results()}")
            time.sleep(0.02)

    def _peek_results(self) -> list[Any]:
        """The results that arrived so far, for a message; kept for ``collect`` (a wait
        that failed must not lose them)."""
        while True:
            try:
                self._early.append(self.results.get_nowait())
            except queue.Empty:
                return list(self._early)

    def close(self) -> None:
        for i, p in enumerate(self._procs):
            if p is not None and p.is_alive():
                self._jobs[i].put(None)
        for i, p in enumerate(self._procs):
            if p is not None:
                p.join(5)
                if p.is_alive():
                    self.kill(i)


@contextmanager
def store_thread(token: str) -> Iterator[str]:
    """A ``StoreServer`` on 127.0.0.1 in a background thread; yields its address.

    Cancellation: leaving the block stops the server and joins the thread (10 s at most).
    """
    from m2n_async._store import StoreServer

    ready: queue.Queue[str | BaseException] = queue.Queue()
    stop: list[Any] = []

    async def serve() -> None:
        try:
            async with StoreServer("127.0.0.1", 0, token=token) as server:
                done = anyio.Event()
                stop.append((anyio.lowlevel.current_token(), done))
                ready.put(server.address)
                await done.wait()
        except BaseException as exc:
            ready.put(exc)
            raise

    t = threading.Thread(target=lambda: anyio.run(serve), daemon=True, name="m2n-test-store")
    t.start()
    got = ready.get(timeout=30)
    if isinstance(got, BaseException):
        raise got
    try:
        yield got
    finally:
        token_, done = stop[0]
        anyio.from_thread.run_sync(done.set, token=token_)
        t.join(10)


# -- the world ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankContext:
    """What a rank function gets: who it is and how to reach the job's store.

    ``TrainerEngine.connect(**ctx.connect_kwargs, params=..., config=ctx.config(...))``
    connects rank ``ctx.rank`` to this world's store under this run's job name.
    """

    rank: int
    trainer_ranks: int
    world_size: int
    address: str
    token: str
    job: str
    _events: Any = field(default=None, repr=False, compare=False)

    @property
    def role(self) -> Literal["trainer", "worker"]:
        return "trainer" if self.rank < self.trainer_ranks else "worker"

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainer_ranks

    @property
    def worker_index(self) -> int:
        """This worker's index among the workers (rank - trainer_ranks)."""
        return self.rank - self.trainer_ranks

    @property
    def connect_kwargs(self) -> dict[str, Any]:
        """``rank``, ``trainer_ranks``, ``world_size``, ``address``, ``token``."""
        return {"rank": self.rank, "trainer_ranks": self.trainer_ranks,
                "world_size": self.world_size, "address": self.address, "token": self.token}

    def config(self, **overrides: Any) -> Any:
        """An ``EngineConfig`` for this world: its job name, Gloo, short test deadlines
        (``phase_timeout`` 20 s, ``round_timeout`` 10 s, ``abort_grace`` 2 s) — each
        overridable."""
        from m2n_async import EngineConfig

        kw: dict[str, Any] = {"job": self.job, "transport": "gloo", "phase_timeout": 20.0,
                              "round_timeout": 10.0, "abort_grace": 2.0}
        kw.update(overrides)
        return EngineConfig(**kw)

    def event(self, name: str, payload: Any = None) -> None:
        """Tell the test process (``LocalWorld.wait_event``); ``payload`` must pickle."""
        if self._events is not None:
            self._events.put((name, self.rank, payload))


async def _rank_entry(*, fn: Target, ctx: RankContext, kwargs: Mapping[str, Any],
                      _events: Any = None, _index: int = 0) -> Any:
    ctx = RankContext(ctx.rank, ctx.trainer_ranks, ctx.world_size, ctx.address, ctx.token,
                      ctx.job, _events)
    return await _resolve(fn)(ctx, **kwargs)


@dataclass(frozen=True)
class RankResult:
    """How one rank's function ended.

    ``status``: ``"ok"`` (``value`` is what it returned), ``"error"`` (``error`` is what it
    raised, ``traceback`` its text), ``"dead"`` (the process died) or ``"frozen"`` (it froze
    through a fault and was killed). ``committed``: every version this rank committed, in
    order (known even for a rank that died later). ``faults``: the faults that fired on it,
    as ``(point, where, action)``.
    """

    rank: int
    role: str
    status: Status
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    committed: tuple[int, ...] = ()
    faults: tuple[tuple[str, dict[str, Any], str], ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class WorldResult(tuple[RankResult, ...]):
    """Every rank's ``RankResult``, in rank order."""

    @property
    def values(self) -> list[Any]:
        """Each rank's return value; raises ``AssertionError`` naming the ranks that did not
        return (with the first one's traceback)."""
        bad = [r for r in self if not r.ok]
        if bad:
            first = bad[0]
            raise AssertionError(
                "ranks " + ", ".join(f"{r.rank} ({r.status}: {r.error!r})" for r in bad)
                + f" did not return; rank {first.rank}:\n{first.traceback}")
        return [r.value for r in self]

    def ranks(self, status: Status) -> list[int]:
        return [r.rank for r in self if r.status == status]


class LocalWorld:
    """``trainers`` + ``workers`` rank processes and a TCP store on 127.0.0.1.

    ``run(fn, ...)`` calls ``await fn(ctx, **kwargs)`` on every rank (``ctx`` a
    ``RankContext``; ``fn`` a module-level coroutine function, so that it can be named
    across ``spawn``) and returns a ``WorldResult``. Each run gets a fresh job name, so runs
    never share store keys. The processes are reused across runs; one that died is replaced
    before the next run, and ``restart(rank)`` replaces one at once. ``faults`` arms named
    fault points (``Fault``) in every rank process for that run only.

    Use as a context manager (or call ``close``). Blocking; from an async test use
    ``await world.arun(...)``, which runs it in a worker thread.
    """

    def __init__(self, trainers: int, workers: int, *, store_address: str | None = None,
                 token: str | None = None, job_prefix: str = "world") -> None:
        if trainers < 1 or workers < 1:
            raise ValueError(f"a world needs >= 1 trainer and >= 1 worker, got {trainers} + "
                             f"{workers}")
        self.trainers, self.workers = trainers, workers
        self.token = token or secrets.token_hex(16)
        self._store_cm = None
        if store_address is None:
            self._store_cm = store_thread(self.token)
            store_address = self._store_cm.__enter__()
        self.address = store_address
        self._prefix = job_prefix
        self._runs = 0
        self.pool = RankPool(self.world_size)
        self.job = ""

    @property
    def world_size(self) -> int:
        return self.trainers + self.workers

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()
        if self._store_cm is not None:
            self._store_cm.__exit__(None, None, None)
            self._store_cm = None

    def context(self, rank: int, job: str | None = None) -> RankContext:
        return RankContext(rank, self.trainers, self.world_size, self.address, self.token,
                           job or self.job)

    def start(self, fn: Target, *, kwargs: Mapping[str, Any] | None = None,
              per_rank: Callable[[int], Mapping[str, Any]] | None = None,
              faults: Sequence[Fault] = (), job: str | None = None) -> int:
        """Start ``fn`` on every rank without waiting (``collect`` ends it); the run's id.
        ``per_rank(rank)`` adds keyword arguments for one rank."""
        self._runs += 1
        self.job = job or f"{self._prefix}-{os.getpid()}-{self._runs}-{secrets.token_hex(3)}"
        jobs = []
        for r in range(self.world_size):
            kw = dict(kwargs or {})
            if per_rank is not None:
                kw.update(per_rank(r))
            jobs.append((f"{__name__}:_rank_entry",
                         {"fn": fn, "ctx": self.context(r), "kwargs": kw}))
        return self.pool.submit(jobs, faults)

    def collect(self, run_id: int, *, timeout: float = 60.0) -> WorldResult:
        """Every rank's ``RankResult`` of run ``run_id``; ``WorldHangError`` (every missing
        rank's stacks) after ``timeout`` seconds."""
        raw = self.pool.collect(run_id, self.world_size, timeout)
        out = []
        for r, (kind, value) in enumerate(raw):
            notes = self.pool.notes(r)
            committed = tuple(v for ev, v in notes if ev == "commit")
            fired = tuple(p for ev, p in notes if ev == "fault")
            role = "trainer" if r < self.trainers else "worker"
            if kind == "ok":
                out.append(RankResult(r, role, "ok", value=value, committed=committed,
                                      faults=fired))
            elif kind == "err":
                exc, tb = value
                out.append(RankResult(r, role, "error", error=exc, traceback=tb,
                                      committed=committed, faults=fired))
            else:
                status: Status = "frozen" if kind == "frozen" else "dead"
                out.append(RankResult(r, role, status, committed=committed, faults=fired))
        return WorldResult(out)

    def run(self, fn: Target, *, kwargs: Mapping[str, Any] | None = None,
            per_rank: Callable[[int], Mapping[str, Any]] | None = None,
            faults: Sequence[Fault] = (), timeout: float = 60.0,
            job: str | None = None) -> WorldResult:
        """``start`` then ``collect``."""
        return self.collect(self.start(fn, kwargs=kwargs, per_rank=per_rank, faults=faults,
                                       job=job), timeout=timeout)

    async def arun(self, fn: Target, **kw: Any) -> WorldResult:
        """``run`` in a worker thread, for async tests (pytest-asyncio or anyio).

        Cancellation: the test stops waiting; the ranks finish or hit ``timeout``.
        """
        import anyio.to_thread

        return await anyio.to_thread.run_sync(functools.partial(self.run, fn, **kw),
                                              abandon_on_cancel=True)

    def wait_event(self, name: str, timeout: float = 30.0) -> tuple[int, Any]:
        """The first ``ctx.event(name, payload)`` of the current run: ``(rank, payload)``."""
        return self.pool.wait_event(name, timeout)

    def restart(self, rank: int) -> None:
        """Replace ``rank``'s process with a fresh one now (killing it if alive)."""
        self.pool.restart(rank)

    def kill(self, rank: int) -> None:
        """SIGKILL ``rank``'s process (it is replaced before the next run)."""
        self.pool.kill(rank)

    def freeze(self, rank: int) -> None:
        """SIGSTOP ``rank``'s process: its sockets stay open, it never answers."""
        os.kill(self.pool.pid(rank), signal.SIGSTOP)

    def stacks(self, rank: int) -> str:
        """Every thread's stack of ``rank``'s process now (faulthandler)."""
        return self.pool.stacks(rank)
