"""The round driver: runs one rank's side of a round over the store (DESIGN §6).

Theory of operation: the I/O loop around the sans-IO ``_proto.round.Round``, the way
``_preflight`` drives the handshake. The core decides; this module waits, reads and writes.

``wait_start``: a gather of one key under the round's prefix returns as soon as either
trainer rank 0's ``start`` or an ``abort`` record exists (watching every peer's liveness), so a
rank waiting for a round hears of a failure that happened while it waited — a peer lost, a
trainer that gave up on rank 0 — and raises the same ``TransferError`` as the ranks that were
in the round. A wait its caller cancels is followed by ``cancelled_waiting``: one bounded read
of the round's keys, after which a round that had started gets the cancel as its ``abort``
record (the core's ``Round.cancelled_waiting`` decides).

``run``, in two parts, next to one watchdog task:

1. *The rank's part* (the bucket pipeline), under the round deadline and the caller's cancel
   scope. The watchdog waits for the round's ``abort`` record, a peer's loss (its liveness
   key's tombstone, past the departure rule) or, polled every second, a peer that left
   cleanly without reporting; when one comes it aborts the transport at once, so that this
   rank, blocked in the data plane, returns. A rank whose own step fails writes the ``abort``
   record *before* it aborts its transport: a peer that sees the connection close then finds
   the cause already there.
2. *The outcome* (shielded, bounded by the deadline plus ``REPORT_WINDOW_S``): the rank
   writes its ``RoundDone`` by compare-and-set and gathers everybody's. Every ok → commit.
   Otherwise the failure is the ``abort`` record, once every missing report is written
   ``aborted`` (compare-and-set: a report that lands first is judged instead, so no rank can
   commit while another fails); if none came by the deadline, the core's
   deadline verdict names the rank without a report (or the one waited on), this rank writes
   that rank's ``done`` as ``late`` and the ``abort`` record (both compare-and-set), and reads
   back whichever record won.

A third task beside them, the loop probe (``_LoopProbe``), sleeps a short period in a loop
and sums how late it wakes: how long the event loop was not available to the engine during
the round (``SyncResult.loop_stall_seconds``; a GIL-heavy or blocking task of the caller's in
the same process shows there).

Failure translation at this boundary: everything a caller sees from a round is the core's
``TransferError`` (its ``rank`` the cause, its ``cause`` which); a ``StoreError`` from any
request means the store was lost (``cause="store"``, ``rank=None``), a
``StaleGenerationError`` that trainer rank 0 opened a newer generation (``"superseded"``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import anyio

from m2n_async._data._transport import Transport
from m2n_async._engine import _faults
from m2n_async._engine._pipeline import PipelineStats, unwrap_group
from m2n_async._proto.errors import M2NError, PeerLostError, TransferError
from m2n_async._proto.messages import RoundDone, RoundStart, decode_as, encode
from m2n_async._proto.round import (
    REPORT_WINDOW_S,
    Cause,
    Failure,
    Judgement,
    Round,
    Status,
)
from m2n_async._store import ControlGroup, StaleGenerationError, Store, drop_departed

__all__ = ["NOTE_CHARS", "JobEnded", "RoundDriver", "RoundOutcome"]

log = logging.getLogger("m2n_async")

#: Rounds whose keys stay in the store: round k's start deletes round k - 3's (``_forget``).
_KEEP_ROUNDS = 3
#: How often the watchdog looks for peers that left the job cleanly (a clean leave wakes no
#: waiter, so it is polled: two store reads per rank per interval).
_LEFT_POLL_S = 1.0
#: The most of an error's text a rank that closes on it leaves for its peers (a note, a
#: closing start): enough for a message, small beside the store's limits.
NOTE_CHARS = 2000
#: How long a rank whose data plane failed without naming a peer asks the store whether a
#: peer died or recorded a failure first (a tombstone follows a killed peer within moments).
_ATTRIBUTE_S = 1.0
#: While it waits for a cause, how often a rank whose data plane failed looks for a peer
#: that left cleanly (two store reads each time, on a failing round only).
_LEFT_RECHECK_S = 0.1


#: The loop probe's period: one wake-up per period per round, a few microseconds of the loop
#: each (well under 1% of a core), short enough that a stall is caught within 10 ms of it.
_PROBE_PERIOD_S = 0.01
#: Lateness of one wake-up up to this is the timer's and the scheduler's jitter (libuv rounds
#: timers to whole milliseconds; a busy host adds some), not a stall: it is not counted.
_PROBE_SLACK_S = 0.002


class JobEnded(Exception):
    """Raised by ``wait_start``: no more rounds in this generation (trainer rank 0 closed
    the job, or opened a newer generation). Not a failure, unless ``error`` is set: rank 0
    closed on that error (its closing start says so). The engine translates it."""

    def __init__(self, why: str, error: str | None = None) -> None:
        self.why = why
        self.error = error
        super().__init__(why)


@dataclass(frozen=True)
class RoundOutcome:
    """A committed round: the pipeline's stats and how long the outcome took."""

    stats: PipelineStats
    pipeline_seconds: float
    commit_seconds: float
    #: seconds the event loop was not available to the engine during the round (``_LoopProbe``)
    loop_stall_seconds: float = 0.0


