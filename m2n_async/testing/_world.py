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
asked for, plus an observer that sends each committed version to the parent at once.

Isolation: each process talks to the parent over a pipe of its own, which carries its
events and then its job's result, in the order it wrote them. A write is synchronous (a rank
killed right after a commit or an event still counts), and a process killed halfway through
a message garbles only its own pipe: the parent reads every pipe without blocking, so a half
written message waits there and goes with the process. (A ``multiprocessing.Queue`` shared
by every process has one lock; a writer killed while holding it silences all the others.)
The parent learns of a death from the pipe's end and the process's exit code.

Watching a run: ``LocalWorld.events`` yields every ``ctx.event`` as it arrives, until every
rank ended; ``collect`` then returns every rank's ``RankResult`` (a dead one with its
``exitcode``). Hangs: ``collect`` waits at most ``timeout`` seconds; a rank that has not
reported by then is asked for its stacks (``faulthandler`` on ``SIGUSR1``, every thread;
then, on ``SIGUSR2``, where each task of its event loop waits), then killed so the pool
stays usable, and ``WorldHangError`` carries every missing rank's stacks and every rank's
result. With ``fail_grace``, once a rank raised or died (or the test
called ``mark_failed``), the others get that many seconds to end; then they are killed the
same way and reported as ``"killed"``, with their stacks. A rank that froze itself through a
``freeze`` fault is not a hang: once every other rank reported, it is killed and reported as
``"frozen"``.

Starting: a run first waits (``ready_timeout``) for processes still importing torch and the
package; one that ends meanwhile is a ``RankStartError`` at once, one still alive at the
deadline is asked for its stacks and killed (``RankStartTimeout``). Its stack dump handlers
come late in its start (after the spawn's import of the main module), so a start gets
``-X faulthandler``: on ``SIGABRT`` every thread's stack goes to fd 2, which until "ready" is
the boot file the pool reads. Before "ready", fds 1 and 2 are that boot file; the test
process's own (``/dev/null`` where it closed one) are handed back then.

Pickling: jobs cross through each process's own ``multiprocessing`` queue; events and
results as plain pickles (by value: a tensor is copied, not shared). Exceptions cross as
themselves, each of a chain (``__cause__``/``__context__``, up to 8) pickled apart: one that
does not pickle, or does not unpickle here or in the test process, becomes a
``RuntimeError`` carrying its ``repr`` (``<Class (its repr raised)>`` when that raises),
alone, the rest of the chain intact (every ``M2NError`` crosses as itself); a return value
that does not pickle is the rank's error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import importlib
import multiprocessing as mp
import os
import pickle
import secrets
import shutil
import signal
import struct
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_readable
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel

from m2n_async._engine import _faults
from m2n_async._engine._faults import Fault

__all__ = ["LocalWorld", "RankContext", "RankEvent", "RankExitedError", "RankPool",
           "RankResult", "RankStartError", "RankStartTimeout", "WorldHangError", "WorldResult",
           "store_thread"]

Target = str | Callable[..., Any]
Status = Literal["ok", "error", "dead", "frozen", "killed"]
_FRAME = struct.Struct("!Q")  # each message on a pipe: its length, then its pickle
_SPAWN_LOCK = threading.RLock()  # _start holds it around _spawn, which takes it too
_NOTES = ("commit", "fault")  # event names the pool keeps per process instead of queueing


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is no rank 1


def _check_event_name(name: Any, where: str) -> None:
    """Refuse what no ``ctx.event`` can send: a name is a non-empty ``str``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: an event name is a non-empty str, got {name!r}; valid: "
                         f"{', '.join(map(repr, _NOTES))} (the world's own: each commit, each "
                         f"fault that fired) or a name a rank passes to ctx.event")


def _check_seconds(what: str, value: Any, *, positive: bool = False) -> None:
    """Refuse a wait that could never end or means nothing: NaN compares false with every
    deadline (the wait would spin forever), a negative one is no wait, nor is a bool."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or value != value
            or value < 0 or (positive and value == 0)):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{what} is seconds {bound} (math.inf: no bound), got {value!r}")


#: How long ``submit`` waits, by default, for new processes to have imported torch and the
#: package (``RankPool(ready_timeout=)``, ``LocalWorld(ready_timeout=)``).
_READY_TIMEOUT = 120.0
_ABORT_MARK = "Fatal Python error: Aborted"  # where faulthandler's dump starts, on SIGABRT


class WorldHangError(AssertionError):
    """Ranks did not finish in time; ``stacks`` maps each to its threads' stacks.

    ``results``: every rank's result as far as it got — from ``LocalWorld`` a
    ``WorldResult`` (the missing ranks ``"killed"``), from ``RankPool`` its result tuples.
    """

    def __init__(self, message: str, stacks: Mapping[int, str],
                 results: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.stacks = dict(stacks)
        self.results = results


class _Events:
    """The child's end of its pipe, with the ``put`` of a queue (scenarios call it).

    Each message is one framed write, made before ``put`` returns: an event sent just before
    the process stops or kills itself reaches the parent (a queue's feeder thread might not).
    The job's result goes the same way, after every event of the job.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()  # a rank may send from several threads: whole frames
        self.job = 0  # the job running now: the parent drops what an earlier one sends late

    def put(self, item: tuple[str, int, Any]) -> None:
        name, index, payload = item
        self._send(("event", self.job, index, name, pickle.dumps(payload)))

    def result(self, index: int, kind: str, body: bytes) -> None:
        self._send(("result", self.job, index, kind, body))

    def fileno(self) -> int:
        return int(self._conn.fileno())

    def _send(self, message: tuple[str, int, int, str, bytes]) -> None:
        data = pickle.dumps(message)
        frame = memoryview(_FRAME.pack(len(data)) + data)
        with self._lock:
            while frame:
                frame = frame[os.write(self.fileno(), frame):]


class _Reader:
    """The parent's end of one process's pipe, read without ever blocking: a message that a
    stopped or killed process left half written waits in ``buf`` instead of wedging the
    test process."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        os.set_blocking(conn.fileno(), False)
        self.buf = bytearray()
        self.closed = False  # the pipe's end: the process is gone

    def fileno(self) -> int:
        return int(self.conn.fileno())

    def frames(self) -> list[bytes]:
        """Every whole message that arrived since the last call."""
        for _ in range(64):  # a process that writes without pause must not keep us here
            try:
                chunk = os.read(self.fileno(), 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self.buf += chunk
        out, pos = [], 0
        while len(self.buf) - pos >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self.buf, pos)
            if len(self.buf) - pos - _FRAME.size < n:
                break
            out.append(bytes(self.buf[pos + _FRAME.size:pos + _FRAME.size + n]))
            pos += _FRAME.size + n
        del self.buf[:pos]
        return out

    def close(self) -> None:
        self.conn.close()
        self.closed = True


def _resolve(target: Target) -> Callable[..., Any]:
    if callable(target):
        return target
    module, sep, name = target.partition(":")
    if not sep:
        module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _error_pickle(exc: BaseException, tb: str) -> bytes:
    """``(exc, tb)`` pickled, with the exceptions ``exc`` was raised from (``__cause__``, or
    ``__context__`` when no cause hides it: a pickle keeps neither), a few deep. Any of them
    that does not pickle or does not unpickle here (an ``__init__`` whose arguments differ
    from ``args`` fails only there: better here, with the text, than in the parent, without)
    is a ``RuntimeError`` with its ``repr``. Each is pickled on its own, so one that unpickles
    here but not in the test process (its class importable only in the rank) is replaced
    there alone, and the rest of the chain still arrives."""
    chain: list[tuple[bool, BaseException]] = []
    seen = {id(exc)}
    e: BaseException | None = exc
    while e is not None and len(chain) < _CHAIN_DEPTH:
        cause = e.__cause__ is not None
        e = e.__cause__ if cause else (None if e.__suppress_context__ else e.__context__)
        if e is None or id(e) in seen:
            break
        seen.add(id(e))
        chain.append((cause, e))
    links = [(True, exc), *chain]  # the first link's flag is unused: it is the error itself
    return pickle.dumps((_Rechained([(c, _pickled(x), _repr(x)) for c, x in links]), tb))


_CHAIN_DEPTH = 8  # exceptions of a chain kept, beyond the one raised


def _pickled(exc: BaseException) -> bytes:
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
        return blob
    except Exception as why:  # said, so that a test expecting the class sees why it is not
        return pickle.dumps(RuntimeError(f"{_repr(exc)} (did not pickle in the rank: "
                                         f"{why!r})"))


def _repr(exc: BaseException) -> str:
    """``repr(exc)``, or its class's name when that raises: the report must not fail."""
    try:
        return repr(exc)
    except Exception:
        return f"<{type(exc).__qualname__} (its repr raised)>"


class _Rechained:
    """An exception and what it was raised from, each pickled apart, rebuilt as one chain
    when unpickled (by ``_rechain``, which the test process can always import)."""

    def __init__(self, links: list[tuple[bool, bytes, str]]) -> None:
        self.links = links

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rechain, (self.links,))


