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
``delete(key, lost=True)`` is a deliberate unclean one, as if the session had ended.

A blocking call whose condition already holds completes even if a watched key is tombstoned:
the data it asked for is there, so a peer that finished and exited cannot fail a slower
peer's collective after the fact.

Generations: keys are namespaced ``{job}/{generation}/...``. The key ``{job}/generation``
holds the job's generation counter (advanced with ``add`` by ``next_generation``). When it
advances, every key of an older generation of that job is purged, waiters on them fail, and
any later operation on an older generation's key raises ``StaleGenerationError`` — a rank
that missed a reconnect cannot read or write the new generation's state by accident.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final, Literal

from m2n_async._proto.errors import M2NError, PeerLostError, StoreError

__all__ = [
    "GENERATION_SUFFIX",
    "Session",
    "Snapshot",
    "StaleGenerationError",
    "StoreCore",
    "Waiter",
    "generation_key",
]

GENERATION_SUFFIX: Final[str] = "generation"
_INT64_MIN: Final[int] = -(2**63)
_INT64_MAX: Final[int] = 2**63 - 1


class StaleGenerationError(StoreError):
    """An operation named a key of a generation older than its job's current one."""

    def __init__(self, message: str, *, job: str, generation: int, current: int) -> None:
        self.job = job
        self.generation = generation
        self.current = current
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0],), {"job": self.job, "generation": self.generation,
                                              "current": self.current})


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


class Session:
    """One client of the store (one TCP connection, or one ``MemoryStore`` handle)."""

    __slots__ = ("closed", "ephemeral", "id", "waiters")

    def __init__(self, session_id: int) -> None:
        self.id = session_id
        self.ephemeral: set[str] = set()
        self.waiters: set[Waiter] = set()
        self.closed = False


WaiterKind = Literal["get", "wait", "gather"]


class Snapshot:
    """A gather's result: the keys under a prefix at completion, shared by every waiter that
    completed at that moment (64 ranks of one all-gather get one object, so a driver can encode
    it once: ``cache`` is the driver's memo slot). Treat ``items`` as read-only."""

    __slots__ = ("cache", "items")

    def __init__(self, items: dict[str, bytes]) -> None:
        self.items = items
        self.cache: object = None


class Waiter:
    """A blocking operation: pending until ``done``; then ``result`` or ``error`` is set."""

    __slots__ = ("done", "error", "keys_left", "kind", "n", "notify", "prefix", "result",
                 "session", "watch")

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


class _PrefixTrack:
    """Keys present under a prefix that gather waiters are watching (dropped when unwatched)."""

    __slots__ = ("keys", "waiters")

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.waiters: set[Waiter] = set()


