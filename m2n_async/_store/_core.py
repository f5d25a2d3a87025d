"""The store's state machine: keys, sessions, waiters, tombstones, generations (sans-IO).

Theory of operation: ``StoreCore`` is the whole semantics of the store as plain synchronous
code — no sockets, no event loop, no clocks — so the TCP server and the in-memory test store
(``m2n_async.testing.MemoryStore``) are two thin drivers over one implementation and cannot
drift apart. A driver opens a ``Session`` per client, calls the operations, and for a
blocking operation receives a ``Waiter``: either already done, or pending with a ``notify``
callback that the core calls exactly once when it completes (with a result or an error).
The driver turns that callback into an event or a reply frame. ``cancel`` forgets a pending
waiter; ``close_session`` ends a client.

Liveness: keys a session writes with ``ephemeral=True`` are owned by it. When the session
ends they are deleted, remembered as *tombstones* (a bounded FIFO: memory stays bounded, and
the newest losses are the ones a late waiter can still race with), and every waiter watching
one of them fails with ``PeerLostError(key=...)``. A waiter that starts later and watches a
tombstoned key fails at once. A later ``set`` of the key clears its tombstone (the peer came
back). An explicit ``delete`` of an ephemeral key is a clean leave and leaves no tombstone;
``delete(key, lost=True)`` is a deliberate unclean one, as if the session had ended. A write
by another session (``set``, a ``compare_set`` that swaps, ``add``) takes the key over: it is
that session's value now, durable unless that ``set`` is ephemeral itself.

A blocking call whose condition already holds completes even if a watched key is tombstoned:
the data it asked for is there, so a peer that finished and exited cannot fail a slower
peer's collective after the fact.

Generations: keys are namespaced ``{job}/{generation}/...``. The key ``{job}/generation``
holds the job's generation counter (advanced with ``add`` by ``next_generation``). When it
advances, every key of an older generation of that job is purged, waiters on them fail, and
any later operation on an older generation's key raises ``StaleGenerationError`` — a rank
that missed a reconnect cannot read or write the new generation's state by accident.

Protected keys: the generation counter and the job claims (``_claims``) are what fence one
attempt of a job from another, so ordinary key operations cannot undo them. The counter
``{job}/generation`` and the claim ticket counter ``{job}/claims/seq`` change only by ``add``
with a delta >= 0 (a counter that went back would hand out a generation, or a ticket, twice);
``set``, ``compare_set`` and ``delete`` of them are refused, and ``delete_prefix`` skips them.
A claim entry ``{job}/claims/{rank}/{ticket}`` must be written ephemeral, and once written only
its owning session may overwrite or delete it (its session's end removes it); ``delete_prefix``
skips claim entries too. Every refusal is a ``StoreError`` naming the key and the rule.

Limits: what a client can make the store hold, or build for it, is bounded. ``max_bytes`` caps
the bytes of keys and values the whole store holds and ``max_job_bytes`` those of one job (the
keys under ``{job}/``); a write past either raises ``StoreLimitError`` naming the quota, and
nothing is written. A gather (or exchange) result is sized from the lengths of its keys and
values *before* any of it is encoded: past ``max_reply`` bytes the waiter fails with
``StoreLimitError`` instead, so one request cannot make a driver build a reply of the whole
store.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Final, Literal

from m2n_async._proto.errors import M2NError, PeerLostError, StoreError
from m2n_async._store._wire import DEFAULT_MAX_FRAME, MAX_REQUEST_KEYS

__all__ = [
    "GENERATION_SUFFIX",
    "Session",
    "Snapshot",
    "StaleGenerationError",
    "StoreCore",
    "StoreLimitError",
    "Waiter",
    "DEFAULT_MAX_BYTES",
    "generation_key",
]

GENERATION_SUFFIX: Final[str] = "generation"
CLAIMS_SEGMENT: Final[str] = "claims"
CLAIMS_SEQ: Final[str] = "seq"
_INT64_MIN: Final[int] = -(2**63)
_INT64_MAX: Final[int] = 2**63 - 1
#: Store-wide byte quota by default: the store is a control plane (plans, addresses, small
#: outcomes), never the weights, so a job near this is misbehaving.
DEFAULT_MAX_BYTES: Final[int] = 1024 * 1024 * 1024


class StaleGenerationError(StoreError):
    """An operation named a key of a generation older than its job's current one."""

    def __init__(self, message: str, *, job: str, generation: int, current: int) -> None:
        self.job = job
        self.generation = generation
        self.current = current
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        # The keywords through the constructor (it has no default for them; calling the class
        # with the message alone failed to unpickle), every attribute and note as state.
        return (functools.partial(type(self), job=self.job, generation=self.generation,
                                  current=self.current),
                (self.args[0],), dict(vars(self)))