def _rechain(links: list[tuple[bool, bytes, str]]) -> BaseException:
    errors: list[BaseException] = []
    for _, blob, text in links:
        try:
            errors.append(pickle.loads(blob))
        except Exception as exc:  # e.g. a class the rank defined and the test process lacks
            errors.append(RuntimeError(f"{text} (did not unpickle in the test process: "
                                       f"{exc!r})"))
    for (cause, _, _), later, earlier in zip(links[1:], errors[:-1], errors[1:], strict=True):
        if cause:
            later.__cause__ = earlier
        else:
            later.__context__ = earlier
    return errors[0]


def _dump_tasks(out: Any, signum: int, frame: Any) -> None:
    """``SIGUSR2``: where every task of the event loop this signal interrupted waits.

    faulthandler (``SIGUSR1``) shows threads, and an event loop's thread is in ``select``
    while its tasks wait: a rank stuck on an ``await`` shows no frame of its own there. A
    Python-level handler runs in the loop's thread between bytecodes (a ``select`` is
    interrupted by the signal), so the running loop is this thread's; a thread stuck in C
    holding the GIL gets no such dump, and faulthandler's is all there is.
    """
    try:
        _write_tasks(out)
    except Exception as exc:  # never into the rank's own code (a second signal mid-print)
        with contextlib.suppress(Exception):
            print(f"(the tasks' stacks failed: {exc!r})", file=out)


def _write_tasks(out: Any) -> None:
    import asyncio

    loop = asyncio._get_running_loop()
    if loop is None:
        print("(no event loop runs on the main thread: no tasks to show)", file=out)
    else:
        tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
        print(f"{len(tasks)} task(s) of the event loop, outermost call first:", file=out)
        for task in tasks:
            print(f"task {task.get_name()!r}:", file=out)
            # Task.print_stack shows a suspended task's outermost coroutine only: follow
            # what each one awaits down to the one that waits (asyncio.print_call_graph
            # from Python 3.14 on).
            coro: Any = task.get_coro()
            while coro is not None:
                f = (getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                     or getattr(coro, "ag_frame", None))
                if f is not None:
                    print(f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in '
                          f"{f.f_code.co_name}", file=out)
                coro = (getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
                        or getattr(coro, "ag_await", None))
    out.flush()


def _child(index: int, jobs: Any, conn: Any, stacks_path: str, boot_path: str,
           outputs: Sequence[Any]) -> None:
    # Until "ready", stdout and stderr are the boot file (see RankPool._spawn), so that a
    # start that fails leaves its last words where the pool reads them; a traceback raised
    # out of here goes there too, and the process exits 1.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stacks = open(stacks_path + ".part", "w")  # lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    signal.signal(signal.SIGUSR2, functools.partial(_dump_tasks, stacks))
    signal.siginterrupt(signal.SIGUSR2, False)  # as faulthandler's: restart interrupted calls
    # The file under its own name says the handlers are in place: before, SIGUSR1 and
    # SIGUSR2 would end this process (their default action), so the parent sends none.
    os.replace(stacks_path + ".part", stacks_path)
    with warnings.catch_warnings():
        # torch warns at import where NumPy is absent (a lean env, such as the demo's);
        # the pool imports it on every rank's behalf, so the warning would be every rank's.
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
        import torch._subclasses.functional_tensor  # it warns again when first imported

    torch.set_num_threads(1)
    import m2n_async  # noqa: F401  - what every job imports, before the job's clock runs
    _restore_outputs(boot_path, outputs)
    events = _Events(conn)
    # Ready: a job's phase deadlines start only now, not while a replacement imports torch.
    events._send(("ready", 0, index, "", b""))
    while True:
        try:
            job = jobs.get()
        except KeyboardInterrupt:  # Ctrl-C reaches the terminal's whole process group:
            return                 # an idle rank just ends (the pool replaces it)
        if job is None:
            return
        job_id, payload, faults = job
        events.job = job_id

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
            events.result(index, "ok", pickle.dumps(value))  # one that does not pickle: err
        except BaseException as exc:
            events.result(index, "err", _error_pickle(exc, traceback.format_exc()))
        finally:
            _faults.disarm()


def _restore_outputs(boot_path: str, outputs: Sequence[Any]) -> None:
    """Give this process back the test process's stdout and stderr, then write there what
    it printed while starting (to the boot file): nothing printed is lost, only late."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for fd, out in zip((1, 2), outputs, strict=True):
        os.dup2(out.fileno(), fd)
        out.close()
    with open(boot_path, "rb") as f:
        early = memoryview(f.read())
    while early:
        early = early[os.write(2, early):]


def _tail(path: str, limit: int = 2000) -> str:
    """The last ``limit`` characters of a file (from the last whole line), or ""."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return _last(text, limit)


def _last(text: str, limit: int = 2000) -> str:
    """The last ``limit`` characters of ``text``, from the first whole line among them."""
    if len(text) >= limit:
        text = text[-limit:]
        if "\n" in text:
            text = text.split("\n", 1)[1]
    return text.strip()


def _fill_closed_outputs() -> list[tuple[int, os.stat_result]]:
    """Open /dev/null as fd 1 and 2 where the test process closed them: the toolkit hands
    fds 1 and 2 to each rank (``_spawn``), and while one is closed, the next fd opened (a
    pipe, the store's socket) takes its number and a rank's prints would go there. What a
    rank writes is then lost, as the test process's own writes would be. Returns what
    ``_reclose`` undoes."""
    filled = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)  # the lowest free fd: maybe ``fd``
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            filled.append((fd, os.fstat(fd)))
    return filled


