"""CUDA plumbing shared by the GPU data planes (``nccl`` and ``m2n``).

Theory of operation.

*Imports.* ``nccl.core`` (nccl4py) and ``nccl.m2n`` (nccl-extensions) are imported lazily,
once, and every failure becomes an actionable message: what to install, and — for ``m2n`` —
the libnccl version actually loaded, because ``nccl.m2n`` needs libnccl >= 2.30.5 while PyPI
torch pins 2.28.9 (REFERENCE §1, §3). The version is checked *before* ``nccl.m2n`` is imported:
with an older libnccl the import dies on an undefined symbol, which says nothing useful.

*Identity.* What must be equal on every rank (libnccl version, ``max_cta``, the matched
``NCCL_*`` variables of ``_proto.lanes.nccl_environment``, our own grouping switch) is
computed here, for the handshake's ``data_plane`` phase; ``gpu_unavailable_reason`` says
whether this process can run a GPU lane at all.

*Completion.* The event loop never blocks on CUDA. Work is ordered on three streams per
transport (pack, transfer, unpack); the transfer stream waits on the pack stream through an
event, the pack stream waits on the producer (the caller's current stream). The end of a
bucket's transfer is a CUDA event; one watcher thread per transport waits on the events in
order (``Event.synchronize()``, GIL released) and wakes the loop once per bucket; a thread-safe
``Signal`` carries errors and aborts: ``abort`` fires every pending signal, so a waiter returns
even when the GPU work never will (a dead peer in the middle of an M2N kernel, DEVELOPERS "GPU
notes").

Why a watcher on plain events by default: measured on H200s with one rank per GPU (x2 and x4
hosts, BENCHMARKS "Multi-GPU"), the m2n pipeline was 4-28 % slower when the loop polled
``Event.query()`` instead, whatever the polling cap (1 ms, 200 µs or 50 µs: the loop's polling
competes for the GIL with the native thread that submits reshards, while the watcher wakes the
loop once per bucket). Plain events, because recording a *blocking-sync* event
(``cudaEventBlockingSync``) after a bucket of M2N reshards made the bucket complete up to 3x
later on one GPU shared by four ranks (1024 small reshards: 1.88 s instead of 0.65 s). The
cost: while a bucket is in flight the watcher spins in the CUDA driver (one core per rank), and
a watcher stuck on a kernel that never ends (dead peer) keeps spinning until the process exits.
Hosts short of cores can choose ``M2N_ASYNC_CUDA_COMPLETION=poll`` (``Event.query()`` from the
loop with backoff from 20 µs to ``M2N_ASYNC_CUDA_POLL_MAX``, default 1 ms) or blocking-sync
events (``M2N_ASYNC_CUDA_EVENT=blocking``: the watcher sleeps).

*Native calls.* Everything that enters NCCL runs on the engine's ``NativeThread`` (thread
affinity of M2N groups, plan order). Communicator abort/destroy and M2N handle destroy run on a
separate short-lived daemon thread, bounded by a timeout: on this hardware ``ncclCommAbort``
does not return while an M2N kernel waits on a dead peer, and fail-stop must not hang on it.

*CPU mode.* With ``device="cpu"`` the streams and events are absent and every ordering point
is immediate. Only the fake-runtime tests use it (they exercise the transports' packing,
ordering and grouping logic without a GPU); the real transports refuse a CPU device.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import anyio

from m2n_async._data import _kernels
from m2n_async._data._native import poll_until, wait_threadsafe
from m2n_async._data._transport import Completion, Staging, Transport, TransportSettings
from m2n_async._proto.errors import LocalProtocolError, PlanError, TransferError
from m2n_async._proto.handshake import communicator_id, read_communicator_id
from m2n_async._proto.lanes import nccl_environment

if TYPE_CHECKING:
    import torch

    from m2n_async._data._native import NativeCall
    from m2n_async._data._transport import Rendezvous

__all__ = [
    "GPU_INSTALL_HINT",
    "M2N_MIN_LIBNCCL",
    "CudaCompletion",
    "GpuTransportBase",
    "Signal",
    "Streams",
    "bootstrap_advice",
    "gpu_unavailable_reason",
    "grouping_mode",
    "libnccl_version",
    "lookup_tensor",
    "m2n_module",
    "nccl_core",
    "reset_import_cache",
    "torch_dtype",
]

#: nccl.m2n calls ``ncclCommQueryProperties`` & co., first shipped in libnccl 2.30.5.
M2N_MIN_LIBNCCL: tuple[int, int, int] = (2, 30, 5)

GPU_INSTALL_HINT = (
    "install the GPU extra: pip install 'm2n_async[gpu]' (nccl4py==0.6.0, "
    "nccl-extensions==0.1.0, cuda-bindings>=13) on a CUDA host")
M2N_LIBNCCL_HINT = (
    "nccl.m2n needs libnccl >= 2.30.5; PyPI torch pins nvidia-nccl-cu13==2.28.9. Install "
    "`pip install nvidia-nccl-cu13==2.30.7` (or `nccl-extensions[cu13]`) over it — NCCL keeps "
    "its ABI — and make sure the process loads exactly that libnccl; or use transport='nccl'")

#: Our own switch for M2N grouping: "auto" (probe once after the communicator exists and
#: agree on every rank), "on" (group; a failure is an error) or "off" (ordered single calls).
GROUPING_ENV = "M2N_ASYNC_M2N_GROUPING"
#: "watch" (default: a watcher thread waits on the events, spinning while one is pending
#: unless they are blocking-sync) or "poll" (``Event.query()`` with backoff on the loop).
COMPLETION_ENV = "M2N_ASYNC_CUDA_COMPLETION"
#: "plain" (default) or "blocking" (``cudaEventBlockingSync``; slows M2N, see module doc).
EVENT_ENV = "M2N_ASYNC_CUDA_EVENT"
#: Longest gap, in seconds, between two ``Event.query()`` polls (the backoff's cap).
POLL_MAX_ENV = "M2N_ASYNC_CUDA_POLL_MAX"
_POLL_MAX_DEFAULT = 1e-3


def _poll_max() -> float:
    raw = os.environ.get(POLL_MAX_ENV, "").strip()
    if not raw:
        return _POLL_MAX_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 1e-6 <= value <= 1.0:
        raise ValueError(f"{POLL_MAX_ENV}={raw!r}: expected seconds in [1e-6, 1], e.g. 2e-4")
    return value


log = logging.getLogger("m2n_async")

_LOOPBACK = ("127.", "localhost", "::1", "[::1]")
_advised = False  # bootstrap_advice is logged once per process (NCCL's choice is, too)


def bootstrap_advice(host: str | None, environ: Mapping[str, str]) -> str | None:
    """The warning for a local job whose NCCL bootstrap is not pinned to loopback, else None.

    ``host`` is where the engine binds its own (Gloo) data plane: a loopback address means
    every rank is on this host (the store is on loopback). NCCL's bootstrap, though, listens
    on the interface NCCL picks itself, unauthenticated (docs/security.md). The engine does
    not set ``NCCL_SOCKET_IFNAME`` for it: NCCL reads it once per process, at the first
    bootstrap of any communicator, so a value set here would either come too late (the
    process's own NCCL ran first) or pin every later communicator of the process — a
    trainer's multi-host training ones included — to loopback. The launcher sets it."""
    if host is None or not host.startswith(_LOOPBACK):
        return None
    if environ.get("NCCL_SOCKET_IFNAME", "").strip():
        return None
    return ("NCCL_SOCKET_IFNAME is not set although every rank of this job is on this host "
            "(the store is on loopback): NCCL's bootstrap, which authenticates nothing, "
            "listens on the interface NCCL picks, reachable from the network. Set "
            "NCCL_SOCKET_IFNAME=lo for the job's processes in the launcher "
            "(docs/security.md, 'Binding').")


# -- lazy imports -----------------------------------------------------------------------------

_import_lock = threading.Lock()
_imported: dict[str, ModuleType | BaseException] = {}


def reset_import_cache() -> None:
    """Forget cached import results (tests swap fake ``nccl`` modules in and out)."""
    with _import_lock:
        _imported.clear()


def _import(name: str) -> ModuleType:
    with _import_lock:
        got = _imported.get(name)
        if got is None:
            try:
                got = importlib.import_module(name)
            except BaseException as exc:
                got = exc
            _imported[name] = got
    if isinstance(got, BaseException):
        raise got
    return got


def nccl_core() -> ModuleType:
    """``nccl.core`` (nccl4py), or ``LocalProtocolError`` saying what to install."""
    try:
        return _import("nccl.core")
    except Exception as exc:
        raise LocalProtocolError(
            f"cannot import nccl.core (nccl4py): {type(exc).__name__}: {exc}; "
            f"{GPU_INSTALL_HINT}") from exc


def _version_tuple(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split("+", 1)[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def libnccl_version() -> tuple[str | None, str | None]:
    """(version, path) of the libnccl this process loaded through nccl4py; (None, None)
    when nccl4py or libnccl is unavailable."""
    try:
        info = nccl_core().get_version().libnccl
    except Exception:
        return None, None
    if info is None:
        return None, None
    path = getattr(info, "path", None)
    return str(info.version), (str(path) if path is not None else None)


def m2n_module() -> ModuleType:
    """``nccl.m2n``, after checking the loaded libnccl is new enough (else an actionable
    ``LocalProtocolError`` naming the loaded version and path)."""
    nccl_core()
    version, path = libnccl_version()
    if version is None:
        raise LocalProtocolError(f"nccl4py imports but no libnccl could be loaded; "
                                 f"{GPU_INSTALL_HINT}")
    if _version_tuple(version) < M2N_MIN_LIBNCCL:
        raise LocalProtocolError(
            f"transport 'm2n' unavailable: the loaded libnccl is {version}"
            f"{f' ({path})' if path else ''}; {M2N_LIBNCCL_HINT}")
    try:
        return _import("nccl.m2n")
    except Exception as exc:
        raise LocalProtocolError(
            f"cannot import nccl.m2n (nccl-extensions) with libnccl {version}: "
            f"{type(exc).__name__}: {exc}; {GPU_INSTALL_HINT}") from exc


def grouping_mode() -> str:
    """The M2N grouping switch from ``M2N_ASYNC_M2N_GROUPING`` (default "auto")."""
    mode = os.environ.get(GROUPING_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise LocalProtocolError(f"{GROUPING_ENV}={mode!r}: expected 'auto', 'on' or 'off'")
    return mode


def _torch() -> Any:
    import torch

    return torch


def is_tensor(x: object) -> bool:
    """Duck-typed tensor test (torch stays lazy). Worker targets are not tested this way:
    their ``Sink.in_place`` says it, decided once per target."""
    return hasattr(x, "data_ptr") and hasattr(x, "is_contiguous")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a plan dtype name ("bfloat16", "float8_e4m3fn", ...)."""
    dtype = getattr(_torch(), name, None)
    if dtype is None or not isinstance(dtype, _torch().dtype):
        raise LocalProtocolError(f"this torch has no dtype {name!r}")
    return dtype  # type: ignore[no-any-return]


def resolve_device(settings: TransportSettings) -> torch.device:
    """The CUDA device a GPU transport runs on: ``settings.device`` or the current one."""
    torch = _torch()
    if settings.device is None:
        return torch.device("cuda", torch.cuda.current_device())  # type: ignore[no-any-return]
    dev = torch.device(settings.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev  # type: ignore[no-any-return]


def lookup_tensor(mapping: Mapping[str, Any], name: str, where: str) -> Any:
    """``mapping[name]``, or a ``PlanError`` naming the parameter and where it was needed."""
    try:
        return mapping[name]
    except KeyError:
        raise PlanError(f"parameter {name!r} is missing from this rank's tensors at "
                        f"{where}") from None


def gpu_unavailable_reason(transport: str, settings: TransportSettings) -> str | None:
    """None when this process can run ``transport`` ("nccl" or "m2n"), else why not —
    naming what to install and the libnccl version found. Creates no resource."""
    try:
        torch = _torch()
    except Exception as exc:  # pragma: no cover - torch is a hard dependency
        return f"torch cannot be imported: {exc}"
    if settings.device is not None and torch.device(settings.device).type != "cuda":
        return f"device {settings.device!r} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process (torch.cuda.is_available() is False)"
    try:
        dev = resolve_device(settings)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"device {dev} does not exist ({torch.cuda.device_count()} CUDA devices)"
        if transport == "m2n":
            m2n_module()
        else:
            nccl_core()
            if libnccl_version()[0] is None:
                return f"nccl4py imports but libnccl cannot be loaded; {GPU_INSTALL_HINT}"
    except LocalProtocolError as exc:
        return str(exc)
    return None


def _gpu_identity(transport: str, settings: TransportSettings) -> dict[str, str]:
    version, _ = libnccl_version()
    out = {"max_cta": "default" if settings.max_cta is None else str(settings.max_cta)}
    if version is not None:
        out["libnccl_version"] = version
    if transport == "m2n":
        out[GROUPING_ENV] = grouping_mode()
    out.update(dict(nccl_environment(os.environ)))
    return out


# -- completion: signals, watcher, streams ---------------------------------------------------


class Signal:
    """One-shot, thread-safe completion flag carrying an optional error."""

    __slots__ = ("_callbacks", "_done", "_lock", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self.error: BaseException | None = None
        self._callbacks: list[Callable[[Signal], None]] = []

    def done(self) -> bool:
        return self._done

    def fire(self, error: BaseException | None = None) -> bool:
        """Complete (first caller wins); returns whether this call completed it."""
        with self._lock:
            if self._done:
                return False
            self._done, self.error = True, error
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            with contextlib.suppress(Exception):
                fn(self)
        return True

    def add_done_callback(self, fn: Callable[[Signal], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)


class _Watcher:
    """A daemon thread waiting on CUDA events in FIFO order.

    FIFO is right because a transport records its events on one transfer stream (or one
    unpack stream) in submission order, so they complete in that order anyway. A watcher
    stuck on an event that never completes (dead peer) is left behind: ``abort`` fires the
    signals directly, and the thread is a daemon.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Signal] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"m2n-cuda-watch-{name}",
                                        daemon=True)
        self._thread.start()

    def watch(self, event: Any, signal: Signal) -> None:
        self._queue.put((event, signal))

    def close(self, timeout: float = 1.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, signal = item
            if signal.done():  # aborted meanwhile: do not wait on work that may never end
                continue
            try:
                event.synchronize()  # releases the GIL; spins unless blocking-sync
            except BaseException as exc:
                signal.fire(exc)
            else:
                signal.fire(None)
            del event, signal, item


class Streams:
    """The pack / transfer / unpack streams of one transport on one device.

    On a CPU device every method is a no-op and events are ``None`` (fake-runtime tests).
    """

    def __init__(self, device: torch.device) -> None:
        torch = _torch()
        self.device = device
        self.cuda = device.type == "cuda"
        self.blocking_events = os.environ.get(EVENT_ENV, "plain").strip().lower() == "blocking"
        if self.cuda:
            self.pack = torch.cuda.Stream(device)
            self.transfer = torch.cuda.Stream(device)
            self.unpack = torch.cuda.Stream(device)
        else:
            self.pack = self.transfer = self.unpack = None

    def ptr(self, stream: Any) -> int:
        """The raw ``cudaStream_t`` (what nccl4py and nccl.m2n take); 0 on CPU."""
        return int(stream.cuda_stream) if stream is not None else 0

    def producer(self) -> Any:
        """The caller's current stream on our device: where the weights were produced."""
        return _torch().cuda.current_stream(self.device) if self.cuda else None

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` (None on CPU): plain unless
        ``M2N_ASYNC_CUDA_EVENT=blocking``."""
        if not self.cuda:
            return None
        ev = _torch().cuda.Event(blocking=self.blocking_events)
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event_or_stream: Any) -> None:
        """Make ``stream`` wait for an event or for all work queued on another stream."""
        if not self.cuda or event_or_stream is None:
            return
        torch = _torch()
        if isinstance(event_or_stream, torch.cuda.Event):
            stream.wait_event(event_or_stream)
        else:
            stream.wait_stream(event_or_stream)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Run torch ops of the block on ``stream`` (and our device), autograd off: the
        block copies from sources and into targets that may be parameters requiring grad
        (an in-place write into such a leaf is refused; a copy from one records a graph
        that would tie the staging to it). The block must not ``await``: grad mode is the
        thread's, so the event loop's other tasks would run with it off."""
        torch = _torch()
        if not self.cuda:
            with torch.no_grad():
                yield
            return
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield


class CudaCompletion(Completion):
    """Completion of one bucket's transfer (or unpack): native submission, then a CUDA event.

    Holds ``keep`` (the staging buffers) until ``wait`` returned successfully or the
    transport was aborted — never earlier, so the caching allocator cannot recycle memory a
    stream still reads or writes.
    """

    def __init__(self, transport: GpuTransportBase, keep: object, what: str, *,
                 call: NativeCall[Any] | None = None, event: Any = None) -> None:
        self._t = transport
        self._keep = keep
        self.what = what
        self.signal = Signal()
        self.event: Any = None
        transport._track(self.signal)
        if call is not None:
            call.add_done_callback(self._submitted)
        else:
            self._arm(event)

    def _arm(self, event: Any) -> None:
        self.event = event
        if event is None:
            self.signal.fire(None)
        elif not self._t._poll:
            self._t._watcher_watch(event, self.signal)
        # else: wait() polls event.query()

    def _submitted(self, call: NativeCall[Any]) -> None:
        # Runs on the native thread right after the submission call returned.
        exc = call.exception()
        if exc is not None:
            self.signal.fire(self._t.translate(exc, self.what))
            return
        self._arm(call.result())

    def done(self) -> bool:
        return self.signal.done()

    async def wait(self) -> None:
        """See ``Completion.wait``.

        Cancellation: stops waiting only; the buffers stay referenced (by this completion
        and its staging) until the engine aborts the transport and closes it.
        """
        deadline = self._t._deadline
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            with anyio.fail_after(timeout):
                if self._t._poll and not self.signal.done():
                    await self._poll()
                else:
                    await wait_threadsafe(self.signal.add_done_callback)
        except TimeoutError:
            raise TimeoutError(
                f"{self._t.name}: {self.what} did not complete before the round deadline "
                f"(native thread running {self._t.ctx.native.current_call!r}) at "
                f"{self._t.ctx.where(round=self._t.round)}") from None
        if self.signal.error is not None:
            raise self.signal.error
        self._keep = None
        self._t._untrack(self.signal)

    async def _poll(self) -> None:
        def ready() -> bool:
            if self.signal.done():
                return True
            ev = self.event
            if ev is not None and ev.query():
                self.signal.fire(None)
            return self.signal.done()

        cap = self._t._poll_max
        await poll_until(ready, first=min(20e-6, cap), maximum=cap)


class GpuTransportBase(Transport):
    """What ``nccl`` and ``m2n`` share: device and streams, the communicator (unique id via
    the rendezvous, init on the native thread), completions, bounded fail-stop abort."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.device: torch.device | None = None
        self.streams: Streams | None = None
        self.comm: Any = None
        self._nc: ModuleType | None = None
        self._watcher: _Watcher | None = None
        completion = os.environ.get(COMPLETION_ENV, "watch").strip().lower()
        if completion not in ("watch", "poll"):
            raise ValueError(f"{COMPLETION_ENV}={completion!r}: expected 'watch' or 'poll'")
        self._poll = completion == "poll"
        self._poll_max = _poll_max()
        self._pending: set[Signal] = set()
        self._pending_lock = threading.Lock()
        self._teardown_lock = threading.Lock()
        self._teardown_thread: threading.Thread | None = None
        self._torn_down = False
        self._closed = False

    # -- class level ---------------------------------------------------------------------

    @classmethod
    def unavailable_reason(cls, settings: TransportSettings) -> str | None:
        return gpu_unavailable_reason(cls.name, settings)

    @classmethod
    def identity(cls, settings: TransportSettings) -> dict[str, str]:
        return _gpu_identity(cls.name, settings)

    # -- lifecycle -----------------------------------------------------------------------

    def _select_device(self) -> torch.device:
        dev = resolve_device(self.ctx.settings) if self.ctx.settings.device != "cpu" else (
            _torch().device("cpu"))
        return dev

    async def prepare(self) -> None:
        """runtime_ready: pick the device, create the streams and the completion watcher,
        bind the native thread to the device. Local only.

        Cancellation: whatever was created is released by ``close``.
        """
        self.check_usable()
        self._nc = nccl_core()
        dev = self._select_device()
        self.device = dev
        self.streams = Streams(dev)
        if self.streams.cuda:
            torch = _torch()
            # torch's current device is per thread: the native thread launches NCCL/M2N
            # kernels and the loop thread launches pack/unpack copies; both need it.
            await self.ctx.native.run(torch.cuda.set_device, dev,
                                      description="cuda.set_device")
            torch.cuda.set_device(dev)
            if not self._poll:
                self._watcher = _Watcher(f"{self.name}-r{self.ctx.rank}")
            # The Triton copy compiles on first launch: do it now, on a thread, not in the
            # first round's pack (``_kernels.warm_up``; a no-op without Triton).
            if _kernels.available():
                wires = sorted({p.spec.dtype for p in self.ctx.plan.params})
                await anyio.to_thread.run_sync(
                    _kernels.warm_up, dev, [torch_dtype(w) for w in wires])

    async def _warm_copies(self, forms: Callable[[], list[_kernels.Form]]) -> None:
        """Compile the copy kernel's variants that ``forms()`` foresees for this rank's
        rounds, listing and compiling both on a thread (``_kernels.Form``; nothing without
        CUDA or Triton), within ``_kernels.WARM_BUDGET_S``. A warm-up only spares the first
        round its compiles on the event loop: a failure to foresee is logged, and those
        copies compile in the round, as they would without it.

        Cancellation: the thread runs to its end (bounded by the budget) before this
        returns."""
        assert self.streams is not None
        if not (self.streams.cuda and _kernels.available()):
            return

        def run() -> None:
            try:
                found = forms()
            except Exception as exc:
                log.warning("%s: rank %d could not list its copies' kernel forms (%r); "
                            "they compile in the first round instead", self.name,
                            self.ctx.rank, exc)
                return
            if found:
                _kernels.warm_forms(self.device, found)

        await anyio.to_thread.run_sync(run)

    async def connect(self, rendezvous: Rendezvous) -> None:
        """Create the communicator over all ``world_size`` ranks: rank 0 makes the unique id,
        the rendezvous broadcasts it with its SHA-256 and the generation (every rank checks
        both: ``RemoteProtocolError`` naming rank 0), every rank runs ``Communicator.init``
        on the native thread, bounded by ``rendezvous.timeout`` (as every step of connect).

        Cancellation: the init keeps running on the native thread; a communicator it creates
        after this returned (cancelled or timed out), or after the transport was aborted, is
        aborted as soon as it exists, so no failed connect leaves one behind.
        """
        self.check_usable()
        global _advised
        advice = None if _advised else bootstrap_advice(self.ctx.settings.host, os.environ)
        if advice is not None:
            _advised = True
            log.warning("%s: %s", self.name, advice)
        nc = self._nc or nccl_core()
        published = None
        if self.ctx.rank == 0:
            published = communicator_id(self.ctx.generation, bytes(nc.get_unique_id().as_bytes))
        uid = read_communicator_id(await rendezvous.broadcast(published, name="nccl-unique-id"),
                                   self.ctx.generation)

        def init() -> Any:
            return nc.Communicator.init(nranks=self.ctx.world_size, rank=self.ctx.rank,
                                        unique_id=nc.UniqueId.from_bytes(uid))

        call = self.ctx.native.submit(init, description="nccl Communicator.init")
        try:
            with anyio.fail_after(rendezvous.timeout):
                comm = await call.wait()
        except TimeoutError:
            call.add_done_callback(self._adopt_late)
            raise TimeoutError(
                f"{self.name}: NCCL communicator init did not finish within "
                f"{rendezvous.timeout}s at {self.ctx.where()} (a peer did not "
                f"join, or NCCL_* settings differ)") from None
        except Exception as exc:
            raise self.translate(exc, "communicator init") from exc
        except BaseException:  # cancelled: the init goes on without us
            call.add_done_callback(self._adopt_late)
            raise
        if not self._adopt(comm):  # aborted while the init ran
            self.check_usable()
            raise TransferError(f"{self.name}: closed while the communicator was created at "
                                f"{self.ctx.where()}", rank=self.ctx.rank)
        await self._after_connect(rendezvous)

    def _adopt(self, comm: Any) -> bool:
        """Keep the new communicator, unless teardown has begun: then abort it (off the loop)
        and return False. Any thread."""
        with self._teardown_lock:
            if self._teardown_thread is None and not self._torn_down:
                self.comm = comm
                return True
        threading.Thread(target=_abort_quietly, args=(comm,), daemon=True,
                         name=f"m2n-late-comm-{self.name}-r{self.ctx.rank}").start()
        return False

    def _adopt_late(self, call: NativeCall[Any]) -> None:
        """Done callback of an init whose connect gave up: nobody will use its communicator."""
        if call.exception() is None:
            # Kept if the transport is still open (its close aborts it), else aborted now.
            self._adopt(call.result())

    async def _after_connect(self, rendezvous: Rendezvous) -> None:
        """Subclass hook: collective setup right after the communicator exists."""

    # -- completions ---------------------------------------------------------------------

    def _track(self, signal: Signal) -> None:
        with self._pending_lock:
            if self._abort_reason is not None:
                signal.fire(self._abort_error())
                return
            self._pending.add(signal)

    def _untrack(self, signal: Signal) -> None:
        with self._pending_lock:
            self._pending.discard(signal)

    def _watcher_watch(self, event: Any, signal: Signal) -> None:
        if self._watcher is None:
            signal.fire(None if event is None else _sync_now(event))
        else:
            self._watcher.watch(event, signal)

    def _abort_error(self) -> TransferError:
        return TransferError(f"{self.name} transport aborted ({self._abort_reason}) at "
                             f"{self.ctx.where(round=self._round)}",
                             rank=self.ctx.rank, round=self._round)

    def translate(self, exc: BaseException, what: str) -> BaseException:
        """A native exception as ``TransferError`` naming transport, place and cause."""
        if isinstance(exc, TransferError | TimeoutError | LocalProtocolError):
            return exc
        if self._abort_reason is not None:
            return self._abort_error()
        detail = getattr(exc, "detail", None)
        msg = f"{type(exc).__name__}: {detail or exc}"
        return TransferError(f"{self.name}: {what} failed at "
                             f"{self.ctx.where(round=self._round)}: {msg}",
                             rank=self.ctx.rank, round=self._round)

    def submit(self, fn: Callable[[], Any], keep: object, what: str) -> CudaCompletion:
        """Run ``fn`` (which enqueues GPU work and returns the event recorded after it, or
        None) on the native thread; the completion fires when that event completed."""
        self.check_usable()
        call = self.ctx.native.submit(fn, description=f"{self.name} {what}")
        return CudaCompletion(self, keep, what, call=call)

    def completion_of(self, event: Any, keep: object, what: str) -> CudaCompletion:
        """A completion for an event recorded on the loop thread (pack/unpack streams)."""
        return CudaCompletion(self, keep, what, event=event)

    def begin_transfer(self, ready: Any, where: str) -> tuple[Any, Any, int]:
        """Native thread, first thing of a bucket's transfer: ``(comm, stream, stream
        pointer)`` of the transfer stream, made to wait on ``ready`` (the bucket's pack /
        targets-free event). Refuses an aborted transport or a missing communicator."""
        self.check_usable()
        comm = self.comm
        if comm is None:
            raise TransferError(f"{self.name}: no communicator (connect did not run) at "
                                f"{where}", rank=self.ctx.rank)
        streams = self.streams
        assert streams is not None
        stream = streams.transfer
        streams.wait(stream, ready)
        return comm, stream, streams.ptr(stream)

    async def finish_unpack(self, staging: Staging, copied: bool,
                            callbacks: list[tuple[str, Any, Any]]) -> None:
        """End of a worker's unpack: wait for the unpack stream when it ``copied`` anything,
        then hand the received tensors to load callbacks (they must see the bytes)."""
        if copied:
            assert self.streams is not None
            await self.completion_of(self.streams.record(self.streams.unpack), staging,
                                     f"bucket {staging.bucket.index} unpack").wait()
        await self.run_load_callbacks(callbacks)

    async def run_load_callbacks(self, callbacks: list[tuple[str, Any, Any]]) -> None:
        """Hand received tensors to load callbacks, in plan order, off the event loop.

        A callback may run arbitrary user code (dequantize, fuse, copy into an engine's own
        storage), so it runs on a worker thread with this transport's device current —
        never on the loop, whose lag budget is milliseconds. The tensor it gets is a view of
        staging that a later bucket's transfer reuses, so the GPU work a callback enqueued
        on that thread's current stream (a clone, a copy out) completes before this returns:
        the transfer stream is not ordered after that stream otherwise.
        """
        if not callbacks:
            return
        device = self.device

        def call_all() -> None:
            torch = _torch()
            cuda = device is not None and device.type == "cuda"
            if cuda:
                torch.cuda.set_device(device)
            for name, fn, tensor in callbacks:
                try:
                    with torch.no_grad():  # a callback copies into parameters (LoadTarget.into)
                        fn(name, tensor)
                except Exception as exc:
                    err = TransferError(
                        f"{self.name}: load callback for parameter {name!r} raised at "
                        f"{self.ctx.where(round=self.round)}: {exc!r}",
                        rank=self.ctx.rank, round=self.round)
                    err.own_step = True  # type: ignore[attr-defined]  # this rank's, no peer's
                    raise err from exc
            if cuda:
                torch.cuda.current_stream(device).synchronize()

        # abandon_on_cancel: a callback that hangs must not hold the round past its deadline
        # or an abort (as the engine's source resolvers); its thread finishes on its own,
        # holding its views (they keep the staging alive), and the round has failed by then
        await anyio.to_thread.run_sync(call_all, abandon_on_cancel=True)

    # -- fail-stop ------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Fail-stop: wake every waiter with ``TransferError``, then abort the communicator
        on a separate daemon thread (never the loop, never the possibly-blocked native
        thread). Returns at once; ``close`` waits for the abort at most the settings'
        ``close_timeout``."""
        with self._pending_lock:
            if self._abort_reason is None:
                self._abort_reason = reason
            pending, self._pending = self._pending, set()
        err = self._abort_error()
        for sig in pending:
            sig.fire(err)
        self._start_teardown(abort=True)

    def _start_teardown(self, *, abort: bool) -> threading.Thread | None:
        with self._teardown_lock:
            if self._teardown_thread is not None or self._torn_down:
                return self._teardown_thread
            comm, self.comm = self.comm, None
            extra = self._release_native_resources()

            def run() -> None:
                if comm is not None:
                    with contextlib.suppress(Exception):
                        # abort on both paths: destroy is an intra-node collective and
                        # would wait for peers that may be gone (REFERENCE §2).
                        comm.abort()
                for fn in extra:
                    with contextlib.suppress(Exception):
                        fn()

            th = threading.Thread(target=run, name=f"m2n-abort-{self.name}-r{self.ctx.rank}",
                                  daemon=True)
            self._teardown_thread = th
            th.start()
            return th

    def _release_native_resources(self) -> list[Callable[[], None]]:
        """Subclass hook: callables run after the communicator abort (e.g. handle destroy)."""
        return []

    async def close(self) -> None:
        """Abort the communicator (bounded, off the loop), release handles, stop the watcher.

        Cancellation: run shielded (the engine does); a cancelled close leaves the abort
        thread running on its own.
        """
        if self._closed:
            return
        self._closed = True
        self._sink_cache = None  # the caller's targets: a closed transport keeps none alive
        with self._pending_lock:
            pending, self._pending = self._pending, set()
        for sig in pending:
            sig.fire(TransferError(f"{self.name} transport closed at {self.ctx.where()}",
                                   rank=self.ctx.rank))
        # One bound for the whole close (the settings' close_timeout: the engine's
        # abort_grace), and the watcher is stopped whatever happens to the waits: a close cut
        # short by its caller must not leave the watcher thread behind.
        deadline = anyio.current_time() + self.ctx.settings.close_timeout
        try:
            if (self.streams is not None and self.streams.cuda
                    and self._abort_reason is None):
                # Clean close: let queued GPU work finish before the communicator goes.
                ev = self.streams.record(self.streams.transfer)
                with anyio.move_on_after(max(deadline - anyio.current_time(), 0.0)):
                    await poll_until(ev.query, maximum=5e-3)
            th = self._start_teardown(abort=self._abort_reason is not None)
            if th is not None:
                with anyio.move_on_after(max(deadline - anyio.current_time(), 0.0)):
                    await poll_until(lambda: not th.is_alive(), maximum=20e-3)
        finally:
            self._torn_down = True
            if self._watcher is not None:
                self._watcher.close(timeout=0.0)
                self._watcher = None

    @property
    def teardown_finished(self) -> bool:
        """Whether the communicator abort (and handle destroy) returned; False while it is
        still running (it may never return after a peer died inside an M2N kernel)."""
        th = self._teardown_thread
        return th is None or not th.is_alive()


def _sync_now(event: Any) -> BaseException | None:
    try:
        event.synchronize()
    except BaseException as exc:
        return exc
    return None


def _abort_quietly(comm: Any) -> None:
    with contextlib.suppress(Exception):
        comm.abort()