class StoreLimitError(StoreError):
    """A request was refused because it would pass one of the store's limits.

    ``limit`` names it (``"max_bytes"``, ``"max_job_bytes"``, ``"max_reply"``, or a server
    limit such as ``"max_connections"``); the store keeps serving, and the same request with
    less data (or after keys were deleted) may succeed.
    """

    def __init__(self, message: str, *, limit: str) -> None:
        self.limit = limit
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        # The keywords through the constructor (it has no default for them; calling the class
        # with the message alone failed to unpickle), every attribute and note as state.
        return (functools.partial(type(self), limit=self.limit),
                (self.args[0],), dict(vars(self)))


# What one map entry of a gather reply costs on the wire beyond its key's and value's bytes:
# a msgpack str header and a bin header, 5 bytes each at most.
_ENTRY_OVERHEAD: Final[int] = 10
_REPLY_OVERHEAD: Final[int] = 64  # the map header, the Items tag, the request id, the frame
#: A job counter is never deleted (its job's generations must not repeat): its key is kept
#: short, or a few adds could pin ``max_bytes`` until the server restarts.
MAX_COUNTER_KEY: Final[int] = 512
#: The keys of every tombstone together (they are outside ``max_bytes``): past it the oldest
#: are forgotten, as past ``max_tombstones``.
MAX_TOMBSTONE_BYTES: Final[int] = 64 << 20
#: What one key a parked waiter indexes costs beyond its bytes (the index entries): a
#: session's waiters index at most ``max_reply`` bytes of keys so counted.
_INDEX_ENTRY_COST: Final[int] = 64
#: The keys that parked gathers' prefixes index, all prefixes together. Past it a prefix keeps
#: only a count of its keys and collects them when its gather completes: otherwise gathers
#: parked on nested prefixes ("", "a", "aa", ...) would each index every key of the store,
#: outside every quota (a collective's few prefixes stay far below it, and fast).
MAX_TRACKED_KEYS: Final[int] = 1 << 20


def _key_bytes(key: str) -> int:
    return len(key) if key.isascii() else len(key.encode())


#: What one stored key costs the server beyond its key's and value's bytes (the ``str`` and
#: ``bytes`` objects and the dict entry; ~85 B measured on CPython 3.11): charged to the byte
#: quotas, so that ``max_bytes`` bounds the memory of many small keys too (5 million empty
#: keys took 424 MiB within a 32 MiB quota before it was charged).
_KEY_ENTRY_COST: Final[int] = 96


def _entry_bytes(key: str) -> int:
    """What a new key costs the byte quotas, besides its value."""
    return _key_bytes(key) + _KEY_ENTRY_COST


#: How many characters of a key an error message quotes. A key may be nearly as long as a
#: frame, and its repr up to 4x that: an error quoting it whole would not fit a reply frame,
#: and its client would see a protocol error instead of the refusal.
_QUOTE_CHARS: Final[int] = 200


def _quote(key: str) -> str:
    """``key`` for an error message: its repr, cut to ``_QUOTE_CHARS`` characters."""
    if len(key) <= _QUOTE_CHARS:
        return repr(key)
    return f"{key[:_QUOTE_CHARS]!r}... ({_key_bytes(key)} bytes)"


def _job_of(key: str) -> str | None:
    slash = key.find("/")
    return key[:slash] if slash > 0 else None


def _protection(key: str) -> Literal["counter", "claim"] | None:
    """Whether ``key`` is a job's generation or ticket counter, or a claim entry."""
    first = key.find("/")
    if first <= 0:
        return None
    rest = key[first + 1:]
    if rest == GENERATION_SUFFIX:
        return "counter"
    if rest.startswith(CLAIMS_SEGMENT + "/"):
        return "counter" if rest == f"{CLAIMS_SEGMENT}/{CLAIMS_SEQ}" else "claim"
    return None


def generation_key(job: str) -> str:
    """The key holding ``job``'s generation counter."""
    if not job or "/" in job:
        raise ValueError(f"job name must be non-empty and contain no '/', got {job!r}")
    return f"{job}/{GENERATION_SUFFIX}"


def _generation_of(key: str) -> tuple[str, int] | None:
    """``(job, generation)`` if ``key`` (or a prefix) lies in a ``{job}/{digits}...`` namespace.

    A prefix whose generation segment is not closed by ``/`` counts as that generation too:
    "job/1" also covers "job/10/...", so a rank left in generation 1 must not reach through it
    into a live generation 10.
    """
    first = key.find("/")
    if first <= 0:
        return None
    second = key.find("/", first + 1)
    segment = key[first + 1:] if second < 0 else key[first + 1: second]
    if not segment or not segment.isascii() or not segment.isdigit() or len(segment) > 18:
        return None
    return key[:first], int(segment)