def _reclose(filled: Sequence[tuple[int, os.stat_result]]) -> None:
    """Close again the fds ``_fill_closed_outputs`` filled, where they are still its."""
    for fd, st in filled:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), st):  # not one the test process put there
                os.close(fd)


@contextmanager
def _std_outputs_open() -> Iterator[None]:
    """fds 1 and 2 open for the block (see ``_fill_closed_outputs``), as they were after."""
    filled = _fill_closed_outputs()
    try:
        yield
    finally:
        _reclose(filled)


class RankStartError(RuntimeError):
    """A rank process ended before it was ready for a job (before any job ran on it).

    ``rank``: its index; ``exitcode``: as ``multiprocessing`` gives it (``-N`` for signal
    ``N``); ``output``: the end of what it printed to stdout and stderr while starting
    ("" when nothing).
    """

    def __init__(self, message: str, *, rank: int, exitcode: int | None,
                 output: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.output = output


class RankStartTimeout(RankStartError):
    """Rank processes still alive, yet not ready for a job ``ready_timeout`` seconds after
    the run asked for them: hung while starting (most often code at the top level of the
    main module, which every spawned rank runs again, that waits). They were killed, and are
    replaced before the next run.

    ``ranks``: those ranks, in order; ``waited``: the seconds waited (``ready_timeout``);
    ``outputs``: rank -> the end of what it printed while starting; ``stacks``: rank -> every
    thread's stack from just before it was killed ("" where it left none). ``rank`` and
    ``output`` are the first such rank's; ``exitcode`` is None (it did not end by itself).
    """

    def __init__(self, message: str, *, ranks: Sequence[int], waited: float,
                 outputs: Mapping[int, str], stacks: Mapping[int, str]) -> None:
        super().__init__(message, rank=ranks[0], exitcode=None,
                         output=outputs.get(ranks[0], ""))
        self.ranks = tuple(ranks)
        self.waited = waited
        self.outputs = dict(outputs)
        self.stacks = dict(stacks)


class RankExitedError(RuntimeError):
    """``LocalWorld.freeze`` or ``LocalWorld.stacks`` on a rank whose process already
    ended: ``rank``, ``exitcode`` (``-N`` for signal ``N``). It is replaced before the next
    run; ``restart`` replaces it now."""

    def __init__(self, message: str, *, rank: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def _how_it_ended(code: int | None) -> str:
    return (f"killed by signal {-code}" if code is not None and code < 0
            else f"exit code {code}")


def _refuse_in_bootstrap(what: str) -> None:
    # multiprocessing sets _inheriting while a spawned child re-imports its parent's main
    # module: a world started there would spawn from a process that is not running yet
    # (and its store thread would keep that child from ever exiting).
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(
            f"{what} started while a spawned process imports its parent's main module: a "
            f"rank process runs that module's top level again, so the code that starts a "
            f"world must sit under `if __name__ == \"__main__\":`")


def _unpickle(body: bytes, what: str) -> Any:
    try:
        return pickle.loads(body)
    except Exception as exc:
        return RuntimeError(f"{what} did not unpickle in the test process: {exc!r}")


class RankPool:
    """``size`` spawned processes; ``submit`` gives job k to process k.

    A job is ``(target, kwargs)``: ``target`` a module-level coroutine function or its
    ``"module:name"``; it is called with ``kwargs`` plus ``_events`` (``.put((name, index,
    payload))`` tells the parent, see ``wait_event`` and ``events``) and ``_index`` (the
    process's slot). One job runs at a time: ``submit`` makes it the current one.

    ``submit`` waits up to ``ready_timeout`` seconds for processes still starting: one that
    ends meanwhile is a ``RankStartError`` at once, those still starting at the deadline are
    killed and a ``RankStartTimeout``. A pool that fails to start a process stops those it
    started before the error propagates.
    """

    def __init__(self, size: int, *, ready_timeout: float = _READY_TIMEOUT) -> None:
        _refuse_in_bootstrap("RankPool")
        _check_seconds("ready_timeout", ready_timeout, positive=True)
        self._filled = _fill_closed_outputs()  # before this pool opens any fd (close undoes)
        self.size = size
        self.ready_timeout = float(ready_timeout)
        self._ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="m2n-world-")
        self._procs: list[Any] = [None] * size
        self._jobs: list[Any] = [None] * size
        self._readers: list[_Reader | None] = [None] * size  # parent ends of the pipes
        self._busy = [0] * size  # jobs sent to each process and not answered yet
        self._ready = [False] * size  # the process imported what jobs need ("ready" came)
        # The current job:
        self._job_id = 0
        self._n = 0  # its processes: slots 0 .. n-1
        self._pending: list[tuple[str, int, Any]] = []  # events not yet yielded or waited for
        self._notes: dict[int, list[tuple[str, Any]]] = {}  # slot -> commit/fault events
        # The same notes in the order they came, for wait_event: (name, slot, payload, the
        # note's position in its slot's list), and which of them a wait_event took.
        self._note_log: list[tuple[str, int, Any, int]] = []
        self._notes_taken: set[int] = set()
        self._outcomes: dict[int, tuple[str, Any]] = {}  # slot -> how it ended, as collected
        self._failed_at: float | None = None  # when the first failure was seen
        self._closed = False
        try:
            for i in range(size):
                self._start(i)
        except BaseException:  # those started would run on, unowned, until the test ends
            for i, p in enumerate(self._procs):
                if p is not None:
                    self.kill(i)
            self.close()
            raise

    def _stacks_path(self, i: int) -> str:
        return os.path.join(self._dir, f"stacks-{i}.txt")

    def _boot_path(self, i: int) -> str:
        return os.path.join(self._dir, f"boot-{i}.txt")

    def _spawn(self, p: Any, i: int) -> None:
        """``p.start()`` with stdout and stderr the boot file: a spawned child inherits
        them at exec, before any code of ours runs in it, and what it prints while starting
        (the main module's re-import, torch's) is what says why a start failed. The child
        takes the test process's own back once it is ready (``_restore_outputs``)."""
        import sys

        for stream in (sys.stdout, sys.stderr):  # nothing of ours lands in the boot file
            with contextlib.suppress(Exception):
                stream.flush()
        # Two threads starting pools must not swap each other's fds (or options).
        with _SPAWN_LOCK, _std_outputs_open():
            boot = os.open(self._boot_path(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            saved = [os.dup(1), os.dup(2)]
            # -X faulthandler for the child (spawn passes on the parent's -X options): a
            # start that hangs before the child's own handlers are in place (in the main
            # module's import, say) can still show its stacks — on SIGABRT faulthandler
            # writes every thread's to fd 2, the boot file, before the process dies.
            added = "faulthandler" not in sys._xoptions
            if added:
                sys._xoptions["faulthandler"] = True
            try:
                os.dup2(boot, 1)
                os.dup2(boot, 2)
                p.start()
            finally:
                if added:
                    sys._xoptions.pop("faulthandler", None)
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in (boot, *saved):
                    os.close(fd)

    def _start_error(self, i: int) -> RankStartError:
        code = self._procs[i].exitcode
        output = _tail(self._boot_path(i))
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}")
        said = (f"; it printed last:\n{output}" if output else "; it printed nothing")
        return RankStartError(
            f"rank {i}'s process {how} before it was ready for a job{said}\n(a rank process "
            f"is spawned: it imports the test's main module again, so code at that module's "
            f"top level runs in every rank; keep it under `if __name__ == \"__main__\":`)",
            rank=i, exitcode=code, output=output)

    def _start_timeout(self, hung: Sequence[int]) -> RankStartTimeout:
        """Kill the ``hung`` processes, each asked for its stacks first; the error that says
        so, with what each printed and its stacks."""
        import resource

        for i in hung:
            pid = self.pid(i)
            if self._procs[i].exitcode is not None:  # reaped: its pid may be another's now
                continue
            with contextlib.suppress(OSError, ValueError):  # no core file of a test's rank
                resource.prlimit(pid, resource.RLIMIT_CORE,
                                 (0, resource.prlimit(pid, resource.RLIMIT_CORE)[1]))
            with contextlib.suppress(ProcessLookupError):
                # faulthandler's fatal handler (-X faulthandler, see _spawn) dumps every
                # thread to the boot file, then the process dies of the signal.
                os.kill(pid, signal.SIGABRT)
                os.kill(pid, signal.SIGCONT)  # a stopped one must run to dump
        deadline = time.monotonic() + 5.0  # a dump takes milliseconds; then SIGKILL
        for i in hung:
            self._procs[i].join(max(0.0, deadline - time.monotonic()))
            self.kill(i)
            self._busy[i] = 0
        outputs, stacks = {}, {}
        for i in hung:
            text = _tail(self._boot_path(i), 1 << 16)
            said, mark, dump = text.partition(_ABORT_MARK)
            outputs[i] = _last(said)
            stacks[i] = (mark + dump).strip()
        parts = "".join(f"\n--- rank {i} ---\nit printed last:\n{outputs[i] or '(nothing)'}"
                        f"\nits stacks:\n{stacks[i] or '(none written)'}" for i in hung)
        return RankStartTimeout(
            f"ranks {list(hung)} were not ready for a job within {self.ready_timeout} s "
            f"(alive, yet still starting: hung?), and were killed (replaced before the next "
            f"run){parts}\n(a rank process is spawned: it imports the test's main module "
            f"again, so code at that module's top level runs in every rank; keep it under "
            f"`if __name__ == \"__main__\":`; a start slower than that, say on a loaded "
            f"machine, needs a longer ready_timeout)",
            ranks=hung, waited=self.ready_timeout, outputs=outputs, stacks=stacks)

    def _start(self, i: int) -> None:
        old_reader, old_jobs = self._readers[i], self._jobs[i]
        if old_reader is not None:
            old_reader.close()
        if old_jobs is not None:  # its reader is gone: nothing in it will be read
            old_jobs.cancel_join_thread()
            old_jobs.close()
        self._jobs[i] = None
        for path in (self._stacks_path(i), self._stacks_path(i) + ".part"):
            with contextlib.suppress(FileNotFoundError):  # the old process's: not this one's
                os.remove(path)
        # Before any fd is opened: one the test process closed since would be taken.
        with _SPAWN_LOCK, _std_outputs_open():
            jobs = self._ctx.Queue()
            parent, child = self._ctx.Pipe(duplex=False)
            # The test process's stdout and stderr, for the child to take back once ready:
            # a Connection crosses spawn as a duplicated fd.
            outputs = [Connection(os.dup(fd)) for fd in (1, 2)]
            p = self._ctx.Process(target=_child, args=(i, jobs, child, self._stacks_path(i),
                                                        self._boot_path(i), outputs),
                                  daemon=True)
            try:
                self._spawn(p, i)
            except BaseException:  # no process: its pipe and queue would only leak fds
                parent.close()
                child.close()
                jobs.close()
                raise
            finally:
                for out in outputs:
                    out.close()
        self._jobs[i] = jobs
        child.close()  # the child's copy is the only writer: its end is the pipe's end
        self._readers[i] = _Reader(parent)
        self._procs[i] = p
        self._ready[i] = False
        self._busy[i] = 0

    def _check_open(self, what: str) -> None:
        # A closed pool's process objects are closed too: any use of one is a ValueError
        # about a "process object" that says nothing of the pool.
        if self._closed:
            raise RuntimeError(f"{what}: this pool is closed (close(), or the LocalWorld's "
                               f"close or with-block ended it); start a new one")

    def pid(self, i: int) -> int:
        self._check_open("pid")
        return int(self._procs[i].pid)

    def alive(self, i: int) -> bool:
        self._check_open("alive")
        return bool(self._procs[i].is_alive())

    def exitcode(self, i: int) -> int | None:
        """How process ``i`` ended (``-N``: signal ``N``); None while it runs."""
        self._check_open("exitcode")
        code = self._procs[i].exitcode
        return None if code is None else int(code)

    def kill(self, i: int) -> None:
        """SIGKILL process ``i`` (a stopped one too) and reap it; nothing for one that
        already ended."""
        self._check_open("kill")
        p = self._procs[i]
        if p is None or p.exitcode is not None:  # reaped: its pid may be another's by now
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)

    def restart(self, i: int) -> None:
        """Replace process ``i`` with a fresh one (killing it first if it is alive). One
        killed in the middle of the current job is ``("dead", exitcode)`` in its results, as
        if killed with ``kill``."""
        self._check_open("restart")
        if self._procs[i] is not None and self._procs[i].is_alive():
            self.kill(i)
        if self._procs[i] is not None and i < self._n and i not in self._outcomes:
            # The fresh process never gets this job: without an outcome now, collect would
            # wait for one until its timeout. What it wrote before it died counts first.
            r = self._readers[i]
            if r is not None and not r.closed:
                self._read(i, r)
            if i not in self._outcomes:
                self._outcomes[i] = ("dead", self._procs[i].exitcode)
                self._busy[i] = 0
                self.mark_failed()
        self._start(i)

    def ensure_alive(self) -> None:
        self._check_open("ensure_alive")
        for i, p in enumerate(self._procs):
            if not p.is_alive():
                self._start(i)

    def stacks(self, i: int, wait: float = 0.5) -> str:
        """Every thread's stack of process ``i`` (faulthandler), then where each task of its
        event loop waits (when the loop's thread gets to run Python), or why there is none.
        A stopped (frozen) process runs for the moment it takes to write them, then is
        stopped again."""
        self._check_open("stacks")
        path = self._stacks_path(i)
        if not self.alive(i):  # reaped: a signal to its pid could reach another process
            return f"(no stacks: its process ended, {_how_it_ended(self.exitcode(i))})"
        if not os.path.exists(path):  # SIGUSR1 and SIGUSR2 would end it (see _child)
            return ("(no stacks: its process is still starting, before its stack dump "
                    "handlers are in place)")
        try:
            before = os.path.getsize(path)
            stopped = _is_stopped(self.pid(i))
            # Pending before the process runs again: a stopped one dumps where it stopped
            # (the kernel delivers it on resuming, before the process's own next step).
            os.kill(self.pid(i), signal.SIGUSR1)
            os.kill(self.pid(i), signal.SIGUSR2)  # the event loop's tasks (_dump_tasks)
            os.kill(self.pid(i), signal.SIGCONT)  # a stopped process cannot dump
        except (OSError, ProcessLookupError) as exc:
            return f"(no stacks: {exc})"
        deadline = time.monotonic() + wait
        try:
            while time.monotonic() < deadline:
                time.sleep(0.05)
                if os.path.getsize(path) > before:
                    time.sleep(0.1)  # let it finish writing, the tasks' dump included
                    break
        finally:
            if stopped:  # frozen it was, frozen it stays (a frozen-host test, not a slow one)
                with contextlib.suppress(OSError):
                    os.kill(self.pid(i), signal.SIGSTOP)
        with open(path) as f:
            f.seek(before)
            return f.read() or "(no stacks written)"

    def submit(self, jobs: Sequence[tuple[Target, Mapping[str, Any]]],
               faults: Sequence[Fault] = ()) -> int:
        """Start one job per process (job k on process k); return the job's id."""
        self._check_open("submit")
        if len(jobs) > self.size:
            raise ValueError(f"{len(jobs)} jobs for a pool of {self.size} processes")
        self._pump()  # what earlier jobs left: a dead process's last words, late answers
        for i in range(len(jobs)):
            if self._busy[i]:  # an earlier job never collected (its test gave up): it runs
                self.restart(i)
            elif self._procs[i].is_alive() and _is_stopped(self.pid(i)):
                # Frozen from outside (LocalWorld.freeze) after it answered: alive, yet it
                # would never take the job, and the run would wait out its whole timeout.
                self.restart(i)
        self.ensure_alive()
        # A replaced process imports torch and the package first (seconds on a loaded
        # machine): wait for it, so that a job's short phase timeouts do not count it.
        deadline = time.monotonic() + self.ready_timeout
        while not all(self._ready[:len(jobs)]) and time.monotonic() < deadline:
            self._pump(wait=0.05)
            for i in range(len(jobs)):
                if not self._ready[i] and not self._procs[i].is_alive():
                    self._pump()  # a "ready" it sent just before it ended
                    if not self._ready[i]:  # no job could ever run there: say why, now
                        self._procs[i].join(1)  # its exit code
                        raise self._start_error(i)
        self._pump()  # a "ready" that came with the deadline
        hung = [i for i in range(len(jobs)) if not self._ready[i]]
        for i in hung:
            if not self._procs[i].is_alive():  # it ended just now: that is its error
                self._procs[i].join(1)
                raise self._start_error(i)
        if hung:  # alive all along, yet no job could start there: the run would wait forever
            raise self._start_timeout(hung)
        self._job_id += 1
        self._n = len(jobs)
        self._pending.clear()
        self._notes.clear()
        self._note_log.clear()
        self._notes_taken.clear()
        self._outcomes.clear()
        self._failed_at = None
        for i, (target, kwargs) in enumerate(jobs):
            payload = pickle.dumps((target, dict(kwargs)))
            self._jobs[i].put((self._job_id, payload, tuple(faults)))
            self._busy[i] += 1
        return self._job_id

    def notes(self, i: int) -> list[tuple[str, Any]]:
        """``("commit", version)`` and ``("fault", (point, where, action))`` of process ``i``
        in the current job, in order."""
        self._check_open("notes")
        self._pump()
        return list(self._notes.get(i, ()))

    def mark_failed(self) -> None:
        """Count the current job as failed from now (if nothing failed yet): ``fail_grace``
        then runs from here, as from a rank's error. For a failure only the test sees, such
        as a wrong value in an event."""
        if self._failed_at is None:
            self._failed_at = time.monotonic()

    # -- reading the pipes --------------------------------------------------------------

    def _pump(self, wait: float = 0.0) -> None:
        """Read every pipe (after waiting up to ``wait`` s for one to have something), then
        note the processes of the current job that died."""
        if wait > 0:
            open_ = [r.fileno() for r in self._readers if r is not None and not r.closed]
            if open_:
                wait_readable(open_, wait)
            else:
                time.sleep(wait)
        for i, r in enumerate(self._readers):
            if r is not None and not r.closed:
                self._read(i, r)
        for i in range(self._n):
            if i not in self._outcomes and not self._procs[i].is_alive():
                r = self._readers[i]
                if r is not None and not r.closed:
                    self._read(i, r)  # what it wrote just before it died
                if i not in self._outcomes:
                    self._outcomes[i] = ("dead", self._procs[i].exitcode)
                    self._busy[i] = 0
                    self.mark_failed()

    def _read(self, i: int, r: _Reader) -> None:
        for frame in r.frames():
            self._handle(i, frame)
        if r.closed:  # the process is exiting: reap it, for its exit code
            self._procs[i].join(1)

    def _handle(self, i: int, frame: bytes) -> None:
        try:
            tag, job, index, name, body = pickle.loads(frame)
        except Exception:  # not a message of ours (a rank wrote to the pipe itself)
            return
        if tag == "ready":
            self._ready[i] = True
            return
        if tag == "result":
            self._busy[i] = max(0, self._busy[i] - 1)
        if job != self._job_id:  # an earlier job's, sent after the test moved on
            return
        if tag == "event":
            payload = _unpickle(body, f"the payload of event {name!r}")
            if name in _NOTES:
                mine = self._notes.setdefault(index, [])
                self._note_log.append((name, index, payload, len(mine)))
                mine.append((name, payload))
            else:
                self._pending.append((name, index, payload))
        elif tag == "result" and i not in self._outcomes:
            try:
                value = pickle.loads(body)
            except Exception as exc:
                name, value = "err", (RuntimeError(
                    f"the result of process {i} did not unpickle in the test process: "
                    f"{exc!r}"), "")
            self._outcomes[i] = (name, value)
            if name == "err":
                self.mark_failed()

    def _frozen(self, i: int) -> bool:
        return any(ev == "fault" and p[2] == "freeze" for ev, p in self._notes.get(i, ()))

    def _check(self, job_id: int) -> None:
        if job_id != self._job_id:
            raise ValueError(f"job {job_id} is not the current job ({self._job_id}): a later "
                             "submit replaced it")

    def _grace_left(self, fail_grace: float | None) -> float:
        """Seconds until ``fail_grace`` runs out (infinite before the first failure)."""
        if fail_grace is None or self._failed_at is None:
            return float("inf")
        return self._failed_at + fail_grace - time.monotonic()

    def _give_up(self, missing: Sequence[int]) -> dict[int, str]:
        """Stacks of the ``missing`` processes that still run, then kill them all (so the
        pool stays usable); each is ``("killed", (exitcode, stacks))``."""
        # A stopped (frozen) process runs while its stacks are taken: what it does then is
        # no result of its own (it would have stayed frozen), so it comes back "killed".
        stopped = {i for i in missing if self.alive(i) and _is_stopped(self.pid(i))}
        notes = {i: len(self._notes.get(i, ())) for i in stopped}
        stacks = {i: self.stacks(i) for i in missing if self.alive(i)}
        for i in stopped:
            self.kill(i)
        self._pump()  # results that came while the stacks were taken count, not "killed"
        for i in stopped:
            self._outcomes.pop(i, None)
            del self._notes.setdefault(i, [])[notes[i]:]  # a commit it made meanwhile, say
            # Taken, not removed: the log's positions are what _notes_taken holds.
            self._notes_taken.update(k for k, n in enumerate(self._note_log)
                                     if n[1] == i and n[3] >= notes[i])
        missing = [i for i in missing if i not in self._outcomes]
        for i in missing:
            if i not in stopped:  # those are killed and reaped already
                self.kill(i)
            self._outcomes[i] = ("killed", (self._procs[i].exitcode,
                                            stacks.get(i, "(its process had ended)")))
            self._busy[i] = 0
        return stacks

    # -- a job's events and results -----------------------------------------------------

    def events(self, job_id: int, timeout: float, fail_grace: float | None = None
               ) -> Iterator[tuple[str, int, Any]]:
        """The current job's events, ``(name, index, payload)``, as they arrive (those
        ``wait_event`` has not taken), until every process of the job ended (returned,
        raised, died, or froze through a fault), ``fail_grace`` seconds passed since the
        first failure, or ``timeout`` seconds passed. It ends nothing: ``collect`` then
        says how the job ended (and kills what still runs)."""
        self._check_open("events")
        self._check(job_id)
        _check_waits(timeout, fail_grace)
        deadline = time.monotonic() + timeout
        while True:
            while self._pending:
                yield self._pending.pop(0)
            missing = [i for i in range(self._n) if i not in self._outcomes]
            left = min(deadline - time.monotonic(), self._grace_left(fail_grace))
            if not missing or all(self._frozen(i) for i in missing) or left <= 0:
                return
            self._pump(min(left, 0.2))

    def collect(self, job_id: int, n: int, timeout: float, expect_dead: Sequence[int] = (),
                fail_grace: float | None = None) -> list[tuple[str, Any]]:
        """Results of ``n`` jobs (index order): ``("ok", value)``, ``("err", (exc, tb))``,
        ``("dead", exitcode)`` for a process that died (or is in ``expect_dead``: its exit
        code, or None while it lives), ``("frozen", exitcode)`` for one that froze itself
        through a fault (then killed) or ``("killed", (exitcode, stacks))`` for one still
        running ``fail_grace`` seconds after the first failure (a job's error or a
        process's death, as this process saw it; or ``mark_failed``), killed after its
        stacks were taken. ``exitcode`` is ``multiprocessing``'s: ``-N`` for signal N.

        Raises ``WorldHangError`` (with every missing rank's stacks, after killing them;
        ``results`` as above, the missing ones ``"killed"``) if some did not finish within
        ``timeout`` seconds.
        """
        self._check_open("collect")
        self._check(job_id)
        _check_waits(timeout, fail_grace)
        expect = set(expect_dead)
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            missing = [i for i in range(n) if i not in self._outcomes and i not in expect]
            if not missing:
                break
            if all(self._frozen(i) for i in missing):
                for i in missing:
                    self.kill(i)
                    self._outcomes[i] = ("frozen", self._procs[i].exitcode)
                    self._busy[i] = 0
                break
            if self._grace_left(fail_grace) <= 0:
                self._give_up(missing)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                stacks = self._give_up(missing)
                text = "\n".join(f"--- rank {i} ---\n{s}" for i, s in stacks.items())
                raise WorldHangError(f"ranks {missing} did not finish within {timeout} s; "
                                     f"their stacks:\n{text}", stacks, self._results(n))
            self._pump(min(left, self._grace_left(fail_grace), 0.2))
        self._pump()
        return self._results(n)

    def _results(self, n: int) -> list[tuple[str, Any]]:
        # An ``expect_dead`` process that has not ended yet (a stopped one) is "dead" too.
        return [self._outcomes.get(i) or ("dead", self._procs[i].exitcode) for i in range(n)]

    def run(self, jobs: Sequence[tuple[Target, Mapping[str, Any]]], timeout: float = 60.0,
            faults: Sequence[Fault] = (), fail_grace: float | None = None
            ) -> list[tuple[str, Any]]:
        _check_waits(timeout, fail_grace)  # before the job starts, not once it runs
        return self.collect(self.submit(jobs, faults), len(jobs), timeout,
                            fail_grace=fail_grace)

    def wait_event(self, name: str, timeout: float, index: int | None = None
                   ) -> tuple[int, Any]:
        """The first ``name`` event of the current job (of process ``index`` only, when
        given) that no earlier ``wait_event`` took: ``(index, payload)``. ``"commit"`` and
        ``"fault"`` are the pool's own notes (``notes``): each committed version, each fault
        that fired, in the order they came. An ``AssertionError`` (every process's outcome
        so far) after ``timeout`` seconds, or at once when every process of the job (or
        ``index``) ended without sending it."""
        self._check_open("wait_event")
        _check_event_name(name, "wait_event")
        _check_seconds("timeout", timeout)
        if index is not None and not (_is_index(index) and 0 <= index < self._n):
            raise ValueError(f"wait_event(index={index!r}): the current job's processes are "
                             f"0 .. {self._n - 1}")
        deadline = time.monotonic() + timeout
        while True:
            found = self._take(name, index)
            if found is not None:
                return found
            left = deadline - time.monotonic()
            # Every process of the job ended (or froze itself): no such event can come, so
            # fail now rather than wait out ``timeout``. Results are read before events are
            # looked at again: a process's events all come before its result.
            whose = range(self._n) if index is None else (index,)
            ended = self._n > 0 and all(i in self._outcomes or self._frozen(i) for i in whose)
            if left <= 0 or ended:
                found = self._take(name, index)  # sent just before the result that ended it
                if found is not None:
                    return found
                # The results read meanwhile stay for collect: a failed wait loses nothing.
                who = "" if index is None else f" from process {index}"
                why = ("every process of the job ended without sending it" if index is None
                       else f"process {index} ended without sending it") if ended else (
                    f"within {timeout} s")
                raise AssertionError(f"no {name!r} event{who}: {why}; results so far:\n"
                                     f"{self._describe_outcomes()}")
            self._pump(min(left, 0.2))

    def _take(self, name: str, index: int | None) -> tuple[int, Any] | None:
        if name in _NOTES:
            for k, (ev, i, payload, _) in enumerate(self._note_log):
                if ev == name and k not in self._notes_taken and index in (None, i):
                    self._notes_taken.add(k)
                    return i, payload
            return None
        for k, (ev, i, payload) in enumerate(self._pending):
            if ev == name and index in (None, i):
                del self._pending[k]
                return i, payload
        return None

    def _describe_outcomes(self) -> str:
        """One line per process of the current job (how it ended, or that it still runs),
        then the first error's traceback: what a failed wait shows."""
        lines, tb = [], ""
        for i in range(self._n):
            kind, value = self._outcomes.get(i, ("still running", None))
            if kind == "err":
                exc, text = value
                lines.append(f"  rank {i}: raised {exc!r}")
                tb = tb or text
            elif kind == "ok":
                lines.append(f"  rank {i}: returned {repr(value)[:200]}")  # a tensor, say
            elif kind in ("dead", "frozen"):
                lines.append(f"  rank {i}: {kind} (exit code {value})")
            else:
                lines.append(f"  rank {i}: {kind}")
        return "\n".join(lines) + (f"\nthe first error's traceback:\n{tb}" if tb else "")

    def close(self) -> None:
        """End every process: an idle one is told to stop; one still in a job (its answer
        would go unread), still starting or stopped (it would take the stop late or never)
        is killed; 5 s in all, then the rest are killed too. A second call does nothing;
        any other use of a closed pool is a ``RuntimeError``."""
        if self._closed:
            return
        self._pump()
        for i, p in enumerate(self._procs):
            if p is not None and p.is_alive():
                if self._busy[i] or not self._ready[i] or _is_stopped(p.pid):
                    self.kill(i)
                else:
                    self._jobs[i].put(None)
        deadline = time.monotonic() + 5.0
        for i, p in enumerate(self._procs):
            if p is not None:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    self.kill(i)
        for r in self._readers:
            if r is not None:
                r.close()
        for p, q in zip(self._procs, self._jobs, strict=True):
            if q is not None:  # its feeder thread and pipe
                # Every process has ended: a job one never took (killed while it was being
                # written) has no reader, and join_thread would wait for it forever.
                q.cancel_join_thread()
                q.close()
                q.join_thread()
            if p is not None and not p.is_alive():
                p.close()  # the spawn pipes' fds
        shutil.rmtree(self._dir, ignore_errors=True)
        _reclose(self._filled)
        self._filled = []
        self._closed = True

def _check_waits(timeout: Any, fail_grace: Any) -> None:
    _check_seconds("timeout", timeout)
    if fail_grace is not None:
        _check_seconds("fail_grace", fail_grace)


def _is_stopped(pid: int) -> bool:
    """Is process ``pid`` stopped (SIGSTOP: ``T`` or ``t`` in /proc/<pid>/stat)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


@contextmanager
def store_thread(token: str) -> Iterator[str]:
    """A ``StoreServer`` on 127.0.0.1 in a background thread (``StoreServer.in_thread``,
    asyncio); yields its address.

    Cancellation: leaving the block stops the server and ends its thread.
    """
    from m2n_async._store import StoreServer

    with StoreServer("127.0.0.1", 0, token=token).in_thread(loop="asyncio") as served:
        yield served.address


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
        """Tell the test process (``LocalWorld.events``, ``LocalWorld.wait_event``);
        ``payload`` must pickle. The names ``"commit"`` and ``"fault"`` are the world's own
        (``RankResult.committed``, ``RankResult.faults``): a ``ValueError`` here, as is a
        name that is not a non-empty ``str``."""
        _check_event_name(name, "ctx.event")
        if name in _NOTES:  # it would read as a commit or a fault the engine never made
            raise ValueError(f"ctx.event({name!r}): {', '.join(map(repr, _NOTES))} are the "
                             f"world's own event names (RankResult.committed, .faults); "
                             f"pick another")
        if self._events is not None:
            self._events.put((name, self.rank, payload))


async def _rank_entry(*, fn: Target, ctx: RankContext, kwargs: Mapping[str, Any],
                      _events: Any = None, _index: int = 0) -> Any:
    ctx = RankContext(ctx.rank, ctx.trainer_ranks, ctx.world_size, ctx.address, ctx.token,
                      ctx.job, _events)
    return await _resolve(fn)(ctx, **kwargs)


@dataclass(frozen=True)
class RankEvent:
    """One ``ctx.event(name, payload)`` of rank ``rank``, as ``LocalWorld.events`` yields it."""

    rank: int
    name: str
    payload: Any = None


@dataclass(frozen=True)
class RankResult:
    """How one rank's function ended.

    ``status``: ``"ok"`` (``value`` is what it returned), ``"error"`` (``error`` is what it
    raised, ``traceback`` its text), ``"dead"`` (the process died), ``"frozen"`` (it froze
    through a fault and was killed) or ``"killed"`` (still running when the world gave up
    on it — ``fail_grace`` seconds after the first failure, or, in ``WorldHangError.results``,
    at the timeout — and killed; ``stacks`` holds its threads' stacks from just before).
    ``committed``: every version this rank committed, in order (known even for a rank that
    died later). ``faults``: the faults that fired on it, as ``(point, where, action)``.
    ``exitcode``: how its process ended (``"dead"``, ``"frozen"``, ``"killed"``), as
    ``multiprocessing`` gives it — the exit status, or ``-N`` when signal ``N`` ended it
    (``signal``); None where the process lives on (it serves the next run) or had not
    ended yet.
    """

    rank: int
    role: str
    status: Status
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    committed: tuple[int, ...] = ()
    faults: tuple[tuple[str, dict[str, Any], str], ...] = ()
    exitcode: int | None = None
    stacks: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def signal(self) -> int | None:
        """The number of the signal that ended the process (``exitcode == -N``), or None."""
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None


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

    To watch a run: ``start`` it, iterate ``events(run)`` (each ``ctx.event`` as it comes,
    until every rank ended), then ``collect(run)``. ``fail_grace`` (``run``, ``collect``,
    ``events``) fails fast: once a rank raised or died, the others get that many seconds,
    then are killed and come back ``"killed"`` with their stacks.

    A run first waits up to ``ready_timeout`` seconds for rank processes that are still
    starting (each imports torch); one that ends meanwhile is a ``RankStartError`` at once,
    and those still not ready at the deadline are a ``RankStartTimeout`` (killed, with
    their stacks).

    Use as a context manager (or call ``close``). Blocking; from an async test use
    ``await world.arun(...)``, which runs it in a worker thread.
    """

    def __init__(self, trainers: int, workers: int, *, store_address: str | None = None,
                 token: str | None = None, job_prefix: str = "world",
                 ready_timeout: float = _READY_TIMEOUT) -> None:
        _refuse_in_bootstrap("LocalWorld")
        if trainers < 1 or workers < 1:
            raise ValueError(f"a world needs >= 1 trainer and >= 1 worker, got {trainers} + "
                             f"{workers}")
        if store_address is not None and not token:
            raise ValueError("LocalWorld(store_address=...) needs that store's token: a "
                             "made-up one would be refused by it")
        self._filled = _fill_closed_outputs()  # before the store's sockets (close undoes)
        self.trainers, self.workers = trainers, workers
        self.token = token or secrets.token_hex(16)
        self._store_cm = None
        self._prefix = job_prefix
        self._runs = 0
        self._faults: tuple[Fault, ...] = ()  # the current run's (start)
        self.job = ""
        try:
            if store_address is None:
                cm = store_thread(self.token)
                store_address = cm.__enter__()
                self._store_cm = cm
            self.address = store_address
            self.pool = RankPool(self.world_size, ready_timeout=ready_timeout)
        except BaseException:  # the store's thread would outlive the world that failed
            self._close_store()
            _reclose(self._filled)
            raise

    @property
    def world_size(self) -> int:
        return self.trainers + self.workers

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the rank processes and the store this world started; a second call does
        nothing, and a run after it is a ``RuntimeError``."""
        self.pool.close()
        self._close_store()
        _reclose(self._filled)
        self._filled = []

    def _close_store(self) -> None:
        """Stop the store this world started itself (if any); ``close`` does it too."""
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
        ``per_rank(rank)`` adds keyword arguments for one rank. A fault for a rank outside
        the world is a ``ValueError``; one that fired on no rank is a warning at ``collect``
        (a test that a fault changes nothing would pass without testing anything)."""
        if isinstance(faults, Fault) or not all(isinstance(f, Fault) for f in faults):
            raise TypeError(f"faults= takes a list of Fault (faults=[Fault(...)]), got "
                            f"{faults!r}")
        for fault in faults:
            if fault.rank is not None and not 0 <= fault.rank < self.world_size:
                raise ValueError(f"{fault!r}: rank {fault.rank} is outside this world of "
                                 f"{self.world_size} ranks (0 .. {self.world_size - 1})")
        self._faults = tuple(faults)
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

    def events(self, run_id: int, *, timeout: float = 60.0, fail_grace: float | None = None
               ) -> Iterator[RankEvent]:
        """Every ``ctx.event`` of run ``run_id`` as it arrives (those ``wait_event`` has not
        taken), in the order each rank sent them; the iteration ends when every rank ended
        (returned, raised, died, or froze through a fault), ``fail_grace`` seconds after the
        first failure, or after ``timeout`` seconds. It ends no rank: ``collect`` then says
        how the run ended (and kills whatever still runs). Each rank's events all come
        before its end: a rank's last event is never lost to its result."""
        for name, rank, payload in self.pool.events(run_id, timeout, fail_grace):
            yield RankEvent(rank, name, payload)

    def mark_failed(self) -> None:
        """The current run failed, as the test sees it (a wrong value in an event, say):
        ``fail_grace`` runs from now, as from a rank's error (if nothing failed before)."""
        self.pool.mark_failed()

    def collect(self, run_id: int, *, timeout: float = 60.0, fail_grace: float | None = None
                ) -> WorldResult:
        """Every rank's ``RankResult`` of run ``run_id``; ``WorldHangError`` (every missing
        rank's stacks; ``results``, the missing ranks ``"killed"``) after ``timeout``
        seconds. With ``fail_grace``, once a rank raised or died (as the test process saw
        it; or ``mark_failed``), the others get ``fail_grace`` seconds to end, then are
        killed and reported ``"killed"``, with their stacks — no ``WorldHangError``."""
        return self._collect(run_id, timeout, fail_grace)

    def _collect(self, run_id: int, timeout: float, fail_grace: float | None) -> WorldResult:
        # collect and run both call this, one frame below the test: the warning of a fault
        # that never fired (stacklevel 4) then points at the test's own line either way.
        try:
            raw = self.pool.collect(run_id, self.world_size, timeout, fail_grace=fail_grace)
        except WorldHangError as exc:
            raise WorldHangError(str(exc), exc.stacks, self._results(exc.results)) from None
        results = self._results(raw)
        self._warn_unfired(results)
        return results

    def _warn_unfired(self, results: WorldResult) -> None:
        fired = [f for r in results for f in r.faults]
        for fault in self._faults:
            if not any(fault.matches(point, where) and action == fault.action
                       for point, where, action in fired):
                warnings.warn(f"{fault!r} fired on no rank in this run: no rank reached "
                              f"that point with those coordinates (a round or bucket the run "
                              f"never had, or a rank that ended first)", UserWarning,
                              stacklevel=4)

    def _results(self, raw: Sequence[tuple[str, Any]]) -> WorldResult:
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
            elif kind == "killed":
                code, stacks = value
                out.append(RankResult(r, role, "killed", committed=committed, faults=fired,
                                      exitcode=code, stacks=stacks))
            else:
                status: Status = "frozen" if kind == "frozen" else "dead"
                out.append(RankResult(r, role, status, committed=committed, faults=fired,
                                      exitcode=value))
        return WorldResult(out)

    def run(self, fn: Target, *, kwargs: Mapping[str, Any] | None = None,
            per_rank: Callable[[int], Mapping[str, Any]] | None = None,
            faults: Sequence[Fault] = (), timeout: float = 60.0,
            job: str | None = None, fail_grace: float | None = None) -> WorldResult:
        """``start`` then ``collect``; a ``timeout`` or ``fail_grace`` that is NaN or
        negative is a ``ValueError`` before anything starts (here, and in ``collect``,
        ``events``, ``wait_event``)."""
        _check_waits(timeout, fail_grace)
        return self._collect(self.start(fn, kwargs=kwargs, per_rank=per_rank, faults=faults,
                                        job=job), timeout, fail_grace)

    async def arun(self, fn: Target, **kw: Any) -> WorldResult:
        """``run`` in a worker thread, for async tests (pytest-asyncio or anyio).

        Cancellation: the test stops waiting; the ranks finish or hit ``timeout``.
        """
        import anyio.to_thread

        return await anyio.to_thread.run_sync(functools.partial(self.run, fn, **kw),
                                              abandon_on_cancel=True)

    def wait_event(self, name: str, timeout: float = 30.0, *, rank: int | None = None
                   ) -> tuple[int, Any]:
        """The first ``ctx.event(name, payload)`` of the current run (of ``rank`` only, when
        given) that no earlier ``wait_event`` took: ``(rank, payload)``. The world's own
        names: ``"commit"`` (payload: the version, once per rank and round) and ``"fault"``
        (payload: ``(point, where, action)``, each fault as it fires) — those ``events``
        does not yield. An ``AssertionError`` (every rank's outcome so far, the first
        error's traceback) after ``timeout`` seconds, or at once when every rank (or
        ``rank``) ended without sending it; a name that is not a non-empty ``str``, or a
        rank outside the world, is a ``ValueError``."""
        if rank is not None and not (_is_index(rank) and 0 <= rank < self.world_size):
            raise ValueError(f"wait_event(rank={rank!r}): this world's ranks are 0 .. "
                             f"{self.world_size - 1}")
        return self.pool.wait_event(name, timeout, index=rank)

    def restart(self, rank: int) -> None:
        """Replace ``rank``'s process with a fresh one now (killing it if alive; one that
        already ended is just replaced); a rank outside the world is a ``ValueError``, here
        and in ``kill``, ``freeze``, ``stacks``."""
        self.pool.restart(self._rank(rank, "restart"))

    def kill(self, rank: int) -> None:
        """SIGKILL ``rank``'s process (it is replaced before the next run); nothing for one
        that already ended (it is dead as asked, and its pid may be another process's)."""
        self.pool.kill(self._rank(rank, "kill"))

    def freeze(self, rank: int) -> None:
        """SIGSTOP ``rank``'s process: its sockets stay open, it never answers. Returns
        once it is stopped. ``RankExitedError`` (with its exit code) where the process
        already ended, or ends before it stopped: there is nothing to freeze."""
        rank = self._rank(rank, "freeze")
        self._refuse_ended(rank, "freeze")
        pid = self.pool.pid(rank)
        os.kill(pid, signal.SIGSTOP)  # not reaped yet (only we reap it): still its pid
        # The stop takes effect when the process next runs: on a busy machine, later than
        # the next run's check for a stopped process (which then sends it a job).
        deadline = time.monotonic() + 5.0
        while (not _is_stopped(pid) and self.pool.alive(rank)
               and time.monotonic() < deadline):
            time.sleep(0.005)
        self._refuse_ended(rank, "freeze")

    def stacks(self, rank: int) -> str:
        """Every thread's stack of ``rank``'s process now (faulthandler), then where each
        task of its event loop waits; for a process still starting (its handlers not in
        place yet), a line saying so. ``RankExitedError`` (with its exit code) where the
        process already ended: it has no stacks."""
        rank = self._rank(rank, "stacks")
        self._refuse_ended(rank, "stacks")
        return self.pool.stacks(rank)

    def _refuse_ended(self, rank: int, what: str) -> None:
        if not self.pool.alive(rank):
            code = self.pool.exitcode(rank)
            raise RankExitedError(
                f"{what}({rank}): rank {rank}'s process exited ({_how_it_ended(code)}); it "
                f"is replaced before the next run, or now by restart({rank})",
                rank=rank, exitcode=code)

    def _rank(self, rank: int, what: str) -> int:
        # A list index would take -1 as the last rank: a test acting on the wrong process.
        if not _is_index(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what}({rank!r}): this world's ranks are 0 .. "
                             f"{self.world_size - 1}")
        return rank
