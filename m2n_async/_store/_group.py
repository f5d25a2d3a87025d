"""``ControlGroup``: all-gather, broadcast and barrier for a fixed set of ranks over a Store.

Theory of operation: every collective call is one ``set`` of this rank's contribution under a
per-call prefix plus one server-side ``gather`` of ``world_size`` keys under it — one round
trip per rank (with ``exchange``), however many ranks. The prefix is
``{namespace}/c/{seq}/{kind}/`` where ``seq`` counts this group's calls: ranks that make the
same calls in the same order meet under the same prefix, and a rank that skipped or reordered a
call waits under a different prefix instead of silently reading another call's envelope (it
then times out in the caller's scope, and ``missing_ranks()`` names who never arrived).

Liveness: ``join()`` writes ``{namespace}/alive/{rank}`` as an ephemeral key. Every gather
watches the other ranks' liveness keys, so when a peer's session ends the wait fails at once
with ``PeerLostError(ranks=(r,))`` naming that rank.

Cleanup without growth: on a store with the atomic ``exchange`` extension (the TCP store and
``MemoryStore``), a call is one round trip — delete my key of the previous call, set my key of
this call, gather — and since each rank's key and gather arrive together, once a rank has seen
call ``s-1`` complete every rank's gather of it has completed, so deleting ``s-1`` keys at call
``s`` is safe. On a plain ``Store`` a call is set + gather, and a rank deletes its key of call
``s-1`` only after call ``s`` completes (every rank has then *entered* ``s``, so finished
``s-1``); deleting on completion of ``s-1`` would race with a rank that has written its key but
not yet sent its gather. Either way at most two calls' keys per group are in the store.

Broadcast is an all-gather where only the root contributes bytes: it costs the same single
round trip, synchronizes like the other collectives, and cleans up the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, TypeVar

import msgspec

from m2n_async._proto.errors import LocalProtocolError, PeerLostError, RemoteProtocolError
from m2n_async._store._api import Store, SupportsExchange

__all__ = ["ControlGroup", "drop_departed", "gather_past_departures"]

T = TypeVar("T")
_ALIVE: Final[str] = "alive"
#: The recorded view of an ``all_gather_open`` call, under its prefix beside the ranks' keys.
_VIEW: Final[str] = "view"
_encoder = msgspec.msgpack.Encoder()
_view_decoder = msgspec.msgpack.Decoder(dict[int, bytes])


async def drop_departed(store: Store, exc: PeerLostError, watch: list[str],
                        contribution: Mapping[str, str]) -> bool:
    """Whether the peer whose loss raised ``exc`` had already contributed; if so its liveness
    key is removed from ``watch`` (the caller goes on waiting without it).

    A watched liveness key whose session ended only means a wait cannot complete if its owner
    never wrote its contribution (``contribution[liveness key]``). An owner that did and then
    left — its own deadline fired first because it started earlier, or its process finished —
    is not why the others wait: blaming it would give them a different diagnosis from the
    ranks that time out on the one really missing. The caller's cancel scope still bounds the
    wait that goes on.

    Cancellation: a read-only query; safe to cancel.
    """
    key = exc.key
    if key is None or key not in watch or key not in contribution:
        return False
    if await store.get(contribution[key]) is None:
        return False
    watch.remove(key)
    return True


async def gather_past_departures(store: Store, exc: PeerLostError, prefix: str, n: int,
                                  watch: list[str], contribution: Mapping[str, str]
                                  ) -> dict[str, bytes]:
    """Finish ``gather(prefix, n, watch=watch)`` after it raised ``exc``, past peers that
    already contributed (``drop_departed``); raises the ``PeerLostError`` of the first lost
    peer that had not. ``watch`` is updated in place.

    Cancellation: as ``Store.gather`` (read-only).
    """
    while True:
        if not await drop_departed(store, exc, watch, contribution):
            raise exc
        try:
            return await store.gather(prefix, n, watch=tuple(watch))
        except PeerLostError as again:
            exc = again


class ControlGroup:
    """Collectives among ranks ``0 .. world_size-1`` under ``namespace`` of ``store``."""

    def __init__(self, store: Store, rank: int, world_size: int, namespace: str) -> None:
        if world_size < 1:
            raise ValueError(f"ControlGroup world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"ControlGroup rank must be in [0, {world_size}), got {rank}")
        if not namespace or namespace.endswith("/"):
            raise ValueError(f"ControlGroup namespace must be non-empty without a trailing "
                             f"'/', got {namespace!r}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self._seq = 0
        self._current: str | None = None  # prefix of the current or last call
        self._current_kind = ""
        # This rank's keys of its last two calls, newest last. A call deletes the older one:
        # see ``_collective`` for why not the newer.
        self._own_keys: list[str] = []
        self._watch: tuple[str, ...] = tuple(
            self.alive_key(r) for r in range(world_size) if r != rank)

    @property
    def alive_prefix(self) -> str:
        """The prefix of every rank's liveness key: ``gather(alive_prefix, 0)`` lists who is
        still in the group."""
        return f"{self.namespace}/{_ALIVE}/"

    def alive_key(self, rank: int) -> str:
        """The liveness key of ``rank`` (ephemeral; written by ``join``)."""
        return f"{self.alive_prefix}{rank}"

    @property
    def calls(self) -> int:
        """Collective calls started by this rank so far."""
        return self._seq

    async def join(self) -> None:
        """Announce this rank as alive (an ephemeral key that vanishes with the session).

        Cancellation: the key may or may not have been written; calling again is harmless.
        """
        await self.store.set(self.alive_key(self.rank), str(self.rank).encode(),
                             ephemeral=True)

    async def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, indexed by rank.

        Raises ``PeerLostError(ranks=(r,))`` if rank r's session ends before r contributed;
        a rank that contributed and then left does not fail the call.

        Cancellation: this rank's contribution may already be visible to the others, and the
        group's call sequence has advanced: a group whose call was cancelled is out of step with
        its peers and must be replaced (new namespace or generation), not reused.
        """
        return await self._collective("all_gather", bytes(payload))

    async def all_gather_open(self, payload: bytes,
                              settled: Callable[[Mapping[int, bytes]], bool]
                              ) -> dict[int, bytes]:
        """An all-gather whose contributions say when it is complete: the contributions by
        key index, indices beyond ``world_size`` included, once ``settled(view)`` holds —
        the same view on every rank.

        For a call that agrees on the group itself (the handshake's ``hello``): a rank
        started with another world size gathers a different number of keys from its peers,
        so the count it was given cannot say when it has them all. The first round trip is
        the ordinary call's (``world_size`` keys); while the view is not settled it waits for
        one more key. The first rank whose view settles records that view (first writer
        wins, under the call's prefix as ``view``), and every rank returns the recorded one:
        ranks that raced a key landing late (a stray rank, one of another world) still
        decide on the same contributions. The recording rank then rings the call's bell (a
        key beside the prefix, tombstoned), which every such gather watches: a rank still
        waiting for keys that never come (its world is too big), or one that posts after
        the decision, reads the record at once.

        Raises ``PeerLostError`` as ``all_gather_bytes`` does; ``RemoteProtocolError`` for a
        record that does not decode.

        Cancellation: as for ``all_gather_bytes``. A rank cancelled after it recorded its
        view leaves the record, and the peers that see it decide on it; if the bell was not
        rung, a rank waiting for keys that never come waits on in its own cancel scope.
        """
        seq = self._seq
        kind = "all_gather"
        prefix = f"{self.namespace}/c/{seq}/{kind}/"
        record = f"{prefix}{_VIEW}"
        bell = f"{self.namespace}/c/{seq}/bell"  # beside the prefix: gathers count under it
        watch = [*self._watch, bell]
        owner = {self.alive_key(r): f"{prefix}{r}" for r in range(self.world_size)}
        store = self.store

        async def lost(exc: PeerLostError) -> dict[str, bytes]:
            # The bell: a rank decided (maybe long ago: it stays tombstoned), so the record
            # is there. Otherwise a peer's session ended; one that contributed is no reason
            # to fail (``drop_departed``).
            if exc.key == bell:
                watch.remove(bell)
            elif not await drop_departed(store, exc, watch, owner):
                raise self._peer_lost(exc, kind, seq) from None
            return await store.gather(prefix, 0)

        try:
            _, items = await self._post(kind, payload, tuple(watch))
        except PeerLostError as exc:
            items = await lost(exc)
        while True:
            recorded = items.pop(record, None)
            if recorded is not None:
                return self._recorded_view(recorded, record)
            view = {self._index_of(key, prefix): value for key, value in items.items()}
            if settled(view):
                swapped, current = await store.compare_set(record, None,
                                                           _encoder.encode(view))
                if not swapped and current is not None:
                    return self._recorded_view(current, record)
                # Wake the ranks still waiting (for keys that may never come), and, as a
                # tombstone, any rank that posts later: both then read the record.
                await store.set(bell, b"", ephemeral=True)
                await store.delete(bell, lost=True)
                return view
            try:
                items = await store.gather(prefix, len(items) + 1, watch=tuple(watch))
            except PeerLostError as exc:
                items = await lost(exc)

    def _recorded_view(self, data: bytes, key: str) -> dict[int, bytes]:
        try:
            return dict(sorted(_view_decoder.decode(data).items()))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RemoteProtocolError(f"group {self.namespace!r}: the recorded view {key!r} "
                                      f"does not decode: {exc}") from None

    async def all_gather(self, envelope: T, type_: type[T]) -> list[T]:
        """Every rank's ``envelope`` (a msgspec-encodable value), decoded as ``type_``.

        Raises ``RemoteProtocolError`` naming the rank whose envelope does not decode.

        Cancellation: as for ``all_gather_bytes``.
        """
        raw = await self._collective("all_gather", _encoder.encode(envelope))
        decoder = msgspec.msgpack.Decoder(type_)
        return [self._decode(decoder, r, data, "all_gather") for r, data in enumerate(raw)]

    async def broadcast(self, envelope: T | None, type_: type[T], root: int) -> T:
        """``root``'s ``envelope`` on every rank (others pass ``None``); decoded as ``type_``.

        Cancellation: as for ``all_gather_bytes``.
        """
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast root must be in [0, {self.world_size}), got {root}")
        if self.rank == root and envelope is None:
            raise LocalProtocolError(f"broadcast in group {self.namespace!r}: root rank {root} "
                                     "passed no envelope")
        payload = _encoder.encode(envelope) if self.rank == root else b""
        raw = await self._collective(f"broadcast{root}", payload)
        return self._decode(msgspec.msgpack.Decoder(type_), root, raw[root], "broadcast")

    async def barrier(self) -> None:
        """Return once every rank has entered the barrier.

        Cancellation: as for ``all_gather_bytes``.
        """
        await self._collective("barrier", b"")

    async def missing_ranks(self) -> list[int]:
        """Ranks that have not arrived at the current (or last) call — for timeout messages.

        Cancellation: a read-only query; safe to cancel.
        """
        if self._current is None:  # no call yet: nobody is missing from one
            return []
        arrived = await self.arrived()
        return [r for r in range(self.world_size) if r not in arrived]

    async def arrived(self) -> dict[int, bytes]:
        """The contributions posted to the current (or last) call so far, by key index
        (indices beyond ``world_size`` included, as ``all_gather_open`` sees them; its
        recorded view left out) — for timeout messages that read what the peers said.

        Cancellation: a read-only query; safe to cancel.
        """
        if self._current is None:
            return {}
        present = await self.store.gather(self._current, 0)
        return {self._index_of(key, self._current): value for key, value in present.items()
                if key != f"{self._current}{_VIEW}"}

    async def aclose(self, *, lost: bool = False) -> None:
        """Remove this rank's keys (its last calls' keys and its liveness key).

        By default leaving is clean: peers waiting on this rank are not told it was lost.
        ``lost=True`` (a rank that failed and gives up) removes the liveness key as a dead
        session would: peers waiting on this rank get ``PeerLostError`` at once instead of
        sitting out their deadline; its call keys stay, as a dead rank's would.

        Cancellation: some keys may remain; the generation purge removes them eventually.
        """
        # Leaving as lost keeps this rank's contributions: a peer still in a call this rank
        # contributed to must be able to see that it did (``drop_departed``), or it would
        # blame this rank for that call too. The generation's purge removes them.
        while self._own_keys and not lost:
            await self.store.delete(self._own_keys[0])
            del self._own_keys[0]
        await self.store.delete(self.alive_key(self.rank), lost=lost)

    # --- machinery -----------------------------------------------------------------------

    async def _collective(self, kind: str, payload: bytes) -> list[bytes]:
        seq = self._seq
        prefix, items = await self._post(kind, payload, self._watch)
        out: list[bytes | None] = [None] * self.world_size
        for key, value in items.items():
            out[self._rank_of(key, prefix)] = value
        missing = [r for r, v in enumerate(out) if v is None]
        if missing or len(items) != self.world_size:
            raise RemoteProtocolError(
                f"{kind} call {seq} in group {self.namespace!r}: expected one key per rank "
                f"0..{self.world_size - 1}, got {sorted(items)}")
        return [v for v in out if v is not None]

    async def _post(self, kind: str, payload: bytes, watch: tuple[str, ...]
                    ) -> tuple[str, dict[str, bytes]]:
        """Start a call: this rank's key in, ``world_size`` keys out, past departed peers
        when ``watch`` is the group's own (any other caller handles ``PeerLostError``)."""
        seq = self._seq
        self._seq += 1
        prefix = f"{self.namespace}/c/{seq}/{kind}/"
        self._current, self._current_kind = prefix, kind
        own_key = f"{prefix}{self.rank}"
        store = self.store
        # This rank's key of call seq-2, not seq-1. Being in call seq proves only that every
        # rank *contributed* to seq-1; a rank still finishing seq-1 past a departed peer
        # (``_wait_past_departures``) registers a fresh gather of seq-1, which must still find
        # every key. Every rank has finished seq-2, since it contributed to seq-1 after it.
        stale = self._own_keys[0] if len(self._own_keys) >= 2 else None
        self._own_keys.append(own_key)  # from here on it may exist: ``aclose`` removes it
        try:
            if isinstance(store, SupportsExchange):
                items = await store.exchange(own_key, payload, prefix, self.world_size,
                                             watch=watch, delete=stale)
            else:
                await store.set(own_key, payload)
                items = await store.gather(prefix, self.world_size, watch=watch)
                if stale is not None:
                    await store.delete(stale)
        except PeerLostError as exc:
            if stale is not None:  # the failed exchange may or may not have deleted it
                await store.delete(stale)
                self._own_keys.remove(stale)
            if watch is not self._watch:
                raise  # ``all_gather_open`` waits past departures itself (any index)
            items = await self._wait_past_departures(exc, prefix, kind, seq)
            return prefix, items
        if stale is not None:
            self._own_keys.remove(stale)
        return prefix, items

    async def _wait_past_departures(self, exc: PeerLostError, prefix: str, kind: str,
                                    seq: int) -> dict[str, bytes]:
        # Blaming a rank that contributed and then left would give this rank a different
        # diagnosis (PeerLostError naming a rank that arrived) from its peers (TimeoutError
        # naming the rank that did not): see ``gather_past_departures``.
        watch = list(self._watch)
        owner = {self.alive_key(r): f"{prefix}{r}" for r in range(self.world_size)}
        try:
            return await gather_past_departures(self.store, exc, prefix, self.world_size,
                                                watch, owner)
        except PeerLostError as lost:
            raise self._peer_lost(lost, kind, seq) from None

    def lost_rank(self, exc: PeerLostError) -> int | None:
        """The rank ``exc`` is about: its first named rank, else the rank whose liveness key
        (``alive_key``) it names; None when it names neither."""
        if exc.ranks:
            return exc.ranks[0]
        key = exc.key or ""
        head = self.alive_prefix
        if key.startswith(head) and key[len(head):].isdigit():
            return int(key[len(head):])
        return None

    def _rank_of(self, key: str, prefix: str) -> int:
        index = self._index_of(key, prefix)
        if index < self.world_size:
            return index
        raise RemoteProtocolError(f"group {self.namespace!r}: foreign key {key!r} under a "
                                  f"collective's prefix")

    def _index_of(self, key: str, prefix: str) -> int:
        # Any index, even beyond this group's world: ``all_gather_open`` hands those on.
        suffix = key[len(prefix):]
        if suffix.isascii() and suffix.isdigit():
            return int(suffix)
        raise RemoteProtocolError(f"group {self.namespace!r}: foreign key {key!r} under a "
                                  f"collective's prefix")

    def _peer_lost(self, exc: PeerLostError, kind: str, seq: int) -> PeerLostError:
        lost = self.lost_rank(exc)
        ranks: Sequence[int] = () if lost is None else (lost,)
        key = exc.key or ""
        who = f"rank {ranks[0]}" if ranks else f"the owner of {key!r}"
        return PeerLostError(
            f"{kind} call {seq} in group {self.namespace!r} (rank {self.rank} of "
            f"{self.world_size}): {who} was lost — its liveness key vanished when its session "
            "ended", ranks=tuple(ranks), key=exc.key)

    def _decode(self, decoder: msgspec.msgpack.Decoder[T], rank: int, data: bytes,
                kind: str) -> T:
        try:
            return decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RemoteProtocolError(
                f"{kind} in group {self.namespace!r}: rank {rank}'s envelope is invalid: {exc}"
            ) from None
