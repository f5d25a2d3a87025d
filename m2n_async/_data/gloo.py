"""The ``gloo`` transport: the planner's packed per-peer buffers over Gloo point-to-point.

Theory of operation. Every rank builds its own ``torch.distributed.ProcessGroupGloo``
directly — never ``init_process_group`` — so a trainer's default process group (its own
torch.distributed world) keeps working beside it. The group's rendezvous goes through a
``torch.distributed.Store`` subclass that forwards to the engine's async store under the
generation's prefix: no second TCPStore binding the wildcard address, no pickle, keys of a
stale generation unreadable. The group binds ``TransportSettings.host`` (127.0.0.1 for a
loopback store).

Pair check. Gloo's TCP pairs authenticate nothing: its listener gives a pair the first
connection that sends the pair's sequence number, so a process without the token that
connects to a fresh listener first takes the real peer's place, and the group still builds.
``connect`` therefore checks, on the native thread, every pair the plan uses before it
returns (``_check_pairs``: a digest under a nonce only token holders can read, bounded by
min(10 s, the rendezvous timeout)): a foreign or dead pair costs a connect failure within
that bound, naming the peer, instead of a first round that waits until its deadline.

Per bucket, each rank moves its bytes for each peer as a few messages (``_packing``): large
pieces alone, runs of small ones packed together. The trainer packs on a pack thread, the
native thread issues every send/recv of the bucket (tag = bucket index; Gloo matches messages
of one pair and tag in order) without blocking, interleaved across peers by bytes posted (Gloo
writes a send in the calling thread while the socket takes it, so posting one peer's messages
first would leave the other pairs idle), a wait thread waits for them with the round deadline
as timeout — each peer's last message first, one wake-up per peer — (so the next bucket's
messages are queued while this one moves), and the worker scatters on an unpack thread into
its targets or hands shards to load callbacks. A message that is one contiguous range of the
local shard moves zero-copy: sent straight from the trainer's shard, received straight into
the worker's target.

Casts (fp32 master weights, bf16 on the wire; ``_packing`` module docstring). A source whose
dtype is not the wire dtype is cast by the packing copy itself: its segments go into the
same ``_foreach_copy_`` calls as everything else, typed (wire dtype in the arena, source dtype
in the shard), so there is no cast copy of the shard and no second pass. Its messages never
move zero-copy; they are staged in the arena, which grows (once, at the first round that
casts) to what the bucket then stages — at most the bucket's bytes for this rank, the bound
the pipeline already holds. A cast segment at an arena offset not aligned to the wire dtype
goes through a temporary of its size (``_packing``), which the staging holds until release
and counts in ``Staging.nbytes`` beside the arena. ``Staging.cast_bytes`` counts the wire
bytes produced by casting.

Staging comes from ``max_inflight`` equal arenas (sized once from this rank's largest bucket;
the trainer's are allocated and touched in ``prepare``), so pages are faulted in once, not
every round; bucket i takes arena slot i mod ``max_inflight``, so it gets the same arena
every round. That is what makes the per-round work small: the views of a packed message in
its arena (and the worker's target views) are built once and cached, and a message is packed
or scattered with one ``torch._foreach_copy_`` per 512 segments — whole shards are copied from
the tensors the caller passed, with no view per round. Small segments (at most 8 KiB, in
groups of at least 16 of one size) go through address tables instead (``_hostcopy``): a
worker scatters them with one ``index_copy_`` per group (``HostScatter``, cached with the
message's views, rebuilt when a target's address changes), and a trainer gathers a message
of whole shards whose addresses are the same as last round's with one ``index_select`` per
group (``HostGather``; a message whose sources move every round keeps ``torch.cat``), fp32
masters included, cast by one ``copy_`` per group.
``_foreach_copy_`` runs one ``copy_`` per pair on the CPU, 0.5-0.8 us each; a table scatters
a 64 B segment in ~0.08 us (most of it the version bump) and gathers one in ~0.004 us plus
the ~0.1 us of reading and comparing its address, where ``torch.cat`` takes ~0.17 us
(``bench/cpu_host_copy.py``; BENCHMARKS "Host copies"). Torch releases the GIL inside those
calls, so the Python between them stays short and the event loop never waits long for the
GIL. The group is created on a thread at nice +5, so Gloo's I/O thread (which inherits it and
does the socket copies) gives way to the event loop on an oversubscribed machine, like the
pack/unpack threads.

Abort. Gloo has no way to cancel a pending point-to-point op, and ``ProcessGroup.abort`` /
``shutdown`` do not wake a blocked ``wait``. What does: a second ``wait`` on the same op with a
1 ms timeout. It fails, and Gloo closes that op's pair, which wakes the blocked waiter at once
and makes the peer's side of the pair fail with "connection closed" — so an abort here also
makes the peers' pending ops return promptly. ``abort`` therefore force-times-out every
pending op (1 ms each, from any thread) after marking the transport aborted under the lock
the native thread takes before issuing new ops. A peer process that dies closes its sockets,
which fails our pending ops the same way. Gloo's ``wait`` also consumes an op's completion, so
an op that had finished when ``abort`` waited on it would block the wait thread's own wait on
it until the round deadline (and ``close`` for ``abort_grace``): the wait thread therefore
waits 1 ms only once the transport is aborted. A wait it had already begun, or was about to
begin, when ``abort`` ran can still be caught that way (rare: at most 1 in 10 aborted rounds
in kill-at-random chaos runs); it ends at the round deadline.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import operator
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from m2n_async._data._hostcopy import HostGather, HostScatter
from m2n_async._data._native import NativeCall, NativeThread, threadsafe_notifier
from m2n_async._data._packing import (
    DIRECT_MIN_BYTES,
    FOREACH_CHUNK,
    BucketPacking,
    Message,
    Segment,
    byte_view,
    element_region,
    flat_bytes,
    foreach_copy,
    plan_bucket,
    unpack_pair,
)
from m2n_async._data._transport import (
    Completion,
    NativeCompletion,
    Rendezvous,
    SinkLike,
    SinkMap,
    Staging,
    Transport,
    TransportContext,
    TransportSettings,
)
from m2n_async._proto.errors import LocalProtocolError, PeerLostError, PlanError, TransferError

if TYPE_CHECKING:
    from m2n_async._proto.plan import Bucket
    from m2n_async._store import Store

__all__ = ["GlooTransport", "StoreAdapter"]

_FORCE_CLOSE = datetime.timedelta(milliseconds=1)
#: The pair check (``GlooTransport._check_pairs``): its bound, its tag (no bucket's: the
#: check is over before the first round) and its digest.
_CHECK_SECONDS = 10.0
_CHECK_SLACK = 5.0  # the loop-side bound beyond the check's own (its waits end first)
_CHECK_TAG = (1 << 31) - 1
_CHECK_DOMAIN = b"m2n-async gloo pair check v1"
#: A bucket whose messages are all zero-copy on the trainer is "packed" (views built) inline
#: on the event loop when it has at most this many messages.
_INLINE_MESSAGES = 64
#: A thread posting many ops in a row releases the GIL inside each call but takes it back
#: before the event loop thread, woken, gets it: the loop then waits for CPython's 5 ms
#: switch interval. Sleeping briefly every few ops hands the GIL over. Measured on the CPU
#: bench (mixed rounds, 113 messages): lag p99 above the control +1.5 ms -> +0.4 ms (median
#: of 5 alternating runs), throughput unchanged.
_HANDOFF_EVERY = 16
_HANDOFF_SECONDS = 100e-6
#: Segments per ``_foreach_copy_`` call when packing or scattering many small tensors.
_FOREACH_CHUNK = FOREACH_CHUNK
#: Niceness of the pack/unpack threads: bulk copies give way to the event loop (and to the
#: latency-bound native/wait threads) when the machine is oversubscribed.
_BULK_NICE = 5


class StoreAdapter(torch.distributed.Store):  # type: ignore[misc,name-defined]
    """A c10d ``Store`` that forwards to an async ``Store`` (ours) from a foreign thread.

    Gloo's rendezvous calls ``set``, ``get`` and ``wait`` on the thread that constructs the
    process group (our native thread); each call runs as a coroutine on the engine's event
    loop (``anyio.from_thread.run`` with the loop's token), under ``prefix``, bounded by
    ``timeout`` and failing at once on a lost peer (``watch``). ``cancel_all`` (from any
    thread) cancels the calls in flight, so an abort during connect does not wait for the
    timeout.
    """

    def __init__(self, store: Store, prefix: str, *, timeout: float,
                 watch: Sequence[str] = ()) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix
        self._timeout = timeout
        self._watch = tuple(watch)
        self._token = anyio.lowlevel.current_token()
        self._scopes: set[anyio.CancelScope] = set()
        self._cancelled: str | None = None
        # Through a weak reference: a notifier holding the bound method would make a cycle
        # (adapter -> notifier -> adapter) that, with the event loop it also holds, only the
        # garbage collector frees.
        ref = weakref.ref(self)

        def cancel_scopes() -> None:
            adapter = ref()
            if adapter is not None:
                adapter._cancel_scopes()
        self._cancel_soon = threadsafe_notifier(cancel_scopes)

    # -- plumbing ------------------------------------------------------------------------

    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            if self._cancelled is not None:
                raise RuntimeError(f"gloo rendezvous {what}: aborted ({self._cancelled})")
            with anyio.CancelScope() as scope:
                self._scopes.add(scope)
                try:
                    with anyio.fail_after(self._timeout):
                        return await fn()
                finally:
                    self._scopes.discard(scope)
            raise RuntimeError(f"gloo rendezvous {what}: aborted ({self._cancelled})")

        return anyio.from_thread.run(call, token=self._token)

    def _cancel_scopes(self) -> None:
        for scope in list(self._scopes):
            scope.cancel()

    def cancel_all(self, reason: str) -> None:
        """Cancel pending and future calls (thread-safe)."""
        self._cancelled = reason
        self._cancel_soon()

    def close(self) -> None:
        """Refuse further calls and drop what this adapter holds (the loop's notifier)."""
        self._cancelled = self._cancelled or "closed"
        self._scopes.clear()
        self._cancel_soon = _nothing

    def _key(self, key: str) -> str:
        return self._prefix + key

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    # -- the c10d Store interface Gloo uses ------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        data = self._bytes(value)
        self._run(f"set {key!r}", lambda: self._store.set(self._key(key), data))

    def get(self, key: str) -> bytes:
        async def get() -> bytes:
            got = await self._store.get(self._key(key), wait=True, watch=self._watch)
            if got is None:  # pragma: no cover - get(wait=True) returns bytes by contract
                raise RuntimeError(f"gloo rendezvous key {key!r} vanished")
            return got
        result: bytes = self._run(f"get {key!r}", get)
        return result

    def wait(self, keys: Sequence[str], timeout: Any = None) -> None:
        full = [self._key(k) for k in keys]
        self._run(f"wait {list(keys)!r}", lambda: self._store.wait(full, watch=self._watch))

    def check(self, keys: Sequence[str]) -> bool:
        async def check() -> bool:
            for k in keys:
                if await self._store.get(self._key(k)) is None:
                    return False
            return True
        result: bool = self._run("check", check)
        return result

    def add(self, key: str, value: int) -> int:
        result: int = self._run(f"add {key!r}", lambda: self._store.add(self._key(key), value))
        return result

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        exp = self._bytes(expected) if expected else None
        des = self._bytes(desired)

        async def cas() -> bytes:
            _, current = await self._store.compare_set(self._key(key), exp, des)
            return current if current is not None else b""
        result: bytes = self._run(f"compare_set {key!r}", cas)
        return result

    def delete_key(self, key: str) -> bool:
        result: bool = self._run(f"delete {key!r}", lambda: self._store.delete(self._key(key)))
        return result

    def num_keys(self) -> int:  # not used by Gloo; our store cannot count cheaply
        raise RuntimeError("StoreAdapter.num_keys is not supported")


def _nothing() -> None:
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _pair_digest(nonce: bytes, prefix: str, sender: int, receiver: int) -> bytes:
    """What ``sender`` sends ``receiver`` in the pair check: an HMAC of the pair's direction
    and the generation's prefix under the generation's nonce. Binding the direction means a
    foreigner cannot answer with the digest it was sent; the prefix, that a digest of one
    job or generation does not pass in another."""
    msg = b"\0".join((_CHECK_DOMAIN, prefix.encode(), b"%d" % sender, b"%d" % receiver))
    return hmac.new(nonce, msg, hashlib.sha256).digest()


class _Arenas:
    """At most ``slots`` equal-size uint8 buffers, reused across buckets and rounds.

    Bucket ``i`` asks for slot ``i % slots``. The pipeline takes a slot before staging a
    bucket and frees slots in bucket order, so that slot is free whenever the pipeline runs
    ``max_inflight == slots`` deep: every bucket gets the same arena every round, which is
    what lets the per-message views into it be built once (``GlooTransport._views``). A
    busy slot (not expected) falls back to any free arena, or a temporary extra one.
    """

    def __init__(self, size: int, slots: int) -> None:
        self.size = size
        self.slots = max(slots, 1)
        self._arenas: dict[int, torch.Tensor] = {}  # slot -> arena
        self._slot_of: dict[int, int] = {}          # arena data_ptr -> slot
        self._free: set[int] = set()
        self._lock = threading.Lock()
        self.allocated = 0         # arenas alive (slots and temporary extra ones)
        self.allocated_bytes = 0

    def _new(self) -> torch.Tensor:
        self.allocated += 1
        self.allocated_bytes += self.size
        return torch.empty(self.size, dtype=torch.uint8)

    def _drop(self, buf: torch.Tensor) -> None:
        self.allocated -= 1
        self.allocated_bytes -= buf.numel()

    def grow(self, size: int) -> None:
        """Make arenas ``size`` bytes from now on (a round that casts stages messages that
        otherwise move zero-copy): free slot arenas are dropped at once, busy ones when they
        are released."""
        with self._lock:
            if size <= self.size:
                return
            self.size = size
            for slot in self._free:
                arena = self._arenas.pop(slot)
                del self._slot_of[arena.data_ptr()]
                self._drop(arena)
            self._free.clear()

    def acquire(self, nbytes: int, slot: int = 0) -> torch.Tensor:
        if nbytes > self.size:  # cannot happen: size is the largest bucket's staging
            raise LocalProtocolError(f"staging of {nbytes} bytes exceeds the arena size "
                                     f"{self.size}")
        slot %= self.slots
        with self._lock:
            if slot in self._free:
                self._free.discard(slot)
                return self._arenas[slot]
            if slot not in self._arenas:
                arena = self._arenas[slot] = self._new()
                self._slot_of[arena.data_ptr()] = slot
                return arena
            if self._free:
                return self._arenas[self._free.pop()]
            return self._new()  # an extra one, dropped on release

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            slot = self._slot_of.get(buf.data_ptr())
            if slot is None or self._arenas.get(slot) is not buf:
                self._drop(buf)
            elif buf.numel() < self.size:  # outgrown while busy (``grow``)
                del self._arenas[slot], self._slot_of[buf.data_ptr()]
                self._drop(buf)
            else:
                self._free.add(slot)

    def owns(self, buf: torch.Tensor) -> bool:
        """``buf`` is one of the slots' arenas (not a temporary extra one): views of it may
        be cached, they never keep memory alive beyond the bound."""
        slot = self._slot_of.get(buf.data_ptr())
        return slot is not None and self._arenas.get(slot) is buf

    def warm(self, n: int) -> None:
        """Allocate and touch the first ``n`` slots' arenas up front."""
        bufs = [self.acquire(self.size, i) for i in range(min(n, self.slots))]
        for b in bufs:
            b.zero_()
            self.release(b)

    def clear(self) -> None:
        with self._lock:
            self._arenas.clear()
            self._slot_of.clear()
            self._free.clear()


class _Copies(NamedTuple):
    """One packed message's copies as ``torch._foreach_copy_`` calls: destinations fixed
    (views of the arena, built once per message and arena), sources per round."""

    ptr: int                                   # data_ptr of the message's buffer
    dsts: list[torch.Tensor]
    #: per segment: (param, how, arg, nbytes). _WHOLE: the source is the local shard itself
    #: (the destination is typed and shaped like it, so a float source of another dtype is
    #: cast by the copy); _SPAN: its flat bytes [arg[0]:arg[1]]; _STRIDED: its byte view
    #: [arg] (a tuple of slices; the destination has the region's shape). Cast sources:
    #: _CAST_SPAN: its flat elements [arg[0]:arg[1]] (typed destination); _CAST_STRIDED: its
    #: elements [arg] (typed destination of the region's shape); _CAST_TEMP: the region
    #: ``arg`` (element slices) cast into a temporary, copied as bytes (the destination is not
    #: aligned to the wire item size).
    srcs: list[tuple[int, int, Any, int]]
    #: (param, cast) for every param whose copies depend on whether its source is cast
    #: (everything but _WHOLE): the copies are rebuilt when that changes.
    casts: tuple[tuple[int, bool], ...]


_WHOLE, _SPAN, _STRIDED, _CAST_SPAN, _CAST_STRIDED, _CAST_TEMP = range(6)

_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr  # the C method: no Python frame per tensor


class _Cats(NamedTuple):
    """A packed message made only of whole shards, as ``torch.cat(out=...)`` calls: per
    round one ``itemgetter`` fetches its sources and one C-level pass compares their
    dtypes with the wire's; no Python per segment. ``cat`` copies a contiguous input with
    one memcpy, ``_foreach_copy_`` builds a TensorIterator per pair: 190 vs 680 ns per 64 B
    shard on the CPU bench's box."""

    ptr: int                                   # data_ptr of the message's buffer
    get: Callable[[Mapping[str, torch.Tensor]], Any]   # itemgetter of the segments' names
    #: itemgetter of the segments' plan indices (``CheckedSources``' sequences)
    pick: Callable[[Sequence[Any]], Any]
    wire: tuple[torch.dtype, ...]              # per segment, the wire dtype
    #: (destination, first, stop): segments [first, stop) of the message share their wire
    #: dtype and local shape but for dim 0, so they concatenate along dim 0 into the
    #: destination, the arena region viewed typed as (sum of dim 0, *rest)
    groups: tuple[tuple[torch.Tensor, int, int], ...]


@dataclass(eq=False)
class GlooStaging(Staging):
    """One bucket's messages in wire order: ``(peer, message, buffer, direct)``."""

    packing: BucketPacking | None = None
    messages: list[tuple[int, Message, torch.Tensor, bool]] = field(default_factory=list)
    arena: torch.Tensor | None = None
    #: the temporaries of casts at unaligned offsets (``_CAST_TEMP``): counted in ``nbytes``
    #: beside the arena, so they are held until release like it
    temps: list[torch.Tensor] = field(default_factory=list)


class _UnpackPlan(NamedTuple):
    #: message id -> its segments' destinations (flat bytes, or the region of the target's
    #: byte view for a strided segment), when every segment goes to a tensor target
    scatters: dict[int, list[torch.Tensor]]
    views: dict[int, torch.Tensor]  # param -> byte view of its target (other messages)
    callbacks: dict[int, Callable[[str, torch.Tensor], None]]  # param -> load callback
    #: message id -> (its buffer's address, the ``HostScatter`` of its small segments or
    #: None, the indices of the segments left to ``_foreach_copy_``): built at the first
    #: round in a cached arena, dropped with this plan when a target's address changes
    tables: dict[int, tuple[int, HostScatter | None, list[int]]]


def _staging_need(bp: BucketPacking, direct: Callable[[Message], bool]) -> int:
    return sum(m.nbytes for p in bp.peers for m in p.messages if not direct(m))


def _drop_issued(call: NativeCall[list[tuple[Any, int]]]) -> None:
    """Done callback of a bucket's issue call whose wait failed before it took the ops:
    empty the list of ops the call returned (``GlooTransport._wait_bucket``)."""
    if call.exception() is None:
        call.result().clear()


class GlooTransport(Transport):
    """CPU data plane over ``ProcessGroupGloo`` point-to-point (module docstring)."""

    name = "gloo"

    @classmethod
    def unavailable_reason(cls, settings: TransportSettings) -> str | None:
        if not torch.distributed.is_available():
            return "this torch build has no torch.distributed"
        if not torch.distributed.is_gloo_available():
            return "this torch build has no Gloo backend"
        if settings.device not in (None, "cpu"):
            return f"gloo moves CPU tensors; device {settings.device!r} requested"
        return None

    @classmethod
    def identity(cls, settings: TransportSettings) -> dict[str, str]:
        # Message boundaries derive from it: every rank must split buffers the same way.
        return {"m2n_async.gloo.direct_min_bytes": str(DIRECT_MIN_BYTES),
                "m2n_async.gloo.split_runs": "1"}

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, int]] = []  # (work, peer) issued and not yet waited
        #: Peers whose op of this round failed or timed out in a wait (``waiting_on``: the
        #: wait thread may drop the op from ``_pending`` before the engine asks).
        self._failed_peers: set[int] = set()
        #: the peer whose op the wait thread (one: buckets are waited in order) is blocked on,
        #: or failed on: a timed-out op reads "completed" before ``_failed_peers`` has it
        self._in_wait: int | None = None
        self._pg: Any = None
        self._adapter: StoreAdapter | None = None
        self._packings: dict[int, BucketPacking] = {}
        self._arenas: _Arenas | None = None
        self._pack_thread: NativeThread | None = None
        self._waiter: NativeThread | None = None
        self._unpack_thread: NativeThread | None = None
        #: The sinks mapping the caches below were built for (as passed), and its records.
        self._unpack_sinks: Mapping[str, SinkLike] | None = None
        self._unpack_records: SinkMap = SinkMap()
        self._unpack_cache: dict[int, _UnpackPlan] = {}
        self._recv_cache: dict[int, tuple[list[tuple[int, Message, torch.Tensor | None]],
                                          int]] = {}
        #: bucket -> its in-place targets (plan indices, tensors) and their storage addresses
        #: when the two caches above were built for it: a target whose ``.data`` was
        #: reassigned since (the same tensor, the same mapping, new storage) makes the
        #: bucket's views stale
        self._target_ptrs: dict[int, tuple[tuple[int, ...], list[torch.Tensor], list[int]]] = {}
        # Per message (by id: messages live as long as the cached packings): the arena views
        # of packed messages, reused while the message's buffer address stays the same.
        self._copy_cache: dict[int, _Copies] = {}
        #: message id -> its ``_Cats`` (None: not made only of aligned whole shards)
        self._cat_cache: dict[int, _Cats | None] = {}
        #: message id -> (its buffer's address, the sources' dtype when they are cast (else
        #: None), per chunk of ``_FOREACH_CHUNK`` segments: the sources' addresses last round
        #: and the ``HostGather`` built for them, None until they are the same two rounds
        #: running, False when it took nothing)
        self._gathers: dict[int, tuple[int, torch.dtype | None, list[
            tuple[list[int], HostGather | bool | None] | None]]] = {}
        self._parts: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self._shapes: dict[int, tuple[int, ...]] = {}
        self._send_need: dict[int, int] = {}  # bucket -> staging bytes (trainer)
        #: bucket -> (param, bytes) of its direct messages: staged when the source is cast
        self._directs: dict[int, list[tuple[int, int]]] = {}
        self._names = [p.spec.name for p in ctx.plan.params]
        self._dtypes = [getattr(torch, p.spec.dtype) for p in ctx.plan.params]
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def static_bytes(self) -> int:
        a = self._arenas
        return 0 if a is None else a.allocated_bytes

    def packing(self, bucket: Bucket) -> BucketPacking:
        """This rank's side of ``bucket`` (computed once, cached)."""
        bp = self._packings.get(bucket.index)
        if bp is None:
            bp = self._packings[bucket.index] = plan_bucket(self.ctx.plan, bucket,
                                                            self.ctx.rank, split_runs=True)
        return bp

    def _plan_all(self) -> int:
        """Plan every bucket; the largest staging any bucket can need on this rank."""
        # A worker target given as a load callback cannot take a message in place; when the
        # engine did not say which can (in_place None), size for "nothing direct". Sizing
        # for the whole bucket regardless cost an aligned 350 MB model's workers 3 x 63 MiB
        # of arenas to stage 80 KB of packed small tensors.
        in_place = self.ctx.in_place
        if self.ctx.role == "worker" and in_place is None:
            in_place = frozenset()

        def direct(m: Message) -> bool:  # as _pack and _recv_plan decide it
            return m.direct is not None and (in_place is None or m.direct.param in in_place)

        return max((_staging_need(self.packing(b), direct) for b in self.ctx.buckets),
                   default=0)

    async def prepare(self) -> None:
        """Plan every bucket (off the loop: 10^5 parameters take a while), size the arenas,
        start the pack/unpack threads.

        Cancellation: the threads are stopped by ``close``.
        """
        largest = await anyio.to_thread.run_sync(self._plan_all, abandon_on_cancel=True)
        self._arenas = arenas = _Arenas(max(largest, 1), self.ctx.settings.max_inflight)
        self._waiter = NativeThread(f"gloo-wait-r{self.ctx.rank}")
        if self.ctx.role == "trainer":
            self._pack_thread = NativeThread(f"gloo-pack-r{self.ctx.rank}", nice=_BULK_NICE)
            if largest:  # fault the pages in now rather than during the first round
                n = min(self.ctx.settings.max_inflight, len(self.ctx.buckets))
                await self._pack_thread.run(arenas.warm, n, description="warm arenas")
        else:
            self._unpack_thread = NativeThread(f"gloo-unpack-r{self.ctx.rank}",
                                               nice=_BULK_NICE)

    async def connect(self, rendezvous: Rendezvous) -> None:
        """Create the Gloo group on the native thread; rendezvous through our store; then
        check every pair the plan uses (``_check_pairs``).

        Cancellation: the rendezvous calls in flight are cancelled; ``close`` drops the group.
        """
        self.check_usable()
        timeout = rendezvous.timeout
        # The check's bound. It starts when this rank's group is built; a peer answers once
        # its own build returns, which is after every rank published its Gloo address (and
        # so at most one full-mesh connect, a TCP connect and 8 bytes per pair, behind us):
        # milliseconds, seconds for a large or overloaded job. 10 s leaves that margin while
        # a foreign connection costs seconds, not the round timeout; never more than the
        # rendezvous timeout, the bound of each connect step.
        check_timeout = min(_CHECK_SECONDS, timeout)
        rank, size = self.ctx.rank, self.ctx.world_size
        # One nonce per generation (its prefix), from rank 0, through the store: only token
        # holders can read it, so only they can answer the check.
        nonce = await rendezvous.broadcast(secrets.token_bytes(32) if rank == 0 else None,
                                           name="gloo-pair-check")
        adapter = StoreAdapter(rendezvous.store, rendezvous.prefix, timeout=timeout,
                               watch=rendezvous.watch)
        self._adapter = adapter
        host = self.ctx.settings.host

        def build() -> Any:
            opts = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = datetime.timedelta(seconds=timeout)
            opts._devices = [torch.distributed.ProcessGroupGloo.create_device(
                hostname=host or "")]
            return torch.distributed.ProcessGroupGloo(adapter, rank, size, opts)

        # Gloo's I/O thread (which does the socket copies) is started by the thread that
        # creates the group and inherits its niceness: creating it on a thread at
        # _BULK_NICE puts the bulk copies below the event loop and the latency-bound
        # native/wait threads when the machine is oversubscribed.
        builder = NativeThread(f"gloo-connect-r{rank}", nice=_BULK_NICE)
        call = builder.submit(build, description=f"gloo connect rank {rank}/{size}")
        try:
            self._pg = await self._build_watched(call, rendezvous)
        except BaseException as exc:
            adapter.cancel_all("connect failed or was cancelled")
            if isinstance(exc, (TimeoutError, PeerLostError, TransferError)) or not isinstance(
                    exc, Exception):
                raise
            raise TransferError(f"gloo: creating the process group failed at "
                                f"{self.ctx.where()}: {exc}", rank=rank) from exc
        finally:
            if call.done():
                # The build returned: the thread has only its stop left. Join it, bounded and
                # off the loop, so that it is gone when connect returns, not a moment later.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(builder.close, 5.0)
            else:  # abandoned inside Gloo: it ends, as a daemon thread, when Gloo gives up
                builder.close(0.0)
            del call  # its result is the group: a traceback keeping this frame must not
        # On the native thread (the rounds' ops are issued there too), not the builder: the
        # builder's loop keeps its last result, the group, until the thread ends, and a
        # failed check's traceback (which keeps that loop's frame) would keep the group.
        check = self.ctx.native.submit(self._check_pairs, nonce, rendezvous.prefix,
                                       check_timeout,
                                       description=f"gloo pair check rank {rank}/{size}")
        try:
            await self._build_watched(check, rendezvous, limit=check_timeout + _CHECK_SLACK,
                                      what="the data-plane check of the pairs did not end",
                                      why="a peer did not answer")
        finally:
            del check

    def _check_peers(self) -> list[int]:
        """The peers this rank exchanges messages with in some bucket (the plan is the same
        on both sides of a pair, so the pair's two ends agree)."""
        return sorted({p.peer for b in self.ctx.buckets for p in self.packing(b).peers
                       if p.messages})

    def _check_pairs(self, nonce: bytes, prefix: str, timeout: float) -> None:
        """Native thread, right after the group is built: prove that the peer at the other
        end of each pair the plan uses is a rank of this job, within ``timeout`` seconds.

        Gloo's listener gives a pair the first connection that sends the pair's sequence
        number, whoever made it: a foreign one leaves a group that connected but whose first
        op on that pair waits until the round deadline. So each rank sends every peer it uses
        ``_pair_digest(nonce, prefix, itself, peer)`` (the nonce is readable by token
        holders only) and checks what each peer sent it. A pair that does not answer in time
        (foreign: silent, or not a Gloo peer; or the peer died) or answers wrongly fails the
        connect with a ``TransferError`` naming the peers; the group is dropped at once, here
        (its sockets close: the real peers' checks on their side fail promptly too)."""
        rank = self.ctx.rank
        peers = self._check_peers()
        if not peers:
            return
        deadline = time.monotonic() + timeout
        got = [torch.zeros(hashlib.sha256().digest_size, dtype=torch.uint8) for _ in peers]
        sent = [torch.tensor(list(_pair_digest(nonce, prefix, rank, p)), dtype=torch.uint8)
                for p in peers]
        failures: dict[int, str] = {}
        issued: list[tuple[Any, int]] = []
        try:
            with self._lock:
                self.check_usable()  # under the lock: abort() cannot miss an op issued now
                # Receives first: each tells its peer a receive is pending (Gloo moves a
                # send's bytes only then), so the sends below can go at once.
                posts = [(self._pg.recv, b, p) for b, p in zip(got, peers, strict=True)]
                posts += [(self._pg.send, b, p) for b, p in zip(sent, peers, strict=True)]
                try:
                    for op, b, p in posts:
                        try:
                            issued.append((op([b], p, _CHECK_TAG), p))
                        except Exception as exc:  # a pair already closed
                            failures.setdefault(p, _first_line(exc))
                finally:
                    self._pending.extend(issued)
                    posts.clear()
                    op = None
            for work, peer in issued:
                left = max(deadline - time.monotonic(), _FORCE_CLOSE.total_seconds())
                if self._abort_reason is not None:
                    left = _FORCE_CLOSE.total_seconds()
                try:
                    work.wait(datetime.timedelta(seconds=left))
                except Exception as exc:  # timed out (and Gloo closed the pair), or closed
                    failures.setdefault(peer, _first_line(exc))
            for b, p in zip(got, peers, strict=True):
                if p not in failures and not hmac.compare_digest(
                        bytes(b.tolist()), _pair_digest(nonce, prefix, p, rank)):
                    failures[p] = "answered with a wrong digest"
        finally:
            with self._lock:
                done = {id(w) for w, _ in issued}
                self._pending = [(w, p) for w, p in self._pending if id(w) not in done]
            # The ops hold the Gloo context: a failure's traceback keeps this frame.
            issued.clear()
            work = None
        if not failures:
            return
        self._pg = None  # destroyed now, on this thread: its sockets close, its thread ends
        if self._abort_reason is not None:
            raise TransferError(f"gloo: the data-plane check of the pairs was aborted "
                                f"({self._abort_reason}) at {self.ctx.where()}", rank=rank)
        bad = sorted(failures)
        who = ", ".join(f"peer rank {p}" for p in bad)
        err = TransferError(
            f"gloo: {who} did not answer the data-plane check within {timeout:g} s at "
            f"{self.ctx.where()} (a foreign connection to the Gloo listener, or a dead peer): "
            + "; ".join(f"rank {p}: {failures[p]}" for p in bad), rank=rank)
        err.peer = bad[0]  # type: ignore[attr-defined]  # lets the engine blame the peer
        raise err

    async def _build_watched(self, call: NativeCall[Any], rendezvous: Rendezvous, *,
                             limit: float | None = None,
                             what: str = "the process group was not created",
                             why: str = "a peer did not connect") -> Any:
        """The native ``call`` (the group build, or the pair check) awaited, bounded by
        ``limit`` (the rendezvous timeout by default) and failing with the peer's
        ``PeerLostError`` as soon as a watched peer is lost. Gloo's own TCP connect
        retries for several times its timeout, and a peer that failed after the store part
        of the rendezvous would otherwise keep every other rank there that long. An
        abandoned call goes on in its daemon thread until Gloo gives up."""
        limit = rendezvous.timeout if limit is None else limit
        outcome: dict[str, Any] = {}

        async def run_build() -> None:
            try:
                outcome["pg"] = await call.wait()
            except Exception as exc:
                outcome["error"] = exc
            tg.cancel_scope.cancel()

        async def watch_peers() -> None:
            try:  # waits for a key nobody writes: only a lost peer (or store) ends it
                await rendezvous.store.wait([rendezvous.key("never")], watch=rendezvous.watch)
            except Exception as exc:  # PeerLostError, or the store itself failed: raised as is
                outcome.setdefault("lost", exc)
                tg.cancel_scope.cancel()

        try:
            with anyio.fail_after(limit):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run_build)
                    if rendezvous.watch:
                        tg.start_soon(watch_peers)
        except TimeoutError:
            raise TimeoutError(f"gloo: {what} within {limit:g} s at {self.ctx.where()} "
                               f"({why})") from None
        # Popped, not read: this frame may outlive the call inside an exception's traceback
        # (a cancelled task's), and the group must have no holder but the transport.
        if "pg" in outcome:
            return outcome.pop("pg")
        failure = outcome.pop("lost", None) or outcome.pop("error")
        outcome.clear()
        raise failure

    # -- per bucket ----------------------------------------------------------------------

    async def stage(self, bucket: Bucket, *,
                    sources: Mapping[str, torch.Tensor] | None = None,
                    sinks: Mapping[str, SinkLike] | None = None) -> Staging:
        self.check_usable()
        bp = self.packing(bucket)
        if self.ctx.role == "trainer":
            if sources is None:
                raise LocalProtocolError(f"gloo stage on a trainer needs sources "
                                         f"({self.ctx.where(bucket=bucket.index)})")
            thread = self._pack_thread
            if thread is None:
                raise LocalProtocolError("gloo transport used before prepare()")
            if self._copy_free(bp, sources):  # only views to build: a thread hop costs more
                return self._pack(bp, sources)
            return await thread.run(self._pack, bp, sources,
                                    description=f"pack bucket {bucket.index}")
        return self._alloc_recv(bp, sinks or {})

    def _copy_free(self, bp: BucketPacking, sources: Mapping[str, torch.Tensor]) -> bool:
        """Every message of the bucket moves zero-copy on this side (a direct message of a
        source that must be cast does not) and there are few."""
        n = 0
        directs = []
        for peer in bp.peers:
            for msg in peer.messages:
                if msg.direct is None:
                    return False
                directs.append(msg.direct.param)
                n += 1
                if n > _INLINE_MESSAGES:
                    return False
        names, dtypes = self._names, self._dtypes
        for i in directs:
            t = sources.get(names[i])
            if t is not None and t.dtype is not dtypes[i]:
                return False
        return True

    def _cast_of(self, sources: Mapping[str, torch.Tensor]) -> Callable[[int], bool]:
        """``cast(i)``: param ``i``'s source is not in the wire dtype (the engine checked it
        is a float cast); memoized for one bucket. A missing source reads as not cast (the
        byte getters raise the ``PlanError`` naming it)."""
        memo: dict[int, bool] = {}
        names, dtypes = self._names, self._dtypes

        def cast(i: int) -> bool:
            v = memo.get(i)
            if v is None:
                t = sources.get(names[i])
                v = memo[i] = t is not None and t.dtype is not dtypes[i]
            return v
        return cast

    def _byte_source(self, sources: Mapping[str, torch.Tensor]
                     ) -> tuple[Callable[[int], torch.Tensor], Callable[[int], torch.Tensor]]:
        """(byte view, flat byte view) getters of the local shards, cached for one bucket."""
        shaped: dict[int, torch.Tensor] = {}
        flat: dict[int, torch.Tensor] = {}
        names = self._names

        def tensor(i: int) -> torch.Tensor:
            try:
                return sources[names[i]]
            except KeyError:
                raise PlanError(f"parameter {names[i]!r}: no local shard was provided "
                                f"(rank {self.ctx.rank})") from None

        def get(i: int) -> torch.Tensor:
            v = shaped.get(i)
            if v is None:
                v = shaped[i] = byte_view(tensor(i))
            return v

        def get_flat(i: int) -> torch.Tensor:
            v = flat.get(i)
            if v is None:
                v = flat[i] = flat_bytes(tensor(i))
            return v
        return get, get_flat

    def _acquire(self, staged: GlooStaging, need: int) -> torch.Tensor | None:
        if not need or self._arenas is None:
            return None
        if need > self._arenas.size:  # casting: messages that are zero-copy otherwise stage
            self._arenas.grow(need)
        arena = self._arenas.acquire(need, staged.bucket.index)
        staged.arena = arena
        staged.nbytes = arena.numel()
        return arena

    def _copies(self, msg: Message, buf: torch.Tensor, cache: bool,
                cast: Callable[[int], bool]) -> _Copies:
        """The ``_Copies`` of a packed message for its buffer ``buf``, cached when ``cache``
        (``buf`` lies in a slot arena; rebuilt when the buffer moved, which per-bucket arena
        slots make rare, or when a source's dtype changed to or from the wire's)."""
        ptr = buf.data_ptr()
        got = self._copy_cache.get(id(msg))
        if got is not None and got.ptr == ptr and all(cast(i) is c for i, c in got.casts):
            return got
        dsts: list[torch.Tensor] = []
        srcs: list[tuple[int, int, Any, int]] = []
        casts: dict[int, bool] = {}
        for seg in msg.segments:
            rel = seg.offset - msg.offset
            piece = buf[rel:rel + seg.nbytes]
            dtype = self._dtypes[seg.param]
            aligned = (ptr + rel) % dtype.itemsize == 0
            if seg.whole and aligned:
                # Typed like the shard: the shard itself is the source, no view per round,
                # and a float source of another dtype is cast by the copy.
                dsts.append(piece.view(dtype).view(self._local_shape(seg.param)))
                srcs.append((seg.param, _WHOLE, None, seg.nbytes))
                continue
            c = casts[seg.param] = cast(seg.param)
            if not c:
                if seg.span is None:
                    dsts.append(piece.view(seg.shape))
                    srcs.append((seg.param, _STRIDED, seg.slices, seg.nbytes))
                else:
                    dsts.append(piece)
                    srcs.append((seg.param, _SPAN, seg.span, seg.nbytes))
                continue
            w = dtype.itemsize
            slices, shape = element_region(seg, w)
            if not aligned:  # cannot be viewed typed: cast through a temporary, copy bytes
                dsts.append(piece.view(seg.shape))
                srcs.append((seg.param, _CAST_TEMP, slices, seg.nbytes))
            elif seg.span is not None:
                a, b = seg.span
                dsts.append(piece.view(dtype))
                srcs.append((seg.param, _CAST_SPAN, (a // w, b // w), seg.nbytes))
            else:
                dsts.append(piece.view(dtype).view(shape))
                srcs.append((seg.param, _CAST_STRIDED, slices, seg.nbytes))
        got = _Copies(ptr, dsts, srcs, tuple(casts.items()))
        if cache:
            self._copy_cache[id(msg)] = got
        return got

    def _cats(self, msg: Message, buf: torch.Tensor, cache: bool) -> _Cats | None:
        """The ``_Cats`` of a packed message for its buffer ``buf``, or None when a segment is
        not a whole, non-empty shard of at least one dim at a wire-aligned offset (those go
        through ``_copies``). Cached like ``_copies``; a pure function of the plan and the
        buffer's address."""
        ptr = buf.data_ptr()
        key = id(msg)
        if key in self._cat_cache:
            got = self._cat_cache[key]
            if got is None or got.ptr == ptr:
                return got
        shapes: list[tuple[int, ...]] = []
        for seg in msg.segments:
            dtype = self._dtypes[seg.param]
            shape = self._local_shape(seg.param)
            if (not seg.whole or not shape or not seg.nbytes
                    or (ptr + seg.offset - msg.offset) % dtype.itemsize):
                if cache:  # the same for this buffer every round
                    self._cat_cache[key] = None
                return None
            shapes.append(shape)
        groups: list[tuple[torch.Tensor, int, int]] = []
        segs = msg.segments
        a = 0
        while a < len(segs):
            dtype, rest = self._dtypes[segs[a].param], shapes[a][1:]
            b = a + 1
            while (b < len(segs) and b - a < _FOREACH_CHUNK and shapes[b][1:] == rest
                   and self._dtypes[segs[b].param] is dtype):
                b += 1
            lo = segs[a].offset - msg.offset
            hi = segs[b - 1].offset + segs[b - 1].nbytes - msg.offset
            rows = sum(shapes[j][0] for j in range(a, b))
            groups.append((buf[lo:hi].view(dtype).view(rows, *rest), a, b))
            a = b
        got = _Cats(ptr, operator.itemgetter(*(self._names[s.param] for s in segs)),
                    operator.itemgetter(*(s.param for s in segs)),
                    tuple(self._dtypes[s.param] for s in segs), tuple(groups))
        if cache:
            self._cat_cache[key] = got
        return got

    def _cat_from(self, msg: Message, cats: _Cats, buf: torch.Tensor,
                  sources: Mapping[str, torch.Tensor], cache: bool) -> int | None:
        """Pack the message with ``cats`` when every source is there in its wire dtype, and
        return the bytes cast (0); None (nothing copied) otherwise: the per-segment path
        then casts, or raises the error naming a missing parameter. The engine checked the
        shapes, device and contiguity of the sources. Sources whose addresses are the same
        as last round's (in a cached arena) are packed through ``HostGather`` tables instead
        (``_gather``); so are sources all of one other float dtype (fp32 masters), cast on
        the way, which return the bytes cast. The round's ``CheckedSources`` give the
        shards and their dtypes by plan index, with no lookup by name nor dtype read."""
        checked = self.for_sources(sources)
        if checked is not None:
            ts, ds = cats.pick(checked.tensors), cats.pick(checked.dtypes)
            if type(ts) is not tuple:  # an itemgetter of one index returns the value itself
                ts, ds = (ts,), (ds,)
        else:
            try:
                ts = cats.get(sources)
            except KeyError:
                return None
            if type(ts) is not tuple:  # an itemgetter of one name returns the value itself
                ts = (ts,)
            try:
                ds = tuple(map(_DTYPE, ts))
            except AttributeError:  # not a tensor: the per-segment path reports it
                return None
        uncast = all(map(operator.is_, ds, cats.wire))
        if uncast:
            if not (cache and ts[0].is_cpu and self._gather(msg, cats, buf, ts, None)):
                for out, a, b in cats.groups:
                    torch.cat(ts[a:b], out=out)
            return 0
        src = ds[0]
        if (cache and ts[0].is_cpu and all(map(operator.is_, ds, repeat(src)))
                and self._gather(msg, cats, buf, ts, src)):
            return msg.nbytes
        return None

    def _gather(self, msg: Message, cats: _Cats, buf: torch.Tensor,
                ts: tuple[torch.Tensor, ...], src: torch.dtype | None) -> bool:
        """Pack the message's sources ``ts`` (whole shards, all in their wire dtypes, or all
        of the float dtype ``src`` to be cast) through ``HostGather`` tables, one per
        ``_FOREACH_CHUNK`` segments, each built once the chunk's sources sat at the same
        addresses two rounds running; the segments a table leaves go through one
        multi-tensor copy. False when a chunk has no table this round: the caller then
        packs the whole message its own way (what ran is overwritten).

        The tables read each source at its address for the bytes the plan gives it: safe
        because the engine checked every shard's shape, device and contiguity this round
        and ``ts`` holds them while they are read. Chunk by chunk, each ending in torch calls
        that release the GIL: the event loop never waits behind a whole message."""
        count = -(-len(ts) // _FOREACH_CHUNK)
        got = self._gathers.get(id(msg))
        if got is None or got[0] != cats.ptr or got[1] is not src:
            got = self._gathers[id(msg)] = (cats.ptr, src, [None] * count)
        chunks = got[2]
        segs = msg.segments
        ok = True
        for c in range(count):
            a = c * _FOREACH_CHUNK
            b = min(a + _FOREACH_CHUNK, len(ts))
            ptrs = list(map(_DATA_PTR, ts[a:b]))
            last = chunks[c]
            if last is None or last[0] != ptrs:
                chunks[c] = (ptrs, None)  # a table once they stay put a round
                ok = False
                continue
            table = last[1]
            if table is None:
                part = segs[a:b]
                table = HostGather.build(
                    buf, [x.offset - msg.offset for x in part], [x.nbytes for x in part],
                    ptrs, None if src is None else (src, cats.wire[a:b])) or False
                chunks[c] = (ptrs, table)
            if not ok or not isinstance(table, HostGather):
                ok = False  # the caller packs it all; later chunks only record addresses
                continue
            table.run(buf)
            if table.rest:  # typed in the wire dtype (aligned: ``_cats``), casting if src
                left = [segs[a + k] for k in table.rest]
                foreach_copy([buf[x.offset - msg.offset:x.offset - msg.offset + x.nbytes]
                              .view(cats.wire[a + k])
                              for x, k in zip(left, table.rest, strict=True)],
                             [ts[a + k].reshape(-1) for k in table.rest])
        return ok

    def _copy_from(self, copies: _Copies, sources: Mapping[str, torch.Tensor],
                   get: Callable[[int], torch.Tensor],
                   get_flat: Callable[[int], torch.Tensor],
                   batch: tuple[list[torch.Tensor], list[torch.Tensor]],
                   temps: list[torch.Tensor]) -> int:
        """Add ``copies``' (destination, source) pairs to ``batch``, running a
        ``_foreach_copy_`` whenever it holds ``_FOREACH_CHUNK`` of them (the caller runs the
        rest): the whole bucket's segments go through multi-tensor copies, casts included.
        Whole shards need no view per round (the engine checked their shape and contiguity).
        Chunked because this Python loop holds the GIL and the torch call releases it: the
        event loop never waits for the GIL behind thousands of tiny parameters. Returns the
        wire bytes produced by casting; the temporaries of unaligned casts go to ``temps``
        (the staging's, which counts them)."""
        names, dtypes = self._names, self._dtypes
        bdsts, bsrcs = batch
        cast_bytes = 0
        for dst, (i, how, arg, nbytes) in zip(copies.dsts, copies.srcs, strict=True):
            if how == _WHOLE:
                src = sources.get(names[i])
                if src is None:
                    src = get(i)  # raises the PlanError naming the parameter
                elif src.dtype is not dtypes[i]:
                    cast_bytes += nbytes
                    if src.dim() == 0:
                        # Cast by shard.to(wire) itself, what the workers must get: a 0-d
                        # cast inside a multi-tensor copy encodes a NaN otherwise on the CPU
                        # (0xffff for 0x7fc0 in bf16); its temporary is one element
                        src = src.to(dtypes[i])
                        temps.append(src)
            elif how == _SPAN:
                src = get_flat(i)[arg[0]:arg[1]]
            elif how == _STRIDED:
                src = get(i)[arg]
            else:
                t = sources[names[i]]
                cast_bytes += nbytes
                if how == _CAST_SPAN:
                    src = t.reshape(-1)[arg[0]:arg[1]]
                else:
                    # a 0-d shard is cast as it is (shard.to(wire), as for _WHOLE above):
                    # torch's CPU cast of a 1-element tensor encodes a NaN otherwise
                    region = t if t.dim() == 0 else t[arg]
                    if how == _CAST_STRIDED:
                        src = region
                    else:  # _CAST_TEMP
                        tmp = region.to(dtypes[i]).contiguous()
                        temps.append(tmp)
                        src = byte_view(tmp)
            bdsts.append(dst)
            bsrcs.append(src)
            if len(bdsts) >= _FOREACH_CHUNK:
                torch._foreach_copy_(bdsts, bsrcs)
                bdsts.clear()
                bsrcs.clear()
        return cast_bytes

    def _local_shape(self, i: int) -> tuple[int, ...]:
        shape = self._shapes.get(i)
        if shape is None:
            p = self.ctx.plan.params[i]
            layout = p.spec.layout if self.ctx.role == "trainer" else p.dst
            shape = self._shapes[i] = tuple(layout.local_shape(p.spec.shape, self.ctx.rank))
        return shape

    def _pack(self, bp: BucketPacking, sources: Mapping[str, torch.Tensor]) -> GlooStaging:
        t0 = time.perf_counter()
        get, get_flat = self._byte_source(sources)
        cast = self._cast_of(sources)
        staged = GlooStaging(bp.bucket, packing=bp, nbytes_moved=bp.nbytes)
        index = bp.bucket.index
        need = self._send_need.get(index)
        if need is None:
            need = self._send_need[index] = _staging_need(bp, lambda m: m.direct is not None)
            self._directs[index] = [(m.direct.param, m.nbytes) for p in bp.peers
                                    for m in p.messages if m.direct is not None]
        # A direct message of a source that must be cast is staged too.
        need += sum(n for i, n in self._directs[index] if cast(i))
        arena = self._acquire(staged, need)
        cacheable = arena is not None and self._arenas is not None and self._arenas.owns(arena)
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        off = 0
        for peer in bp.peers:
            for msg in peer.messages:
                seg = msg.direct
                if seg is not None and not cast(seg.param):  # zero-copy: from the shard
                    a, b = seg.span  # type: ignore[misc]
                    flat = get_flat(seg.param)
                    if not flat.untyped_storage().data_ptr():
                        # Its storage freed under its shape (FSDP's resize_(0)): Gloo would
                        # send from address 0 and abort the process. A few calls a bucket.
                        raise PlanError(
                            f"parameter {self._names[seg.param]!r}: its local shard holds no "
                            f"storage (freed under its shape, as untyped_storage().resize_(0) "
                            f"leaves it); hand in the shard with its data")
                    staged.messages.append((peer.peer, msg, flat if seg.whole else flat[a:b],
                                            True))
                    continue
                assert arena is not None
                buf = arena[off:off + msg.nbytes]
                off += msg.nbytes
                cats = self._cats(msg, buf, cacheable)
                packed = (self._cat_from(msg, cats, buf, sources, cacheable)
                          if cats is not None else None)
                if packed is not None:
                    staged.cast_bytes += packed
                    staged.messages.append((peer.peer, msg, buf, False))
                    continue
                staged.cast_bytes += self._copy_from(
                    self._copies(msg, buf, cacheable, cast), sources, get, get_flat, batch,
                    staged.temps)
                staged.messages.append((peer.peer, msg, buf, False))
        if batch[0]:
            foreach_copy(*batch)
        staged.nbytes += sum(t.numel() * t.element_size() for t in staged.temps)
        staged.seconds["pack"] = time.perf_counter() - t0
        return staged

    def _recv_plan(self, bp: BucketPacking, sinks: Mapping[str, SinkLike]
                   ) -> tuple[list[tuple[int, Message, torch.Tensor | None]], int]:
        """Per message of ``bp``: (peer, message, the target bytes it lands in directly or
        None), and the staging needed for the others; cached with the unpack plan (the
        worker's targets are fixed), so no view is built per round."""
        records = self._check_sinks(sinks)
        index = bp.bucket.index
        got = self._recv_cache.get(index)
        checked = self.checked_targets(index)
        if got is not None:
            params, tensors, ptrs = self._target_ptrs[index]
            if checked is not None and checked.sinks is sinks and (
                    checked.params is params or checked.params == params):
                # The engine's check read these very targets' addresses in this round.
                now = checked.addresses
                self._target_ptrs[index] = (checked.params, tensors, ptrs)  # is, next round
            else:
                now = list(map(_DATA_PTR, tensors))  # one C-level pass per round
            if now == ptrs:
                return got
            self._unpack_cache.pop(index, None)  # its views are of the old storage too
        names = self._names
        placed = [(i, s.tensor) for i in bp.params
                  if (s := records.get(names[i])) is not None and s.in_place]
        params = tuple(i for i, _ in placed)
        tensors = [t for _, t in placed]
        self._target_ptrs[index] = (params, tensors, list(map(_DATA_PTR, tensors)))
        out: list[tuple[int, Message, torch.Tensor | None]] = []
        need = 0
        for peer in bp.peers:
            for msg in peer.messages:
                seg = msg.direct
                target = records.get(names[seg.param]) if seg is not None else None
                if seg is not None and target is not None and target.in_place:
                    a, b = seg.span  # type: ignore[misc]
                    out.append((peer.peer, msg, byte_view(target.tensor).view(-1)[a:b]))
                else:  # a load callback gets its shard from staging
                    out.append((peer.peer, msg, None))
                    need += msg.nbytes
        self._recv_cache[index] = (out, need)
        return out, need

    def _alloc_recv(self, bp: BucketPacking, sinks: Mapping[str, SinkLike]) -> GlooStaging:
        staged = GlooStaging(bp.bucket, packing=bp, nbytes_moved=bp.nbytes)
        plan, need = self._recv_plan(bp, sinks)
        arena = self._acquire(staged, need)
        off = 0
        for peer, msg, view in plan:
            if view is not None:
                staged.messages.append((peer, msg, view, True))
                continue
            assert arena is not None
            staged.messages.append((peer, msg, arena[off:off + msg.nbytes], False))
            off += msg.nbytes
        return staged

    def transfer(self, staging: Staging) -> Completion:
        """Issue the bucket's ops on the native thread (plan order) and wait for them on the
        wait thread, so bucket i+1's messages are already queued while bucket i's move."""
        self.check_usable()
        if not isinstance(staging, GlooStaging) or self._pg is None or self._waiter is None:
            raise LocalProtocolError(f"gloo transfer needs a connected transport and its own "
                                     f"staging ({self.ctx.where(bucket=staging.bucket.index)})")
        index = staging.bucket.index
        issue = self.ctx.native.submit(self._issue, staging, description=f"gloo issue {index}")
        done = self._waiter.submit(self._wait_bucket, staging, issue,
                                   description=f"gloo wait {index}")
        return NativeCompletion(done, keep=staging)  # type: ignore[arg-type]

    def _issue(self, staged: GlooStaging) -> list[tuple[Any, int]]:
        """Native thread: post every send/recv of the bucket; never blocks on a peer."""
        staged.seconds["transfer"] = -time.perf_counter()
        op = self._pg.send if self.ctx.role == "trainer" else self._pg.recv
        tag = staged.bucket.index % (1 << 31)  # Gloo tags are 32-bit; FIFO per pair anyway
        issued: list[tuple[Any, int]] = []
        try:
            with self._lock:
                self.check_usable()  # under the lock: abort() cannot miss an op issued now
                try:
                    for j, (peer, buf) in enumerate(self._issue_order(staged), 1):
                        issued.append((op([buf], peer, tag), peer))
                        if j % _HANDOFF_EVERY == 0:
                            time.sleep(_HANDOFF_SECONDS)
                except Exception as exc:
                    raise self._translate(exc, staged, None) from exc
                finally:
                    self._pending.extend(issued)
        finally:
            # A traceback that keeps this frame must not keep the group (the bound method).
            del op
        return issued

    @staticmethod
    def _issue_order(staged: GlooStaging) -> list[tuple[int, torch.Tensor]]:
        """The bucket's messages interleaved across peers, always next from the peer with
        the fewest bytes posted so far; each peer's own order is kept (Gloo matches a pair's
        messages in order). Why: Gloo writes a send in the calling thread for as long as the
        socket takes it, so posting all of one peer's messages first left the other pairs
        idle for tens of milliseconds per bucket on the CPU bench."""
        queues: dict[int, list[torch.Tensor]] = {}
        for peer, _, buf, _ in staged.messages:
            queues.setdefault(peer, []).append(buf)
        if len(queues) == 1:
            ((peer, bufs),) = queues.items()
            return [(peer, b) for b in bufs]
        posted = dict.fromkeys(queues, 0)
        nxt = dict.fromkeys(queues, 0)
        out: list[tuple[int, torch.Tensor]] = []
        while posted:
            peer = min(posted, key=posted.__getitem__)
            buf = queues[peer][nxt[peer]]
            out.append((peer, buf))
            posted[peer] += buf.numel()
            nxt[peer] += 1
            if nxt[peer] == len(queues[peer]):
                del posted[peer]
        return out

    def _wait_bucket(self, staged: GlooStaging, issue: NativeCall[list[tuple[Any, int]]]
                     ) -> None:
        """Wait thread: wait for the bucket's ops in order, each bounded by the deadline."""
        try:
            if not issue.join(self.remaining()):  # remaining() raises once the deadline passed
                raise TimeoutError(f"gloo: bucket {staged.bucket.index}'s ops were not issued "
                                   f"before the round deadline at "
                                   f"{self.ctx.where(round=self.round)}")
            issued = issue.result()  # re-raises the issue's failure
        except BaseException:
            # The ops, once issued, are the issue call's result and hold the Gloo context;
            # a failure's traceback keeps this frame and so the call: empty the list when
            # the call ends (at once if it has), or ``close`` would not free the group.
            issue.add_done_callback(_drop_issued)
            raise
        # A pair's messages complete in order (one TCP stream, matched in order per tag), so
        # wait for each peer's LAST message first: one blocking wait (one wake-up of this
        # thread) per peer instead of one per message; the earlier waits then return at once
        # (still called, so that a failed op raises). Measured on the CPU bench: this
        # thread's CPU per round fell from ~2.9 ms to ~1 ms for 53 messages.
        # A comprehension, not a loop: a loop variable bound to an op would outlive this
        # frame in a failure's traceback and keep the Gloo context alive.
        last = {peer_rank: j for j, (_, peer_rank) in enumerate(issued)}
        firsts = set(last.values())
        ordered = [issued[j] for j in last.values()]
        ordered += [op for j, op in enumerate(issued) if j not in firsts]
        try:
            for work, peer_rank in ordered:
                # Once aborted, only 1 ms: ``abort`` may have consumed this op's completion
                # with its own wait (Gloo's ``wait`` takes it), and a full wait would then
                # block until the round deadline, holding up ``close``.
                left = (_FORCE_CLOSE.total_seconds() if self._abort_reason is not None
                        else self.remaining())
                try:
                    self._in_wait = peer_rank
                    work.wait(datetime.timedelta(seconds=left))
                    self._in_wait = None
                except Exception as exc:
                    with self._lock:
                        self._failed_peers.add(peer_rank)
                    raise self._translate(exc, staged, peer_rank) from exc
        finally:
            with self._lock:
                done = {id(w) for w, _ in issued}
                self._pending = [(w, p) for w, p in self._pending if id(w) not in done]
            # The ops hold the Gloo context: a failure's traceback keeps this frame (and the
            # issue call's result, this same list), so empty what it would keep.
            issued.clear()
            ordered.clear()
            work = None
        staged.seconds["transfer"] += time.perf_counter()

    def _translate(self, exc: BaseException, staged: GlooStaging,
                   peer: int | None) -> BaseException:
        where = self.ctx.where(round=self.round, bucket=staged.bucket.index, peer=peer)
        op = "send" if self.ctx.role == "trainer" else "recv"
        text = _first_line(exc)
        if self._abort_reason is not None:
            return TransferError(f"gloo {op} aborted ({self._abort_reason}) at {where}",
                                 rank=self.ctx.rank, round=self.round)
        if "Timed out" in text:
            return TimeoutError(f"gloo {op} did not complete before the round deadline at "
                                f"{where}: {text}")
        if "closed by peer" in text or "Connection reset" in text:
            who = "a peer" if peer is None else f"peer rank {peer}"  # None: not known here
            err = TransferError(f"gloo {op}: {who} closed the connection (process "
                                f"died or aborted) at {where}: {text}",
                                rank=self.ctx.rank, round=self.round)
            err.peer = peer  # type: ignore[attr-defined]  # lets the engine blame the peer
            return err
        return TransferError(f"gloo {op} failed at {where}: {text}", rank=self.ctx.rank,
                             round=self.round)

    async def unpack(self, staging: Staging, sinks: Mapping[str, SinkLike]) -> None:
        """Scatter into targets / call load callbacks on the unpack thread, in plan order.

        Cancellation: the unpack thread finishes the bucket; the engine aborts the round.
        """
        self.check_usable()
        if self.ctx.role == "trainer":
            return
        thread = self._unpack_thread
        if thread is None or not isinstance(staging, GlooStaging):
            raise LocalProtocolError("gloo unpack before prepare() or with foreign staging")
        if all(direct for *_, direct in staging.messages):
            # Everything landed in place; only load callbacks would still need work.
            bp = staging.packing
            assert bp is not None
            records = self._check_sinks(sinks)
            if not any((s := records.get(self._names[i])) is not None and not s.in_place
                       for i in bp.params):
                staging.seconds["unpack"] = 0.0
                return
        await thread.run(self._unpack, staging, sinks,
                         description=f"unpack bucket {staging.bucket.index}")

    def _unpack(self, staged: GlooStaging, sinks: Mapping[str, SinkLike]) -> None:
        t0 = time.perf_counter()
        bp = staged.packing
        assert bp is not None
        up = self._unpack_plan(bp, sinks)
        arenas, arena = self._arenas, staged.arena
        cacheable = arena is not None and arenas is not None and arenas.owns(arena)
        # Every staged segment of the bucket, across messages and peers, goes through
        # multi-tensor copies of up to _FOREACH_CHUNK pairs.
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []

        def flush(force: bool = False) -> None:
            while len(dsts) >= _FOREACH_CHUNK or (force and dsts):
                torch._foreach_copy_(dsts[:_FOREACH_CHUNK], srcs[:_FOREACH_CHUNK])
                del dsts[:_FOREACH_CHUNK], srcs[:_FOREACH_CHUNK]

        for _, msg, buf, direct in staged.messages:
            if direct:
                continue
            targets = up.scatters.get(id(msg))
            if targets is not None:
                ptr = buf.data_ptr()
                host = up.tables.get(id(msg)) if cacheable else None
                if cacheable and (host is None or host[0] != ptr):
                    # Small segments through a table of addresses (``_hostcopy``): built
                    # once per arena and targets, it pays for itself from the second round.
                    host = up.tables[id(msg)] = (ptr, *HostScatter.build(
                        buf, [seg.offset - msg.offset for seg in msg.segments], targets))
                rest: Sequence[int]
                if host is not None and host[1] is not None:
                    host[1].run(buf)
                    rest = host[2]
                else:
                    rest = range(len(targets))
                if rest:
                    parts = self._buffer_parts(msg, buf, ptr, cacheable)
                    dsts.extend(targets[k] for k in rest)
                    srcs.extend(parts[k] for k in rest)
            else:  # some segments feed load callbacks (below); the others are copied here
                for seg in msg.segments:
                    view = up.views.get(seg.param)
                    if view is not None:
                        d, sv = unpack_pair(buf, seg, view, msg.offset)
                        dsts.append(d)
                        srcs.append(sv)
            flush()
        flush(force=True)
        if up.callbacks:
            self._run_callbacks(staged, up.callbacks)
        staged.seconds["unpack"] = time.perf_counter() - t0

    def _buffer_parts(self, msg: Message, buf: torch.Tensor, ptr: int, cacheable: bool
                      ) -> list[torch.Tensor]:
        """``msg``'s segments as views of its buffer ``buf`` (at address ``ptr``), for the
        copies a table leaves over: cached per message and buffer address when ``buf`` is
        the bucket's arena (the same every round), built only for a message that has such
        copies (100,000 tiny segments take ~0.2 s to view)."""
        parts = self._parts.get(id(msg))
        if parts is None or parts[0] != ptr:
            parts = (ptr, [
                buf[seg.offset - msg.offset:seg.offset - msg.offset + seg.nbytes]
                .view(seg.shape if seg.span is None else (seg.nbytes,))
                for seg in msg.segments])
            if cacheable:
                self._parts[id(msg)] = parts
        return parts[1]

    def _check_sinks(self, sinks: Mapping[str, SinkLike]) -> SinkMap:
        """The records of ``sinks``; a mapping other than last time's resets the caches
        built from it. The records live as long as those caches (converted once per
        mapping, not per round: these caches hold the mapping anyway)."""
        if self._unpack_sinks is not sinks:
            # The mapping changes between rounds only, no bucket in flight: no other thread
            # is in here then to pair one mapping with the other's records.
            self._unpack_records = self.sink_records(sinks)
            self._unpack_sinks, self._unpack_cache, self._recv_cache = sinks, {}, {}
            self._target_ptrs = {}
            self._parts.clear()
        return self._unpack_records

    def _unpack_plan(self, bp: BucketPacking, sinks: Mapping[str, SinkLike]) -> _UnpackPlan:
        """How to unpack ``bp`` into ``sinks``: built once per bucket and sinks mapping (a
        worker's targets are fixed for its lifetime), not every round. The cache holds the
        mapping itself, so a new mapping can never be mistaken for a cached one."""
        records = self._check_sinks(sinks)
        up = self._unpack_cache.get(bp.bucket.index)
        if up is not None:
            return up
        names = self._names
        flat: dict[int, torch.Tensor] = {}
        shaped: dict[int, torch.Tensor] = {}
        callbacks: dict[int, Callable[[str, torch.Tensor], None]] = {}
        for i in bp.params:
            sink = records.get(names[i])
            if sink is None:
                raise PlanError(f"parameter {names[i]!r}: no target or load callback on "
                                f"rank {self.ctx.rank}")
            if sink.in_place:
                shaped[i] = byte_view(sink.tensor)
                flat[i] = shaped[i].view(-1)
            else:
                callbacks[i] = sink.load
        scatters: dict[int, list[torch.Tensor]] = {}
        views: dict[int, torch.Tensor] = {}
        for peer in bp.peers:
            for msg in peer.messages:
                if msg.direct is not None and msg.direct.param in flat:
                    continue  # lands in place (or in staging only for a load callback)
                if all(seg.param in flat for seg in msg.segments):
                    scatters[id(msg)] = [
                        shaped[seg.param][seg.slices] if seg.span is None
                        else flat[seg.param] if seg.whole  # no slice op (many tiny params)
                        else flat[seg.param][seg.span[0]:seg.span[1]]
                        for seg in msg.segments]
                    continue
                for seg in msg.segments:
                    if seg.param in shaped:
                        views[seg.param] = shaped[seg.param]
        up = _UnpackPlan(scatters, views, callbacks, {})
        self._unpack_cache[bp.bucket.index] = up
        return up

    def _run_callbacks(self, staged: GlooStaging,
                       callbacks: Mapping[int, Callable[[str, torch.Tensor], None]]) -> None:
        plan = self.ctx.plan
        by_param: dict[int, list[tuple[torch.Tensor, Segment, int]]] = {i: [] for i in callbacks}
        for _, msg, buf, _ in staged.messages:
            for seg in msg.segments:
                if seg.param in by_param:
                    by_param[seg.param].append((buf, seg, msg.offset))
        for i, fn in callbacks.items():  # dict order = plan order (bp.params)
            p = plan.params[i]
            dtype = self._dtypes[i]
            shape = p.dst.local_shape(p.spec.shape, self.ctx.rank)
            parts = by_param[i]
            tensor: torch.Tensor | None = None
            if len(parts) == 1 and parts[0][1].whole:
                buf, seg, base = parts[0]
                raw = buf[seg.offset - base:seg.offset - base + seg.nbytes]
                if raw.data_ptr() % p.spec.itemsize == 0:  # zero-copy view of the staging
                    tensor = raw.view(dtype).view(shape)
            if tensor is None:
                tensor = torch.empty(shape, dtype=dtype)
                dst = byte_view(tensor)
                pairs = [unpack_pair(buf, seg, dst, base) for buf, seg, base in parts]
                foreach_copy([d for d, _ in pairs], [sv for _, sv in pairs])
            try:
                fn(p.spec.name, tensor)
            except Exception as exc:
                err = TransferError(f"load callback for parameter {p.spec.name!r} raised at "
                                    f"{self.ctx.where(round=self.round)}: {exc!r}",
                                    rank=self.ctx.rank, round=self.round)
                err.own_step = True  # type: ignore[attr-defined]  # this rank's, no peer's
                raise err from exc

    def release(self, staging: Staging) -> None:
        if isinstance(staging, GlooStaging):
            if staging.arena is not None and self._arenas is not None and not self.aborted:
                self._arenas.release(staging.arena)
            staging.arena = None
            staging.messages.clear()
            staging.temps.clear()

    # -- abort / close -------------------------------------------------------------------

    def begin_round(self, round: int, deadline: float) -> None:
        super().begin_round(round, deadline)
        with self._lock:
            self._failed_peers.clear()
            self._in_wait = None

    def waiting_on(self) -> list[int]:
        with self._lock:
            pending = list(self._pending)
            stuck = set(self._failed_peers)
        in_wait = self._in_wait  # one read: the wait thread may change it meanwhile
        if in_wait is not None:
            # The op the wait thread is blocked on is the one known to be stuck. The ops
            # queued behind it read "not completed" until they are waited, though their
            # bytes may long have arrived: naming their peers too would give a healthy peer
            # as many votes as the stuck one (1 trainer, 2 workers, one of them hung).
            stuck.add(in_wait)
            return sorted(stuck)
        for work, peer in pending:
            try:
                # Not ``is_success()``: torch deprecates it (and ``exception()``) with a
                # warning on every call. A failed op is the one the wait thread is on.
                if not work.is_completed():
                    stuck.add(peer)
            except Exception:  # a failed op: its peer is worth naming too
                stuck.add(peer)
        return sorted(stuck)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._abort_reason is None:
                self._abort_reason = reason
            pending = list(self._pending)
        if self._adapter is not None:
            self._adapter.cancel_all(reason)
        for work, _ in pending:
            try:  # fails after 1 ms and closes the pair: wakes our waiter and the peer's
                work.wait(_FORCE_CLOSE)
            except Exception:  # expected: that is the point
                pass

    async def close(self) -> None:
        """Drop the group and stop the helper threads (bounded).

        Cancellation: run shielded by the engine; a cancelled close may leave threads behind.
        """
        if self._closed:
            return
        self._closed = True
        threads = [t for t in (self._pack_thread, self._unpack_thread, self._waiter)
                   if t is not None]
        for t in threads:
            await anyio.to_thread.run_sync(t.close, 5.0, abandon_on_cancel=True)
        if self._arenas is not None:
            self._arenas.clear()
        # Nothing but this transport may hold the group, so that dropping it below destroys
        # it now (its threads joined, its sockets closed), not when the collector runs: the
        # ops of a failed round hold the Gloo context, the adapter the loop's notifier.
        with self._lock:
            self._pending.clear()
            self._failed_peers.clear()
        if self._adapter is not None:
            self._adapter.close()
        # the cached views hold the arenas and the targets
        self._copy_cache.clear()
        self._cat_cache.clear()
        self._gathers.clear()
        self._parts.clear()
        self._recv_cache.clear()
        self._unpack_cache.clear()
        self._target_ptrs.clear()
        self._unpack_sinks = None  # the caller's targets: a closed transport keeps none alive
        self._unpack_records = SinkMap()
        self._sink_cache = None
        self._pg = None
        self._adapter = None