class _Watchdog:
    """Waits for the round's first failure signal; aborts the transport and cancels
    whatever part of the round is waiting (``target``)."""

    def __init__(self, driver: RoundDriver, core: Round, transport: Transport) -> None:
        self.driver = driver
        self.core = core
        self.transport = transport
        self.failure: Failure | None = None
        self.target: anyio.CancelScope | None = None
        self._scope = anyio.CancelScope(shield=True)  # outlives a caller's cancel: stop()

    def stop(self) -> None:
        self._scope.cancel()

    async def run(self) -> None:
        with self._scope:
            failure = await self._watch()
            self.failure = failure
            self.transport.abort(f"{self.core.where} failed: rank {failure.rank}: "
                                 f"{failure.reason}")
            if self.target is not None:
                self.target.cancel()

    async def _watch(self) -> Failure:
        d, core = self.driver, self.core
        watch = list(d.watch)
        try:
            while True:
                raw: bytes | None = None
                with anyio.move_on_after(_LEFT_POLL_S):  # then look for leavers
                    while True:
                        try:
                            raw = await d.store.get(core.keys.abort, wait=True, watch=watch)
                            break
                        except PeerLostError as exc:
                            # Departure rule: a rank that reported and then died is not
                            # this round's problem (its part moved; the next round names it).
                            if not await drop_departed(d.store, exc, watch, d.done_keys(core)):
                                raise
                if raw is not None:
                    return core.failure_of(raw)
                left = await d.left_ranks(core)
                if left:
                    return await d.post(core, await d.left_failure(core, left[0]))
        except PeerLostError as exc:
            lost = d.group.lost_rank(exc)
            if lost is None:
                return core.store_lost()
            return await d.post(core, core.lost(lost))
        except StaleGenerationError as exc:
            return core.superseded(exc.current)
        except M2NError:
            return core.store_lost()


class _LoopProbe:
    """How long the event loop was not available during a round: a sleep of
    ``_PROBE_PERIOD_S`` in a loop, each wake-up's lateness beyond ``_PROBE_SLACK_S`` summed in
    ``stalled`` (seconds). A wake-up is late when the loop was blocked (a synchronous call in
    some task, the GIL held by another thread) at the moment it was due, so the sum is about
    the time the engine's own steps could not run. Stopped by ``stop``."""

    def __init__(self) -> None:
        self.stalled = 0.0
        self._scope = anyio.CancelScope()
        # From now, not from the task's first step: a block before that step counts too.
        self._due = anyio.current_time() + _PROBE_PERIOD_S

    def stop(self) -> None:
        self._scope.cancel()

    def _count(self, late: float) -> None:
        if late > _PROBE_SLACK_S:
            self.stalled += late

    async def run(self) -> None:
        with self._scope:
            due = self._due
            try:
                while True:
                    await anyio.sleep_until(due)
                    now = anyio.current_time()
                    self._count(now - due)
                    due = now + _PROBE_PERIOD_S
            finally:
                # The wake-up that the stop cut short: a block that ran into the round's end
                # is late already (not late: a negative figure, not counted).
                self._count(anyio.current_time() - due)