class _Spaces:
    """Keys (or prefixes) of jobs, indexed by their space: ``{job}/{segment}``, the key up to
    its second ``/``, whose segment may be a generation (``_generation_of``). What concerns one
    job or one space -- a generation's purge, a new prefix's keys -- then reads those keys, not
    the whole store's: each of a token holder's few bytes of generation-advancing ``add``s
    otherwise scanned every key held (~0.15 s a request at 200,000 keys).

    A key's space is two ``find``s away; a space's generation is parsed once, when its first
    key arrives (the hot path of a ``set`` stays a slice, a lookup and a set insert)."""

    __slots__ = ("_jobs", "_keys")

    def __init__(self) -> None:
        self._keys: dict[str, set[str]] = {}  # space -> its keys
        self._jobs: dict[str, dict[str, int | None]] = {}  # job -> its spaces -> generation

    def add(self, key: str) -> None:
        first = key.find("/")
        if first <= 0:
            return  # outside every job: found by scanning (``under``)
        second = key.find("/", first + 1)
        space = key if second < 0 else key[:second]
        keys = self._keys.get(space)
        if keys is None:
            keys = self._keys[space] = set()
            where = _generation_of(space)
            spaces = self._jobs.get(key[:first])
            if spaces is None:
                spaces = self._jobs[key[:first]] = {}
            spaces[space] = None if where is None else where[1]
        keys.add(key)

    def discard(self, key: str) -> None:
        first = key.find("/")
        if first <= 0:
            return
        second = key.find("/", first + 1)
        space = key if second < 0 else key[:second]
        keys = self._keys.get(space)
        if keys is None:
            return
        keys.discard(key)
        if not keys:
            del self._keys[space]
            spaces = self._jobs[key[:first]]
            del spaces[space]
            if not spaces:
                del self._jobs[key[:first]]

    def older(self, job: str, current: int) -> list[str]:
        """The keys of ``job``'s generations before ``current``. Reads the job's spaces: a
        job's ranks hold a few (each generation's, the counters'); one who fills a job with
        thousands of spaces makes that job's advance read each, not the store's keys."""
        keys = self._keys
        return [key for space, generation in self._jobs.get(job, {}).items()
                if generation is not None and generation < current for key in keys[space]]

    def under(self, prefix: str, every: Iterable[str]) -> Iterable[str]:
        """The keys that may start with ``prefix`` (a superset: the caller tests each);
        ``every`` (all keys) for a prefix outside every job."""
        first = prefix.find("/")
        if first <= 0:
            return every
        second = prefix.find("/", first + 1)
        if second >= 0:  # the space is closed: its keys, all of them
            return self._keys.get(prefix[:second], ())
        keys = self._keys
        return [key for space in self._jobs.get(prefix[:first], {}) if space.startswith(prefix)
                for key in keys[space]]


def check_request_keys(op: str, *lists: Sequence[str]) -> None:
    """Refuse a request listing more than ``MAX_REQUEST_KEYS`` keys in one list (its keys or
    its watch): the same ``StoreLimitError`` from ``MemoryStore``, from the server and from
    ``StoreClient`` before it sends (whose server would otherwise drop the connection on a
    frame it may not decode)."""
    for keys in lists:
        if len(keys) > MAX_REQUEST_KEYS:
            raise StoreLimitError(
                f"{op}: {len(keys)} keys in one list, past the store's limit of "
                f"{MAX_REQUEST_KEYS} a request", limit="max_request_keys")


class Session:
    """One client of the store (one TCP connection, or one ``MemoryStore`` handle)."""

    __slots__ = ("closed", "ephemeral", "id", "waiter_bytes", "waiters")

    def __init__(self, session_id: int) -> None:
        self.id = session_id
        self.ephemeral: set[str] = set()
        self.waiters: set[Waiter] = set()
        self.waiter_bytes = 0  # what its pending waiters index (``_INDEX_ENTRY_COST``)
        self.closed = False


WaiterKind = Literal["get", "wait", "gather"]


class Snapshot:
    """A gather's result: the keys under a prefix at completion, shared by every waiter that
    completed at that moment (64 ranks of one all-gather get one object, so a driver can encode
    it once: ``cache`` is the driver's memo slot). Treat ``items`` as read-only."""

    __slots__ = ("cache", "items", "nbytes")

    def __init__(self, items: dict[str, bytes], nbytes: int = 0) -> None:
        self.items = items
        self.nbytes = nbytes  # the reply's size on the wire, at most (sized before encoding)
        self.cache: object = None


class Waiter:
    """A blocking operation: pending until ``done``; then ``result`` or ``error`` is set."""

    __slots__ = ("cost", "done", "error", "keys_left", "kind", "n", "notify", "prefix",
                 "result", "session", "watch")

    def __init__(self, session: Session, kind: WaiterKind, notify: Callable[[], None]) -> None:
        self.session = session
        self.kind: WaiterKind = kind
        self.notify = notify
        self.keys_left: set[str] = set()
        self.prefix = ""
        self.n = 0
        self.watch: tuple[str, ...] = ()
        self.done = False
        self.result: bytes | Snapshot | None = None
        self.error: M2NError | None = None
        self.cost = 0  # its share of ``Session.waiter_bytes``