class StoreCore:
    """All store state and semantics. Not thread-safe: drive it from one event loop."""

    def __init__(self, *, max_tombstones: int = 65536, max_waiters_per_session: int = 4096
                 ) -> None:
        if max_tombstones < 1:
            raise ValueError(f"max_tombstones must be >= 1, got {max_tombstones}")
        if max_waiters_per_session < 1:
            raise ValueError(f"max_waiters_per_session must be >= 1, got "
                             f"{max_waiters_per_session}")
        self._data: dict[str, bytes] = {}
        self._owner: dict[str, Session] = {}
        self._key_waiters: dict[str, set[Waiter]] = {}
        self._prefixes: dict[str, _PrefixTrack] = {}
        self._watchers: dict[str, set[Waiter]] = {}
        # key -> when it was lost (a sequence number): a waiter watching several lost keys
        # is told about the first loss, the root cause, not whichever it lists first.
        self._tombstones: OrderedDict[str, int] = OrderedDict()
        self._losses = 0
        self._generations: dict[str, int] = {}
        self._max_tombstones = max_tombstones
        self._max_waiters = max_waiters_per_session
        self._next_session = 1

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
            if self._data.pop(key, None) is not None:
                self._key_removed(key)
            self._lose(key, "the session that wrote it ended")
        session.ephemeral.clear()

    def _lose(self, key: str, why: str) -> None:
        """Tombstone ``key`` and fail everyone watching it."""
        self._losses += 1
        self._tombstones[key] = self._losses
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
        for waiter in list(self._watchers.get(key, ())):
            self._finish(waiter, error=PeerLostError(f"store key {key!r} was lost: {why}",
                                                     key=key))

    # --- non-blocking operations ---------------------------------------------------------

    def set(self, session: Session, key: str, value: bytes, *, ephemeral: bool = False) -> None:
        self._check_live(session)
        self._check_key(key)
        self._write(key, value)
        previous = self._owner.pop(key, None)
        if previous is not None:
            previous.ephemeral.discard(key)
        if ephemeral:
            self._owner[key] = session
            session.ephemeral.add(key)

    def get(self, session: Session, key: str) -> bytes | None:
        self._check_live(session)
        self._check_key(key)
        return self._data.get(key)

    def add(self, session: Session, key: str, delta: int = 1) -> int:
        self._check_live(session)
        self._check_key(key)
        if not _INT64_MIN <= delta <= _INT64_MAX:
            raise StoreError(f"add to {key!r}: delta {delta} is not an int64")
        old = self._data.get(key)
        base = 0
        if old is not None:
            try:
                base = int(old)
            except ValueError:
                raise StoreError(f"add to {key!r}: it holds a non-integer value "
                                 f"({old[:32]!r})") from None
        value = base + delta
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise StoreError(f"add to {key!r}: {base} + {delta} overflows int64")
        self._write(key, str(value).encode())
        return value

    def compare_set(self, session: Session, key: str, expected: bytes | None, desired: bytes
                    ) -> tuple[bool, bytes | None]:
        self._check_live(session)
        self._check_key(key)
        current = self._data.get(key)
        if current != expected:
            return False, current
        self._write(key, desired)
        return True, desired

    def delete(self, session: Session, key: str, *, lost: bool = False) -> bool:
        """Remove ``key``; ``lost=True`` removes it as its session's end would (a tombstone,
        and watchers get ``PeerLostError``): how a rank that fails leaves on purpose."""
        self._check_live(session)
        self._check_key(key)
        existed = self._remove(key)
        if lost:
            self._lose(key, f"session {session.id} gave it up as lost")
        return existed

    def delete_prefix(self, session: Session, prefix: str) -> int:
        self._check_live(session)
        self._check_key(prefix, prefix=True)
        doomed = [k for k in self._data if k.startswith(prefix)]
        for key in doomed:
            self._remove(key)
        return len(doomed)

    # --- blocking operations -------------------------------------------------------------

    def begin_get(self, session: Session, key: str, watch: Sequence[str],
                  notify: Callable[[], None]) -> Waiter:
        """Wait for ``key`` to exist; result: its value."""
        self._check_live(session)
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
        self._check_key(prefix, prefix=True)
        if n < 0:
            raise StoreError(f"gather {prefix!r}: n must be >= 0, got {n}")
        waiter = Waiter(session, "gather", notify)
        waiter.prefix, waiter.n = prefix, n
        track = self._prefixes.get(prefix)
        present = track.keys if track is not None else {
            k for k in self._data if k.startswith(prefix)}
        if len(present) >= n:
            waiter.done = True
            waiter.result = Snapshot({k: self._data[k] for k in sorted(present)})
            return waiter
        if track is None:
            track = _PrefixTrack(present)
            self._register(waiter, watch, track=track)  # raises before mutating anything
            self._prefixes[prefix] = track
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
        """
        self._check_live(session)
        self._check_key(key)
        self._check_key(prefix, prefix=True)
        if delete is not None:
            self._check_key(delete)
        if n < 0:
            raise StoreError(f"exchange {prefix!r}: n must be >= 0, got {n}")
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
                f"store {'prefix' if prefix else 'key'} {key!r} belongs to generation "
                f"{generation} of job {job!r}, which is stale (current generation: {current})",
                job=job, generation=generation, current=current)

    def _register(self, waiter: Waiter, watch: Sequence[str],
                  track: _PrefixTrack | None = None) -> Waiter:
        lost = [key for key in watch if key in self._tombstones]
        if lost:
            key = min(lost, key=self._tombstones.__getitem__)
            raise PeerLostError(
                f"store key {key!r} was lost: the session that wrote it ended", key=key)
        if len(waiter.session.waiters) >= self._max_waiters:
            raise StoreError(f"store session {waiter.session.id} has {self._max_waiters} "
                             "blocking requests pending (the limit)")
        waiter.watch = tuple(dict.fromkeys(watch))
        for key in waiter.keys_left:
            self._key_waiters.setdefault(key, set()).add(waiter)
        if track is not None:
            track.waiters.add(waiter)
        for key in waiter.watch:
            self._watchers.setdefault(key, set()).add(waiter)
        waiter.session.waiters.add(waiter)
        return waiter

    def _unregister(self, waiter: Waiter) -> None:
        waiter.session.waiters.discard(waiter)
        for key in waiter.keys_left:
            _discard(self._key_waiters, key, waiter)
        for key in waiter.watch:
            _discard(self._watchers, key, waiter)
        if waiter.kind == "gather":
            track = self._prefixes.get(waiter.prefix)
            if track is not None:
                track.waiters.discard(waiter)
                if not track.waiters:
                    del self._prefixes[waiter.prefix]

    def _finish(self, waiter: Waiter, *, result: bytes | Snapshot | None = None,
                error: M2NError | None = None) -> None:
        if waiter.done:
            return
        waiter.done = True
        waiter.result, waiter.error = result, error
        self._unregister(waiter)
        waiter.notify()

    def _write(self, key: str, value: bytes) -> None:
        new = key not in self._data
        self._data[key] = value
        self._tombstones.pop(key, None)
        if new:
            self._key_added(key)
        self._maybe_advance_generation(key, value)

    def _remove(self, key: str) -> bool:
        if self._data.pop(key, None) is None:
            return False
        owner = self._owner.pop(key, None)
        if owner is not None:
            owner.ephemeral.discard(key)
        self._key_removed(key)
        slash = key.find("/")
        if slash > 0 and key[slash + 1:] == GENERATION_SUFFIX:
            # Counter deleted: the job starts over, so its old floor must not refuse it.
            self._generations.pop(key[:slash], None)
        return True

    def _key_added(self, key: str) -> None:
        waiters = self._key_waiters.pop(key, None)
        if waiters:
            value = self._data[key]
            for waiter in list(waiters):
                waiter.keys_left.discard(key)
                if waiter.kind == "get":
                    self._finish(waiter, result=value)
                elif not waiter.keys_left:
                    self._finish(waiter)
        if self._prefixes:
            for prefix, track in list(self._prefixes.items()):
                if key.startswith(prefix):
                    track.keys.add(key)
                    ready = [w for w in track.waiters if w.n <= len(track.keys)]
                    if ready:
                        snapshot = Snapshot({k: self._data[k] for k in sorted(track.keys)})
                        for waiter in ready:
                            self._finish(waiter, result=snapshot)

    def _key_removed(self, key: str) -> None:
        if self._prefixes:
            for prefix, track in self._prefixes.items():
                if key.startswith(prefix):
                    track.keys.discard(key)

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
        def stale(k: str) -> bool:
            where = _generation_of(k)
            return where is not None and where[0] == job and where[1] < current

        for key in [k for k in self._data if stale(k)]:
            self._remove(key)
        doomed: list[tuple[Waiter, str]] = []
        for key, waiters in self._key_waiters.items():
            if stale(key):
                doomed.extend((w, key) for w in waiters)
        for prefix, track in self._prefixes.items():
            if stale(prefix):
                doomed.extend((w, prefix) for w in track.waiters)
        for waiter, key in doomed:
            gen = _generation_of(key)
            self._finish(waiter, error=StaleGenerationError(
                f"store key {key!r} became stale while waiting: job {job!r} moved on to "
                f"generation {current}", job=job, generation=gen[1] if gen else -1,
                current=current))


def _discard(index: dict[str, set[Waiter]], key: str, waiter: Waiter) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.discard(waiter)
        if not bucket:
            del index[key]