class RoundDriver:
    """One engine's round I/O; a fresh ``Round`` core per round."""

    def __init__(self, *, store: Store, group: ControlGroup, namespace: str, generation: int,
                 rank: int, world_size: int, trainer_ranks: int, abort_grace: float) -> None:
        self.store = store
        self.group = group
        self.namespace = namespace
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.trainer_ranks = trainer_ranks
        self.abort_grace = abort_grace
        self.watch: tuple[str, ...] = tuple(group.alive_key(r) for r in range(world_size)
                                            if r != rank)

    def core(self, round_: int) -> Round:
        return Round(namespace=self.namespace, generation=self.generation, round=round_,
                     rank=self.rank, world_size=self.world_size,
                     trainer_ranks=self.trainer_ranks)

    @property
    def window(self) -> float:
        return min(REPORT_WINDOW_S, self.abort_grace)

    # -- the start -------------------------------------------------------------------------

    async def publish_start(self, start: RoundStart) -> None:
        """Trainer rank 0 opens the round: one compare-and-set of its ``start`` key (bounded
        by its deadline, at least ``abort_grace``), so the key holds one record for good and
        every rank reads the same start. Raises the round's ``TransferError`` if the store
        fails, or if the key was written already (``Round.start_taken``): by this engine's
        ``close()`` (the job's closing start; no rank runs the round, nothing is recorded) or
        by another process (a protocol failure naming rank 0, recorded, so that the ranks
        that read that start raise the same error).

        Cancellation: the caller shields it (a round that may have started must be aborted,
        not forgotten)."""
        core = self.core(start.round)
        record = encode(start)
        try:
            # At least abort_grace: a deadline shorter than one store request (a tiny
            # timeout=) must fail the round at its deadline, on every rank, not here as a
            # store loss that no peer hears of.
            with anyio.fail_after(max(start.round_timeout, self.abort_grace)):
                swapped, current = await self.store.compare_set(core.keys.start, None, record)
        except StaleGenerationError as exc:
            raise core.error(core.superseded(exc.current)) from exc
        except (TimeoutError, M2NError) as exc:
            raise core.error(core.store_lost()) from exc
        if swapped or current == record:  # the same record: what every rank reads is ours
            return
        failure, record_it = core.start_taken(current)
        if record_it:
            with anyio.CancelScope(shield=True):
                failure = await self.post(core, failure)
        raise core.error(failure)

    async def wait_start(self, round_: int, *, limit: float | None,
                         missed_is_failure: bool) -> RoundStart:
        """The round's ``RoundStart``, once trainer rank 0 wrote it.

        Raises ``JobEnded`` when rank 0 closed the job or opened a newer generation; the
        round's ``TransferError`` when an ``abort`` record for it appeared, a peer was lost
        while waiting (this rank writes the record: the round cannot happen), the store was
        lost, or rank 0's start was malformed; ``TimeoutError`` after ``limit`` seconds, or
        — ``missed_is_failure`` (a trainer: the round cannot happen without it) — the
        round's ``TransferError`` naming rank 0, recorded for every rank.

        Cancellation: nothing was written; the caller, if its own caller cancelled it
        (not its ``close()``), asks ``cancelled_waiting`` whether the round had started.
        """
        core = self.core(round_)
        keys = core.keys
        watch = list(self.watch)
        try:
            with anyio.fail_after(limit) if limit is not None else _no_deadline():
                got: dict[str, bytes] = {}
                while keys.start not in got and keys.abort not in got:
                    got = await self.store.gather(keys.prefix, len(got) + 1, watch=watch)
        except TimeoutError:
            if not missed_is_failure:
                raise
            assert limit is not None
            with anyio.CancelScope(shield=True):
                refusal = (await self.refusals(core, (0,))).get(0)
                failure = await self.post(core, core.start_missed(limit, refusal))
            raise core.error(failure) from None
        except PeerLostError as exc:
            lost = self.group.lost_rank(exc)
            with anyio.CancelScope(shield=True):
                failure = await self.post(core, core.lost(lost) if lost is not None
                                          else core.store_lost())
            raise core.error(failure) from None
        except StaleGenerationError as exc:
            raise JobEnded(f"trainer rank 0 opened generation {exc.current} of the job; "
                           f"generation {self.generation} has no more rounds") from None
        except M2NError as exc:
            raise core.error(core.store_lost()) from exc
        if keys.abort in got:
            raise core.error(core.failure_of(got[keys.abort]))
        start = core.read_start(got[keys.start])
        if isinstance(start, Failure):
            with anyio.CancelScope(shield=True):  # so that rank 0 does not wait it out
                bad = await self.post(core, start)
            raise core.error(bad)
        if start.closing:
            how = "" if start.error is None else f" on an error ({start.error})"
            raise JobEnded(f"trainer rank 0 closed the job{how} after round {round_ - 1} of "
                           f"generation {self.generation}", error=start.error)
        return start

    async def cancelled_waiting(self, round_: int) -> Failure | None:
        """The caller's cancel ended this rank's ``wait_start`` of ``round_``: one read of
        the round's keys (bounded by ``abort_grace``), and ``Round.cancelled_waiting``
        decides. A round that had started (or failed): the cancel is posted as the round's
        abort record, compare-and-set, as a cancel in the round is, and the record that won
        is returned (the engine is poisoned with it). None: the round started nowhere yet
        (nothing posted; the engine stays as it was), or the job ended in this generation
        (the next call says so). A store that fails or does not answer within the bound: a
        store loss (this rank cannot tell whether its peers are in the round without it).

        Cancellation: the caller shields it."""
        core = self.core(round_)
        try:
            with anyio.fail_after(self.abort_grace):
                found = await self.store.gather(core.keys.prefix, 0)
        except StaleGenerationError:
            return None
        except (TimeoutError, M2NError) as exc:
            log.warning("rank %d could not tell whether %s had started when its wait was "
                        "cancelled: %r", self.rank, core.where, exc)
            return core.store_lost()
        failure = core.cancelled_waiting(found)
        return None if failure is None else await self.post(core, failure)

    # -- the round -----------------------------------------------------------------------

    async def run(self, start: RoundStart, transport: Transport,
                  work: Callable[[], Awaitable[PipelineStats]],
                  on_commit: Callable[[RoundStart], None],
                  on_poison: Callable[[BaseException], None]) -> RoundOutcome:
        """This rank's part of the round and its outcome (module docstring).

        Once every rank reported ok, calls ``on_commit(start)`` (shielded) and returns.
        Otherwise calls ``on_poison`` with the round's ``TransferError`` — the same on every
        rank — and raises it.

        Cancellation: during this rank's part, the round's abort record names this rank
        (cause ``cancelled``), the transport is aborted, ``on_poison`` gets the round's error,
        and the cancellation propagates. Once this rank's part is done, the outcome is
        gathered and committed (or poisoned) shielded, bounded, so the round ends here as on
        every other rank; the cancel takes effect after.
        """
        core = self.core(start.round)
        timeout = start.round_timeout
        deadline = anyio.current_time() + timeout
        transport.begin_round(start.round, time.monotonic() + timeout)
        dog = _Watchdog(self, core, transport)
        probe = _LoopProbe()
        t0 = time.perf_counter()
        decided = False
        verdict: Failure | None = None
        err: TransferError | None = None
        local: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(dog.run)
                tg.start_soon(probe.run)
                if self.rank == 0 and start.round > _KEEP_ROUNDS:
                    # Beside the transfer, not after the commit: its round trip would be a
                    # fixed cost of every round on the caller's critical path.
                    tg.start_soon(self._forget, start.round - _KEEP_ROUNDS)
                try:
                    status, stats, failure, suspects, local = await self._part(
                        core, dog, transport, work, deadline)
                    pipeline_s = time.perf_counter() - t0
                    t_commit = time.perf_counter()
                    with anyio.CancelScope(shield=True):
                        verdict = await self._outcome(core, dog, status, stats, failure,
                                                      suspects, local, pipeline_s, deadline,
                                                      timeout)
                        decided = True
                        transport.end_round()
                        if verdict is None:
                            on_commit(start)
                            if _faults.armed:  # tests only: the world records commits
                                _faults.hit_now("round.commit", rank=self.group.rank,
                                                round=start.round, version=start.version)
                        else:
                            err = core.error(verdict)
                            on_poison(err)
                finally:
                    dog.stop()
                    probe.stop()
        except anyio.get_cancelled_exc_class():
            if not decided:
                with anyio.CancelScope(shield=True):
                    # The record that won: this cancel, or a failure recorded just before.
                    failure = await self.post(core, core.cancelled())
                    transport.abort(failure.reason)
                    on_poison(core.error(failure))
            raise
        if verdict is None:
            assert stats is not None
            return RoundOutcome(stats, pipeline_s, time.perf_counter() - t_commit,
                                probe.stalled)
        assert err is not None
        if local is not None:
            raise err from local
        raise err

    async def _part(self, core: Round, dog: _Watchdog, transport: Transport,
                    work: Callable[[], Awaitable[PipelineStats]], deadline: float
                    ) -> tuple[Status, PipelineStats | None, Failure | None, Sequence[int],
                               BaseException | None]:
        """Step 1: the pipeline. (status, stats, known failure, suspects, local exception)."""
        local: BaseException | None = None
        stats: PipelineStats | None = None
        try:
            with anyio.CancelScope() as scope:
                dog.target = scope
                with anyio.fail_after(max(deadline - anyio.current_time(), 0.0)):
                    if _faults.armed:  # tests only (m2n_async.testing)
                        await _faults.hit("round.start", rank=self.group.rank,
                                          round=core.round)
                    stats = await work()
        except BaseExceptionGroup as group:
            local = unwrap_group(group)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            local = exc
        finally:
            dog.target = None
        if isinstance(local, anyio.get_cancelled_exc_class()):
            raise local
        if dog.failure is not None:  # the watchdog fired: whatever failed here is a symptom
            return Status.ABORTED, None, dog.failure, (), local
        if local is None:
            if scope.cancelled_caught:  # cancelled by the watchdog just as work ended
                return Status.ABORTED, None, dog.failure, (), None
            return Status.OK, stats, None, (), None
        if isinstance(local, TimeoutError) and not getattr(local, "own_step", False):
            # Who this rank still waited on, when the transport can tell: the votes that
            # name a hung peer when every rank reports.
            return Status.DEADLINE, None, None, transport.waiting_on(), local
        peer = getattr(local, "peer", None)
        if isinstance(peer, int) or transport.aborted:
            # The data plane saw a peer close its connection (it died, left or aborted): a
            # symptom. A peer that left is looked for before this rank aborts (its own abort
            # makes its peers' ops fail too, and they must find the cause recorded).
            with anyio.CancelScope(shield=True):
                await self._find_cause(core, within=0.0)
            transport.abort(f"{core.where}: {local}")
            return (Status.ABORTED, None, None,
                    (peer,) if isinstance(peer, int) else transport.waiting_on(), local)
        if isinstance(local, TransferError) and not getattr(local, "own_step", False):
            # A data-plane failure names no peer, yet a peer's death or abort is its usual
            # reason: the store says so within moments (a tombstone, a record), and then this
            # is a symptom, not this rank's failure. A load callback's error (``own_step``,
            # set by the lanes) is this rank's: its bytes had arrived, so no wait for one.
            with anyio.CancelScope(shield=True):
                cause = await self._find_cause(core, within=min(_ATTRIBUTE_S,
                                                                 self.abort_grace))
            if cause is not None:
                transport.abort(f"{core.where} failed: rank {cause.rank}: {cause.reason}")
                return Status.ABORTED, None, cause, transport.waiting_on(), local
        # This rank's own step failed: the record goes first, so that a peer that sees the
        # connection close finds the cause in the store, then the data plane stops.
        failure = core.own_error(local)
        with anyio.CancelScope(shield=True):
            failure = await self.post(core, failure)
        transport.abort(f"{core.where} failed: rank {failure.rank}: {failure.reason}")
        return Status.FAILED, None, failure, (), local

    async def _find_cause(self, core: Round, *, within: float) -> Failure | None:
        """A cause the store knows of now: a peer that left without reporting (recorded
        here), the round's abort record, or — waiting up to ``within`` — a peer's loss
        (recorded here), a record, or a peer that left (looked for every
        ``_LEFT_RECHECK_S``). None if there is none (or the store failed)."""
        try:
            left = await self.left_ranks(core)
            if left:
                return await self.post(core, await self.left_failure(core, left[0]))
            watch = list(self.watch)
            with anyio.move_on_after(within):
                while True:
                    # A clean leave wakes no waiter, and a leaving engine closes its data
                    # plane before its liveness key goes: its peers' sends may fail first.
                    # So the wait is cut into slices, the leavers looked for after each.
                    with anyio.move_on_after(_LEFT_RECHECK_S):
                        try:
                            raw = await self.store.get(core.keys.abort, wait=within > 0,
                                                       watch=watch)
                        except PeerLostError as exc:
                            if await drop_departed(self.store, exc, watch,
                                                   self.done_keys(core)):
                                continue
                            lost = self.group.lost_rank(exc)
                            return (None if lost is None
                                    else await self.post(core, core.lost(lost)))
                        return None if raw is None else core.failure_of(raw)
                    left = await self.left_ranks(core)
                    if left:
                        return await self.post(core, await self.left_failure(core, left[0]))
        except M2NError:
            pass
        return None

    async def _outcome(self, core: Round, dog: _Watchdog, status: Status,
                       stats: PipelineStats | None, failure: Failure | None,
                       suspects: Sequence[int], local: BaseException | None, seconds: float,
                       deadline: float, round_timeout: float) -> Failure | None:
        """Step 2 (shielded by the caller): report, gather, judge. None: commit."""
        error = None if local is None else f"{type(local).__name__}: {local}"
        report = core.report(status, nbytes=stats.nbytes if stats is not None else 0,
                             seconds=seconds, error=error, suspects=suspects)
        if status is Status.DEADLINE:
            # Peers blocked on this rank return now; they report the symptom.
            dog.transport.abort(f"{core.where}: rank {self.rank} reached the round deadline")
        try:
            if status is Status.OK and failure is None:
                swapped, raw = await self._report_ok(core, dog, encode(report), deadline)
                if not swapped:  # a peer wrote this rank late: the record says why
                    return await self._record(core, deadline + self.window)
                return await self._gather_and_judge(core, dog, deadline, round_timeout,
                                                    first=raw)
            swapped = await self._write_report(core, encode(report), deadline)
            if not swapped:  # a peer wrote this rank late: the record says why
                return failure or await self._record(core, deadline + self.window)
            if failure is not None:
                return failure
            if status is not Status.OK and anyio.current_time() < deadline:
                # A symptom: the cause arrives as a record (the watchdog) or at the deadline.
                failure = await self._until(dog, deadline)
                if failure is not None:
                    return failure
            return await self._gather_and_judge(core, dog, deadline, round_timeout)
        except StaleGenerationError as exc:
            return core.superseded(exc.current)
        except (TimeoutError, M2NError):
            # the record that won, when this rank knows it: the peers read that one too
            return failure if failure is not None else core.store_lost()

    async def _write_report(self, core: Round, report: bytes, deadline: float) -> bool:
        """Compare-and-set this rank's report; whether it is the one on the store.

        Bounded by the end of the report window (at least ``abort_grace``), not by
        ``abort_grace`` alone: a reply that comes late (a slow store, this rank paused just
        after sending) is no lost store, and the peers may commit on the report it wrote.
        Past the bound, one read says which report is there: this one, a peer's fence of
        this rank (False: the record decides), or none (``TimeoutError``: the store is
        lost to this rank)."""
        key = core.keys.done(self.rank)
        try:
            with anyio.fail_after(max(deadline + self.window - anyio.current_time(),
                                      self.abort_grace)):
                swapped, _ = await self.store.compare_set(key, None, report)
                return swapped
        except TimeoutError:
            with anyio.fail_after(self.abort_grace):
                current = await self.store.get(key)
            if current is None:
                raise
            return current == report

    async def _until(self, dog: _Watchdog, deadline: float) -> Failure | None:
        """The watchdog's failure, waiting for it until ``deadline``."""
        with anyio.CancelScope(deadline=deadline) as scope:
            dog.target = scope
            try:
                if dog.failure is None:
                    await anyio.sleep_forever()
            finally:
                dog.target = None
        return dog.failure

    async def _report_ok(self, core: Round, dog: _Watchdog, report: bytes, deadline: float
                         ) -> tuple[bool, dict[str, bytes] | None]:
        """Write this rank's ok report (``_write_report``) and
        gather everybody's (until ``deadline``, or the watchdog's failure) with both requests
        in flight at once: the gather does not depend on the write's reply, and a round trip
        less is a fixed cost less in every round. (swapped, the reports; None when the
        gather ended without them)."""
        got: dict[str, bytes] | None = None
        scope = anyio.CancelScope(deadline=deadline)

        async def gather() -> None:
            nonlocal got
            with scope:
                got = await self.store.gather(core.keys.done_prefix, self.world_size)

        dog.target = scope
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(gather)
                swapped = await self._write_report(core, report, deadline)
                if not swapped:  # the gather is moot: a record decides
                    scope.cancel()
        except BaseExceptionGroup as group:
            leaf = unwrap_group(group)
            raise leaf from leaf.__cause__  # keeps the leaf's own cause; hides the group
        finally:
            dog.target = None
        return swapped, got

    async def _gather_and_judge(self, core: Round, dog: _Watchdog, deadline: float,
                                round_timeout: float, *, first: dict[str, bytes] | None = None
                                ) -> Failure | None:
        """Every report by the deadline → judge; else the deadline verdict. ``first``: the
        reports a gather already made (``_report_ok``) returned, if it did."""
        keys = core.keys
        raw: dict[str, bytes] | None = first
        if raw is None:
            with anyio.CancelScope(deadline=deadline) as scope:
                dog.target = scope
                try:
                    if dog.failure is None and anyio.current_time() < deadline:
                        raw = await self.store.gather(keys.done_prefix, self.world_size)
                finally:
                    dog.target = None
        if raw is None and dog.failure is None:
            # The deadline passed: the peers' reports arrive within the window (their
            # deadlines fall within milliseconds of this one), a frozen rank's never.
            with anyio.move_on_after(self.window):
                raw = await self.store.gather(keys.done_prefix, self.world_size)
        if raw is None:
            raw = await self.store.gather(keys.done_prefix, 0)
        for _ in range(self.world_size + 1):  # each pass settles one more rank's report
            reports = core.decode_reports(raw)
            if isinstance(reports, Failure):
                return await self.post(core, reports)
            judged = core.judge(reports)
            if judged is Judgement.COMMIT:
                return None  # every rank reported ok: no record can undo it
            recorded = dog.failure
            if recorded is None:
                ab = await self.store.get(keys.abort)
                recorded = core.failure_of(ab) if ab is not None else None
            if recorded is not None:
                # A record decides only once no missing rank can still report ok: fence
                # each missing report (compare-and-set), as the deadline path fences the
                # late rank. One that reported just now: judge again with its report.
                if judged is Judgement.WAIT and not await self._fence_missing(
                        core, reports, recorded):
                    raw = await self.store.gather(keys.done_prefix, 0)
                    continue
                return recorded
            missing = [r for r in range(self.world_size) if r not in reports]
            verdict = core.deadline_verdict(
                reports, round_timeout, await self.refusals(core, missing) if missing else None)
            culprit = verdict.rank
            if verdict.cause is Cause.DEADLINE and culprit is not None and (
                    culprit not in reports):
                # Fence the late rank: its done key now says late, so a report it writes
                # after resuming cannot complete a set of ok reports.
                swapped, _ = await self.store.compare_set(
                    keys.done(culprit), None, encode(core.late_report(culprit, verdict)))
                if not swapped:  # it reported just now: judge again with its report
                    raw = await self.store.gather(keys.done_prefix, 0)
                    continue
            return await self.post(core, verdict)
        return await self.post(core, core.store_lost())  # reports that keep changing

    async def _fence_missing(self, core: Round, reports: Mapping[int, RoundDone],
                             failure: Failure) -> bool:
        """Write every missing rank's ``done`` as aborted (compare-and-set); False if one of
        them had reported meanwhile."""
        for r in range(self.world_size):
            if r not in reports:
                swapped, _ = await self.store.compare_set(
                    core.keys.done(r), None, encode(core.fenced_report(r, failure)))
                if not swapped:
                    return False
        return True

    async def _record(self, core: Round, until: float) -> Failure:
        """The round's abort record, waiting for it until ``until`` (its writer writes this
        rank's late report first, then the record)."""
        # At least abort_grace: the peer that fenced this rank posts the record right after
        # (one bounded request), however late this rank got here (frozen, a slow store).
        with anyio.move_on_after(max(until - anyio.current_time(), self.abort_grace)):
            raw = await self.store.get(core.keys.abort, wait=True)
            assert raw is not None
            return core.failure_of(raw)
        return Failure(Cause.DEADLINE, self.rank,
                       f"rank {core.named([self.rank])} did not report by the round deadline")

    # -- records ---------------------------------------------------------------------------

    async def post(self, core: Round, failure: Failure) -> Failure:
        """Write ``failure`` as the round's abort record unless one exists; return the one
        that won (first writer wins: every rank reads the same). Bounded by ``abort_grace``;
        a store that fails makes it a store loss."""
        if failure.rank is None:
            return failure
        try:
            with anyio.fail_after(self.abort_grace):
                swapped, current = await self.store.compare_set(
                    core.keys.abort, None, encode(core.abort_record(failure)))
        except StaleGenerationError as exc:
            return core.superseded(exc.current)
        except (TimeoutError, M2NError) as exc:
            log.warning("rank %d could not post the abort of %s: %r", self.rank, core.where,
                        exc)
            return core.store_lost()
        if swapped or current is None:
            return failure
        return core.failure_of(current)

    # -- helpers ---------------------------------------------------------------------------

    def done_keys(self, core: Round) -> dict[str, str]:
        """Each rank's liveness key -> its RoundDone key of this round (departure rule)."""
        return {self.group.alive_key(r): core.keys.done(r) for r in range(self.world_size)}

    async def left_ranks(self, core: Round) -> list[int]:
        """Peers that left cleanly without reporting this round. Two reads."""
        alive_raw = await self.store.gather(self.group.alive_prefix, 0)
        alive = {r for r in range(self.world_size) if self.group.alive_key(r) in alive_raw}
        if len(alive) == self.world_size:
            return []
        reported = await self.store.gather(core.keys.done_prefix, 0)
        done = {r for r in (core.keys.rank_of_done(k) for k in reported) if r is not None}
        return core.left_ranks(alive | {self.rank}, done)

    async def note_refusal(self, round_: int, error: str) -> None:
        """This rank's call to round ``round_`` refused its own arguments before joining it
        (the weights of a trainer other than 0, say): the text is left for the deadline
        verdict its peers reach if no later call joins, so they name the refusal rather
        than a frozen rank. Best effort, bounded; only ever on that refusal's path, and with
        ``error`` empty when a later call of this rank joins the round (no note, then)."""
        with anyio.move_on_after(self.abort_grace):
            try:
                await self.store.set(self.core(round_).keys.refused(self.rank),
                                     error[:NOTE_CHARS].encode(errors="replace"))
            except M2NError as exc:
                log.debug("rank %d could not leave its refusal note: %r", self.rank, exc)

    async def refusals(self, core: Round, ranks: Sequence[int]) -> dict[int, str]:
        """The refusal notes (``note_refusal``) of ``ranks`` in ``core``'s round: one read
        of the round's notes, bounded; empty if the store cannot say."""
        raw: dict[str, bytes] = {}
        with anyio.move_on_after(self.abort_grace):
            try:
                raw = await self.store.gather(core.keys.refused_prefix, 0)
            except M2NError:
                pass
        return {r: raw[k].decode(errors="replace") for r in ranks
                if raw.get(k := core.keys.refused(r))}  # empty: a later call joined

    def gone_key(self, rank: int) -> str:
        """Where ``rank`` leaves the text of the error it closed its engine on."""
        return f"{self.namespace}/gone/{rank}"

    async def note_leaving(self, error: str) -> None:
        """This rank closes its engine on ``error``: the text is left for the ``left``
        failure its peers may post for it (written before its liveness key goes, so a peer
        that sees the key gone finds the note). Best effort, bounded."""
        with anyio.move_on_after(self.abort_grace):
            try:
                await self.store.set(self.gone_key(self.rank),
                                     error[:NOTE_CHARS].encode(errors="replace"))
            except M2NError as exc:
                log.debug("rank %d could not leave its error note: %r", self.rank, exc)

    async def gone_note(self, rank: int) -> str | None:
        """The text ``rank`` left as it closed on an error (``note_leaving``): None if it
        left none or the store could not say (one read)."""
        try:
            raw = await self.store.get(self.gone_key(rank))
        except M2NError:
            return None
        return None if raw is None else raw.decode(errors="replace")

    async def left_failure(self, core: Round, rank: int) -> Failure:
        """``rank`` left without reporting: the ``left`` failure, with the error it closed
        on if it left a note."""
        return core.left(rank, await self.gone_note(rank))

    async def _forget(self, old: int) -> None:
        """Trainer rank 0, as round ``old + _KEEP_ROUNDS`` starts: round ``old``'s keys go, in
        one request. Rank 0 opens a round only after the one before committed, and a commit
        means every rank reported it, so every rank had finished the outcome of the round
        before that and left every earlier one behind. Best effort, bounded."""
        with anyio.move_on_after(self.abort_grace):
            try:
                await self.store.delete_prefix(self.core(old).keys.prefix)
            except M2NError as exc:
                log.debug("round key cleanup failed on rank %d: %r", self.rank, exc)

    async def committed_start(self, round_: int, within: float) -> RoundStart | None:
        """For a ``close()`` during ``round_``, once it posted its record: the round's start
        if every rank reports ok within ``within`` seconds — the round commits all the same
        (no record undoes a set of ok reports), so the closing rank leaves as after it —,
        else None. The record makes every rank's part end promptly, so the reports come
        unless a rank is frozen, and then ``within`` bounds the wait.

        Cancellation: the caller shields it (``close``)."""
        core = self.core(round_)
        with anyio.move_on_after(within):
            try:
                raw = await self.store.gather(core.keys.done_prefix, self.world_size)
                reports = core.decode_reports(raw)
                if isinstance(reports, Failure) or core.judge(reports) is not Judgement.COMMIT:
                    return None
                start = await self.store.get(core.keys.start)
                return None if start is None else decode_as(start, RoundStart)
            except M2NError:  # a store that fails: the round's outcome is not known here
                return None
        return None

    async def close_job(self, round_: int, version: int, round_timeout: float,
                        error: str | None = None) -> bool:
        """Trainer rank 0 tells the ranks waiting for ``round_`` that it will not come: the
        round's closing start, by compare-and-set (``publish_start`` races it for the key
        when ``sync_weights`` runs beside ``close()``). False when a start of ``round_``
        was there first: that round has begun on the ranks that read it, and the caller must
        end it as a close during the round. True otherwise (best effort, bounded: a store
        that fails or is slow leaves nothing else to do).

        ``error``: rank 0 closes on that error; the closing start carries it, and the ranks
        waiting raise it instead of ending as at a clean end of the job.

        Cancellation: the caller shields it; the closing start may or may not be written."""
        from m2n_async._proto.messages import PROTO_VERSION

        closing = RoundStart(PROTO_VERSION, self.generation, round_, version, round_timeout,
                             True, None if error is None else error[:NOTE_CHARS])
        with anyio.move_on_after(self.abort_grace):
            try:
                swapped, current = await self.store.compare_set(
                    self.core(round_).keys.start, None, encode(closing))
            except M2NError:
                return True
            if swapped or current is None:
                return True
            try:
                return decode_as(current, RoundStart).closing
            except M2NError:
                return True  # not a start: no rank runs a round from it
        return True


class _no_deadline:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