class _PrefixTrack:
    """Keys present under a prefix that gather waiters are watching (dropped when unwatched):
    how many, and which while ``MAX_TRACKED_KEYS`` allows (``None``: collected on completion)."""

    __slots__ = ("count", "keys", "waiters")

    def __init__(self, keys: set[str] | None, count: int) -> None:
        self.keys = keys
        self.count = count
        self.waiters: set[Waiter] = set()


class StoreCore:
    """All store state and semantics. Not thread-safe: drive it from one event loop."""

    def __init__(self, *, max_tombstones: int = 65536, max_waiters_per_session: int = 4096,
                 max_bytes: int | None = DEFAULT_MAX_BYTES, max_job_bytes: int | None = None,
                 max_reply: int | None = DEFAULT_MAX_FRAME) -> None:
        for name, limit in (("max_bytes", max_bytes), ("max_job_bytes", max_job_bytes),
                            ("max_reply", max_reply)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {limit}")
        if max_tombstones < 1:
            raise ValueError(f"max_tombstones must be >= 1, got {max_tombstones}")
        if max_waiters_per_session < 1:
            raise ValueError(f"max_waiters_per_session must be >= 1, got "
                             f"{max_waiters_per_session}")
        self._data: dict[str, bytes] = {}
        self._owner: dict[str, Session] = {}
        self._key_waiters: dict[str, set[Waiter]] = {}
        self._prefixes: dict[str, _PrefixTrack] = {}
        # the keys of _data, _key_waiters and _prefixes by job and generation (_Spaces)
        self._held, self._waited, self._parked = _Spaces(), _Spaces(), _Spaces()
        #: how many parked prefixes have each length: a new key looks up its own prefix of
        #: each such length (``_tracks_of``) instead of testing every parked prefix
        self._prefix_lens: dict[int, int] = {}
        self._tracked = 0  # keys the tracks' ``keys`` sets hold, together (MAX_TRACKED_KEYS)
        self._watchers: dict[str, set[Waiter]] = {}
        # key -> when it was lost (a sequence number): a waiter watching several lost keys
        # is told about the first loss, the root cause, not whichever it lists first.
        self._tombstones: OrderedDict[str, int] = OrderedDict()
        self._losses = 0
        self._tombstone_bytes = 0
        self._generations: dict[str, int] = {}
        self._max_tombstones = max_tombstones
        self._max_waiters = max_waiters_per_session
        self._next_session = 1
        self._max_bytes = max_bytes
        self._max_job_bytes = max_job_bytes
        self._max_reply = max_reply
        self._bytes = 0  # keys and values held (and each key's entry), the quotas' unit
        self._job_bytes: dict[str, int] = {}

    # --- introspection (tests, diagnostics) ----------------------------------------------

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> list[str]:
        return sorted(self._data)

    @property
    def pending_waiters(self) -> int:
        return sum(len(s) for s in self._key_waiters.values()) + sum(
            len(t.waiters) for t in self._prefixes.values())

    @property
    def tombstones(self) -> int:
        return len(self._tombstones)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held, plus ``_KEY_ENTRY_COST`` per key (what
        ``max_bytes`` bounds)."""
        return self._bytes

    def job_bytes(self, job: str) -> int:
        """As ``nbytes``, of the keys under ``{job}/`` (what ``max_job_bytes`` bounds)."""
        return self._job_bytes.get(job, 0)

    # --- sessions ------------------------------------------------------------------------

    def open_session(self) -> Session:
        session = Session(self._next_session)
        self._next_session += 1
        return session

    def close_session(self, session: Session) -> None:
        """End ``session``: forget its waiters, then lose its ephemeral keys."""
        if session.closed:
            return
        session.closed = True
        for waiter in list(session.waiters):
            self.cancel(waiter)
        for key in sorted(session.ephemeral):
            self._owner.pop(key, None)
            if self._forget(key) is not None:
                self._key_removed(key)
            self._lose(key, "the session that wrote it ended")
        session.ephemeral.clear()

    def _lose(self, key: str, why: str) -> None:
        """Tombstone ``key`` and fail everyone watching it."""
        self._losses += 1
        if key not in self._tombstones:
            self._tombstone_bytes += _key_bytes(key)
        self._tombstones[key] = self._losses
        self._tombstones.move_to_end(key)
        while (len(self._tombstones) > self._max_tombstones
               or self._tombstone_bytes > MAX_TOMBSTONE_BYTES):
            old, _ = self._tombstones.popitem(last=False)
            self._tombstone_bytes -= _key_bytes(old)
        for waiter in list(self._watchers.get(key, ())):
            self._finish(waiter, error=PeerLostError(f"store key {_quote(key)} was lost: {why}",
                                                     key=key))

    # --- non-blocking operations ---------------------------------------------------------

    def set(self, session: Session, key: str, value: bytes, *, ephemeral: bool = False) -> None:
        self._check_live(session)
        self._check_key(key)
        self._check_writable(session, key, "set", ephemeral=ephemeral)
        self._write(key, value)
        self._disown(key)
        if ephemeral:
            self._owner[key] = session
            session.ephemeral.add(key)

    def _take_over(self, session: Session, key: str) -> None:
        """After ``session`` wrote ``key`` by ``add`` or ``compare_set``: an ephemeral key of
        another session is now the writer's value, durable as after its plain ``set``, so the
        old owner's end does not delete it (the writer's own key stays ephemeral)."""
        owner = self._owner.get(key)
        if owner is not None and owner is not session:
            self._disown(key)

    def _disown(self, key: str) -> None:
        previous = self._owner.pop(key, None)
        if previous is not None:
            previous.ephemeral.discard(key)

    def get(self, session: Session, key: str) -> bytes | None:
        self._check_live(session)
        self._check_key(key)
        return self._data.get(key)

    def add(self, session: Session, key: str, delta: int = 1) -> int:
        self._check_live(session)
        self._check_key(key)
        if not _INT64_MIN <= delta <= _INT64_MAX:
            raise StoreError(f"add to {_quote(key)}: delta {delta} is not an int64")
        protection = _protection(key)
        if protection == "claim":
            self._refuse(key, "add", protection)
        if (protection == "counter" and key not in self._data
                and _key_bytes(key) > MAX_COUNTER_KEY):
            raise StoreLimitError(
                f"add to a job counter of a {_key_bytes(key)}-byte key refused: a counter is "
                f"never deleted, so its key is at most {MAX_COUNTER_KEY} bytes",
                limit="max_counter_key")
        if protection == "counter" and delta < 0:
            raise StoreError(f"add to {_quote(key)}: delta {delta} would move a job counter back, "
                             "which would hand out a generation or ticket twice (delta >= 0)")
        old = self._data.get(key)
        base = 0
        if old is not None:
            try:
                base = int(old)
            except ValueError:
                what = "job counter" if protection else "key"
                raise StoreError(f"add to {_quote(key)}: the {what} holds a non-integer value "
                                 f"({old[:32]!r})") from None
        value = base + delta
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise StoreError(f"add to {_quote(key)}: {base} + {delta} overflows int64")
        self._write(key, str(value).encode())
        self._take_over(session, key)
        return value

    def compare_set(self, session: Session, key: str, expected: bytes | None, desired: bytes
                    ) -> tuple[bool, bytes | None]:
        self._check_live(session)
        self._check_key(key)
        protection = _protection(key)
        if protection is not None:
            self._refuse(key, "compare_set", protection)
        current = self._data.get(key)
        if current != expected:
            return False, current
        self._write(key, desired)
        self._take_over(session, key)
        return True, desired

    def delete(self, session: Session, key: str, *, lost: bool = False) -> bool:
        """Remove ``key``; ``lost=True`` removes it as its session's end would (a tombstone,
        and watchers get ``PeerLostError``): how a rank that fails leaves on purpose."""
        self._check_live(session)
        self._check_key(key)
        self._check_writable(session, key, "delete")
        existed = self._remove(key)
        if lost:
            self._lose(key, f"session {session.id} gave it up as lost")
        return existed

    def delete_prefix(self, session: Session, prefix: str) -> int:
        self._check_live(session)
        self._check_key(prefix, prefix=True)
        # The job's counters and claims are not ordinary keys: deleting a whole job's prefix must
        # not reset its generation (a stale rank's writes would be accepted again).
        doomed = [k for k in self._held.under(prefix, self._data)
                  if k.startswith(prefix) and _protection(k) is None]
        for key in doomed:
            self._remove(key)
        return len(doomed)

    # --- blocking operations -------------------------------------------------------------

    def begin_get(self, session: Session, key: str, watch: Sequence[str],
                  notify: Callable[[], None]) -> Waiter:
        """Wait for ``key`` to exist; result: its value."""
        self._check_live(session)
        check_request_keys("get", watch)
        self._check_key(key)
        waiter = Waiter(session, "get", notify)
        value = self._data.get(key)
        if value is not None:
            waiter.done, waiter.result = True, value
            return waiter
        waiter.keys_left = {key}
        return self._register(waiter, watch)

    def begin_wait(self, session: Session, keys: Sequence[str], watch: Sequence[str],
                   notify: Callable[[], None]) -> Waiter:
        """Wait until every key of ``keys`` has been set (each seen once is enough)."""
        self._check_live(session)
        check_request_keys("wait", keys, watch)
        for key in keys:
            self._check_key(key)
        waiter = Waiter(session, "wait", notify)
        waiter.keys_left = {k for k in keys if k not in self._data}
        if not waiter.keys_left:
            waiter.done = True
            return waiter
        return self._register(waiter, watch)

    def begin_gather(self, session: Session, prefix: str, n: int, watch: Sequence[str],
                     notify: Callable[[], None]) -> Waiter:
        """Wait until at least ``n`` keys exist under ``prefix``; result: all of them."""
        self._check_live(session)
        check_request_keys("gather", watch)
        self._check_key(prefix, prefix=True)
        if n < 0:
            raise StoreError(f"gather {_quote(prefix)}: n must be >= 0, got {n}")
        waiter = Waiter(session, "gather", notify)
        waiter.prefix, waiter.n = prefix, n
        track = self._prefixes.get(prefix)
        present: Collection[str]
        if track is None:
            fresh = present = {k for k in self._held.under(prefix, self._data)
                               if k.startswith(prefix)}
        else:
            fresh, present = None, self._keys_of(track, prefix)
        if len(present) >= n:
            snapshot = self._snapshot(present, prefix)
            if isinstance(snapshot, StoreLimitError):
                raise snapshot
            waiter.done = True
            waiter.result = snapshot
            return waiter
        if fresh is not None:
            within = self._tracked + len(fresh) <= MAX_TRACKED_KEYS
            track = _PrefixTrack(fresh if within else None, len(fresh))
            self._register(waiter, watch, track=track)  # raises before mutating anything
            self._prefixes[prefix] = track
            self._parked.add(prefix)
            self._prefix_lens[len(prefix)] = self._prefix_lens.get(len(prefix), 0) + 1
            self._tracked += len(fresh) if within else 0
        else:
            self._register(waiter, watch, track=track)
        return waiter

    def begin_exchange(self, session: Session, key: str, value: bytes, delete: str | None,
                       prefix: str, n: int, watch: Sequence[str],
                       notify: Callable[[], None]) -> Waiter:
        """``delete(delete)``, ``set(key, value)``, then ``gather(prefix, n)`` — atomically.

        Atomicity is what makes a collective's cleanup safe: a rank's contribution and its
        gather arrive together, so once any rank saw call ``s`` complete, every rank's gather of
        call ``s`` has completed too, and the next call may delete call ``s``'s keys.

        Refusals: one of the write (a key it may not write, the byte quota) changes nothing.
        One of the gather (a watched key already lost, this session's waiter limits, a reply
        past ``max_reply``) comes after the write, which stays, as a ``set`` followed by a
        refused ``gather`` would: the caller's collective fails either way, and the write may
        already have completed other sessions' waits, which nothing could take back.
        """
        self._check_live(session)
        check_request_keys("exchange", watch)
        self._check_key(key)
        self._check_key(prefix, prefix=True)
        if delete is not None:
            self._check_key(delete)
        if n < 0:
            raise StoreError(f"exchange {_quote(prefix)}: n must be >= 0, got {n}")
        self._check_writable(session, key, "exchange")
        if delete is not None:
            self._check_writable(session, delete, "exchange")
        self._check_quota(key, value)  # before the delete: a refused write changes nothing
        if delete is not None and delete != key:
            self._remove(delete)
        self.set(session, key, value)
        return self.begin_gather(session, prefix, n, watch, notify)

    def cancel(self, waiter: Waiter) -> None:
        """Forget a pending waiter (its caller gave up). No-op once done."""
        if not waiter.done:
            waiter.done = True
            self._unregister(waiter)

    # --- internals -----------------------------------------------------------------------

    def _check_live(self, session: Session) -> None:
        if session.closed:
            raise StoreError(f"store session {session.id} is closed")

    def _check_key(self, key: str, *, prefix: bool = False) -> None:
        where = _generation_of(key)
        if where is None:
            return
        job, generation = where
        current = self._generations.get(job)
        if current is not None and generation < current:
            raise StaleGenerationError(
                f"store {'prefix' if prefix else 'key'} {_quote(key)} belongs to generation "
                f"{generation} of job {_quote(job)}, which is stale (current generation: "
                f"{current})",
                job=job, generation=generation, current=current)

    def _refuse(self, key: str, op: str, protection: Literal["counter", "claim"]) -> None:
        if protection == "counter":
            raise StoreError(f"{op} of {_quote(key)} refused: it is a job counter (generation or "
                             "claim tickets), which only add (delta >= 0) changes")
        raise StoreError(f"{op} of {_quote(key)} refused: it is a job claim entry, which its "
                         "holder writes with set(ephemeral=True) and deletes, and nobody else")

    def _check_writable(self, session: Session, key: str, op: str, *,
                        ephemeral: bool = True) -> None:
        """Refuse ``op`` (a set or delete) of a protected key (module docstring)."""
        protection = _protection(key)
        if protection is None:
            return
        if protection == "counter" or op == "exchange":
            self._refuse(key, op, protection)
        if not ephemeral:
            raise StoreError(f"set of {_quote(key)} refused: a job claim entry must be ephemeral "
                             "(it must vanish with its holder)")
        owner = self._owner.get(key)
        if owner is not None and owner is not session:
            raise StoreError(f"{op} of {_quote(key)} refused: the claim entry belongs to store "
                             f"session {owner.id}, not to session {session.id}")

    def _check_quota(self, key: str, value: bytes) -> None:
        """Raise ``StoreLimitError`` if writing ``key`` would pass a byte quota."""
        old = self._data.get(key)
        grow = len(value) - (len(old) if old is not None else -_entry_bytes(key))
        if grow <= 0:
            return
        if self._max_bytes is not None and self._bytes + grow > self._max_bytes:
            raise StoreLimitError(
                f"store quota max_bytes ({self._max_bytes} bytes) refuses a write of {_quote(key)} "
                f"({len(value)} bytes): the store holds {self._bytes} bytes", limit="max_bytes")
        job = _job_of(key)
        if self._max_job_bytes is not None and job is not None:
            held = self._job_bytes.get(job, 0)
            if held + grow > self._max_job_bytes:
                raise StoreLimitError(
                    f"store quota max_job_bytes ({self._max_job_bytes} bytes per job) refuses a "
                    f"write of {_quote(key)} ({len(value)} bytes): job {_quote(job)} holds "
                    f"{held} bytes",
                    limit="max_job_bytes")

    def _account(self, key: str, grow: int) -> None:
        self._bytes += grow
        job = _job_of(key)
        if job is not None:
            held = self._job_bytes.get(job, 0) + grow
            if held:
                self._job_bytes[job] = held
            else:
                del self._job_bytes[job]

    def _forget(self, key: str) -> bytes | None:
        """Pop ``key``'s value, keeping the byte accounting."""
        value = self._data.pop(key, None)
        if value is not None:
            self._account(key, -(_entry_bytes(key) + len(value)))
            self._held.discard(key)
        return value

    def _keys_of(self, track: _PrefixTrack, prefix: str) -> Collection[str]:
        """The keys present under ``track``'s prefix (``prefix``)."""
        if track.keys is not None:
            return track.keys
        return [k for k in self._held.under(prefix, self._data) if k.startswith(prefix)]

    def _snapshot(self, keys: Collection[str], prefix: str) -> Snapshot | StoreLimitError:
        """The gather result for ``keys``, or the error if it would pass ``max_reply``."""
        data = self._data
        nbytes = _REPLY_OVERHEAD + sum(_key_bytes(k) + len(data[k]) + _ENTRY_OVERHEAD
                                       for k in keys)
        if self._max_reply is not None and nbytes > self._max_reply:
            return StoreLimitError(
                f"gather of {_quote(prefix)}: the reply ({len(keys)} keys, {nbytes} bytes) would "
                f"exceed the store's frame limit for a reply (max_reply, {self._max_reply} bytes)",
                limit="max_reply")
        return Snapshot({k: data[k] for k in sorted(keys)}, nbytes)

    def _register(self, waiter: Waiter, watch: Sequence[str],
                  track: _PrefixTrack | None = None) -> Waiter:
        lost = [key for key in watch if key in self._tombstones]
        if lost:
            key = min(lost, key=self._tombstones.__getitem__)
            raise PeerLostError(
                f"store key {_quote(key)} was lost: the session that wrote it ended", key=key)
        if len(waiter.session.waiters) >= self._max_waiters:
            raise StoreError(f"store session {waiter.session.id} has {self._max_waiters} "
                             "blocking requests pending (the limit)")
        waiter.watch = tuple(dict.fromkeys(watch))
        # Counted in bytes as well as in number: one Wait frame of short keys would
        # otherwise hold tens of times its size in index entries, outside every quota.
        cost = _key_bytes(waiter.prefix) + sum(
            _key_bytes(k) + _INDEX_ENTRY_COST for k in (*waiter.keys_left, *waiter.watch))
        session = waiter.session
        if self._max_reply is not None and session.waiter_bytes + cost > self._max_reply:
            raise StoreLimitError(
                f"store session {session.id}: its pending blocking requests would index "
                f"{session.waiter_bytes + cost} bytes of keys, past max_reply "
                f"({self._max_reply} bytes); wait for fewer keys at once",
                limit="max_reply")
        waiter.cost = cost
        session.waiter_bytes += cost
        for key in waiter.keys_left:
            waiting = self._key_waiters.get(key)
            if waiting is None:
                waiting = self._key_waiters[key] = set()
                self._waited.add(key)
            waiting.add(waiter)
        if track is not None:
            track.waiters.add(waiter)
        for key in waiter.watch:
            self._watchers.setdefault(key, set()).add(waiter)
        waiter.session.waiters.add(waiter)
        return waiter

    def _unregister(self, waiter: Waiter) -> None:
        waiter.session.waiters.discard(waiter)
        waiter.session.waiter_bytes -= waiter.cost
        waiter.cost = 0
        for key in waiter.keys_left:
            if _discard(self._key_waiters, key, waiter):
                self._waited.discard(key)
        for key in waiter.watch:
            _discard(self._watchers, key, waiter)
        if waiter.kind == "gather":
            track = self._prefixes.get(waiter.prefix)
            if track is not None:
                track.waiters.discard(waiter)
                if not track.waiters:
                    del self._prefixes[waiter.prefix]
                    self._parked.discard(waiter.prefix)
                    n = len(waiter.prefix)
                    if self._prefix_lens[n] == 1:
                        del self._prefix_lens[n]
                    else:
                        self._prefix_lens[n] -= 1
                    self._tracked -= len(track.keys) if track.keys is not None else 0

    def _finish(self, waiter: Waiter, *, result: bytes | Snapshot | None = None,
                error: M2NError | None = None) -> None:
        if waiter.done:
            return
        waiter.done = True
        waiter.result, waiter.error = result, error
        self._unregister(waiter)
        waiter.notify()

    def _write(self, key: str, value: bytes) -> None:
        self._check_quota(key, value)
        old = self._data.get(key)
        new = old is None
        self._account(key, len(value) - (len(old) if old is not None else -_entry_bytes(key)))
        self._data[key] = value
        if self._tombstones.pop(key, None) is not None:
            self._tombstone_bytes -= _key_bytes(key)
        if new:
            self._held.add(key)
            self._key_added(key)
        self._maybe_advance_generation(key, value)

    def _remove(self, key: str) -> bool:
        if self._forget(key) is None:
            return False
        owner = self._owner.pop(key, None)
        if owner is not None:
            owner.ephemeral.discard(key)
        self._key_removed(key)
        return True

    def _key_added(self, key: str) -> None:
        waiters = self._key_waiters.pop(key, None)
        if waiters is not None:
            self._waited.discard(key)
            value = self._data[key]
            for waiter in list(waiters):
                waiter.keys_left.discard(key)
                if waiter.kind == "get":
                    self._finish(waiter, result=value)
                elif not waiter.keys_left:
                    self._finish(waiter)
        if self._prefixes:
            for prefix, track in self._tracks_of(key):
                track.count += 1
                if track.keys is not None:
                    if self._tracked < MAX_TRACKED_KEYS:
                        track.keys.add(key)
                        self._tracked += 1
                    else:  # from now on counted only (MAX_TRACKED_KEYS says why)
                        self._tracked -= len(track.keys)
                        track.keys = None
                ready = [w for w in track.waiters if w.n <= track.count]
                if ready:
                    snapshot = self._snapshot(self._keys_of(track, prefix), prefix)
                    for waiter in ready:
                        if isinstance(snapshot, StoreLimitError):
                            self._finish(waiter, error=snapshot)
                        else:
                            self._finish(waiter, result=snapshot)

    def _key_removed(self, key: str) -> None:
        if self._prefixes:
            for _, track in self._tracks_of(key):
                track.count -= 1  # it was present: only keys held are removed
                if track.keys is not None:
                    track.keys.discard(key)
                    self._tracked -= 1

    def _tracks_of(self, key: str) -> list[tuple[str, _PrefixTrack]]:
        """The parked gathers' prefixes that ``key`` starts with, and their tracks: one
        lookup per distinct prefix length, not one test per parked prefix (a session may
        park 4,096 gathers, each on its own prefix, and every new key would walk them all).
        A list: finishing a waiter may drop its track meanwhile."""
        prefixes, n = self._prefixes, len(key)
        out = []
        for length in self._prefix_lens:
            if length <= n:
                prefix = key[:length]
                track = prefixes.get(prefix)
                if track is not None:
                    out.append((prefix, track))
        return out

    def _maybe_advance_generation(self, key: str, value: bytes) -> None:
        slash = key.find("/")
        if slash <= 0 or key[slash + 1:] != GENERATION_SUFFIX:
            return
        try:
            generation = int(value)
        except ValueError:
            return
        job = key[:slash]
        if generation <= self._generations.get(job, -(2**63)):
            return
        self._generations[job] = generation
        self._purge_stale(job, generation)

    def _purge_stale(self, job: str, current: int) -> None:
        # Through the indexes: the job's older generations only, never a scan of the store.
        for key in self._held.older(job, current):
            self._remove(key)
        doomed: list[tuple[Waiter, str]] = []
        for key in self._waited.older(job, current):
            doomed.extend((w, key) for w in self._key_waiters[key])
        for prefix in self._parked.older(job, current):
            doomed.extend((w, prefix) for w in self._prefixes[prefix].waiters)
        for waiter, key in doomed:
            gen = _generation_of(key)
            self._finish(waiter, error=StaleGenerationError(
                f"store key {_quote(key)} became stale while waiting: job {_quote(job)} moved "
                f"on to generation {current}", job=job, generation=gen[1] if gen else -1,
                current=current))


def _discard(index: dict[str, set[Waiter]], key: str, waiter: Waiter) -> bool:
    """Drop ``waiter`` from ``index[key]``; True when that emptied (and removed) the entry."""
    bucket = index.get(key)
    if bucket is not None:
        bucket.discard(waiter)
        if not bucket:
            del index[key]
            return True
    return False
