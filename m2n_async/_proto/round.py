"""The round as a pure core: keys, reports, the departure rule and the verdict (DESIGN §6).

Theory of operation. A round lives under ``{job}/{generation}/round/{k}/`` (``RoundKeys``):
trainer rank 0 writes ``start``; every rank writes ``done/{rank}`` (its ``RoundDone``); the
first rank that knows why the round failed writes ``abort`` (an ``Abort``). ``start``,
``done/{r}`` and ``abort`` are all written by compare-and-set, so each holds one value for
good: every rank that reads them reads the same thing, and that is what makes the outcome
one outcome. (``start`` has two writers, rank 0's ``sync_weights`` and its ``close()``, whose
closing start ends the job; whichever lands first is the one every rank reads, and rank 0
raises ``Round.start_taken``'s failure when its round lost.)

- **Commit** iff every rank's ``done`` holds an ``ok`` report (``Round.judge``). Nothing else
  commits a version, and nothing can turn such a set of reports back into a failure.
- **Failure** is whatever the ``abort`` record says (``Round.failure_of``): the first rank to
  write it wins, and it names the rank that *caused* the failure, never a bystander. Only a
  cause is ever written there: a rank's own error, its caller's cancel, a peer lost (its store
  session ended) or left (closed its engine), or, once the round deadline passed, the rank
  that did not report. A *symptom* — a data-plane op failing because a peer aborted, a wait
  timing out — is reported in ``done`` (status ``aborted`` or ``deadline``, with the peers it
  was waiting on as ``suspects``) and never written as the abort record.
- **Departure rule** (``Round.lost_matters``): a rank lost or gone after it reported is not
  the round's problem (its part moved); one that had not reported is the culprit.
- **A cancel while waiting for the start** (``Round.cancelled_waiting``): a rank other than
  trainer rank 0 whose caller cancels its wait looks once at what the round holds. Its start
  there means the round began on the ranks that read it: the cancel is a cancel in the round
  (the record names this rank, ``cancelled``). No start: the round began nowhere and this
  rank declines nothing (its next call may join the round).
- **Deadline** (``Round.deadline_verdict``): at the round deadline a rank posts its own report,
  waits a short window for its peers' reports (their deadlines fall within milliseconds of its
  own), and then blames, in this order: a rank with no report (frozen, hung before reporting,
  or too late; named with the note it left in ``refused/{rank}`` if its own call refused its
  arguments before joining), the rank most of the others were waiting on, a rank stuck in
  its own step.
  Before it writes that verdict it writes the culprit's ``done`` key itself (status ``late``)
  by compare-and-set: a frozen rank that resumes cannot then report ``ok`` and complete a set
  of ok reports after its peers already failed the round.
- **Store loss** has no record (there is no store to hold one): every rank concludes alike,
  from its own failed request, that the round failed with ``cause="store"`` and no rank.

The core decides from what the driver (``m2n_async._engine._round``) gathered; it never reads
a clock or the store. Messages are built here, from gathered values only, so that every rank
raising on one record raises the same text.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from m2n_async._proto.errors import M2NError, TransferError
from m2n_async._proto.messages import PROTO_VERSION, Abort, RoundDone, RoundStart, decode_as

__all__ = [
    "REPORT_WINDOW_S",
    "Cause",
    "Failure",
    "Judgement",
    "Round",
    "RoundKeys",
    "Status",
]

REPORT_WINDOW_S: Final[float] = 1.0
"""Seconds a rank whose round deadline passed waits for its peers' reports before it names
the ranks without one (capped by ``abort_grace``). Ranks' deadlines differ by the time each
took to see the round start (milliseconds); the window covers that and a loaded host."""


class Cause(enum.Enum):
    """Why a round failed; ``TransferError.cause`` is its value."""

    ERROR = "error"  # the rank's own step failed (a bad shard, a load callback raised, ...)
    CANCELLED = "cancelled"  # the rank's caller cancelled it in a round that had started
    LOST = "lost"  # its store session ended: the process died or was disconnected
    LEFT = "left"  # it closed its engine (a clean leave) before the round was decided
    DEADLINE = "deadline"  # it did not report by the round deadline: frozen, hung, too late
    STORE = "store"  # the control-plane store was lost (no rank is to blame: rank None)
    SUPERSEDED = "superseded"  # trainer rank 0 opened a newer generation of the job
    PROTOCOL = "protocol"  # it wrote a round record that does not decode or fit


class Status(enum.Enum):
    """What a ``RoundDone`` says about its rank's part."""

    OK = "ok"  # done, every byte moved
    FAILED = "failed"  # its own step failed: it caused the failure (and wrote the abort)
    ABORTED = "aborted"  # it stopped because of another rank's failure (a symptom)
    DEADLINE = "deadline"  # its round deadline passed, waiting on ``suspects``
    LATE = "late"  # written by a peer: it had not reported when the deadline passed


class Judgement(enum.Enum):
    """``Round.judge``: what a set of gathered reports decides."""

    COMMIT = "commit"  # every rank reported ok
    FAIL = "fail"  # some rank reported a failure: the abort record says which
    WAIT = "wait"  # reports are missing, none failed yet


@dataclass(frozen=True)
class RoundKeys:
    """The store keys of one round."""

    namespace: str
    round: int

    @property
    def prefix(self) -> str:
        return f"{self.namespace}/round/{self.round}/"

    @property
    def start(self) -> str:
        return f"{self.prefix}start"

    @property
    def abort(self) -> str:
        return f"{self.prefix}abort"

    @property
    def done_prefix(self) -> str:
        return f"{self.prefix}done/"

    def done(self, rank: int) -> str:
        return f"{self.done_prefix}{rank}"

    @property
    def refused_prefix(self) -> str:
        return f"{self.prefix}refused/"

    def refused(self, rank: int) -> str:
        """Where ``rank`` leaves why it refused its own call to this round (its weights, its
        arguments) before joining it: read only by a deadline verdict that names it."""
        return f"{self.refused_prefix}{rank}"

    def rank_of_done(self, key: str) -> int | None:
        """The rank a ``done/{rank}`` key belongs to; None for any other key."""
        tail = key[len(self.done_prefix):] if key.startswith(self.done_prefix) else ""
        return int(tail) if tail.isascii() and tail.isdigit() else None


@dataclass(frozen=True)
class Failure:
    """A round's failure: its cause, the rank that caused it (None: the store) and why."""

    cause: Cause
    rank: int | None
    reason: str


class Round:
    """The decisions of one round on one rank (sans-IO; one instance per round)."""

    def __init__(self, *, namespace: str, generation: int, round: int, rank: int,
                 world_size: int, trainer_ranks: int) -> None:
        if not 0 <= rank < world_size or not 0 < trainer_ranks < world_size or round < 1:
            raise ValueError(f"Round: rank {rank}, world_size {world_size}, trainer_ranks "
                             f"{trainer_ranks}, round {round} do not fit")
        self.keys = RoundKeys(namespace, round)
        self.generation = generation
        self.round = round
        self.rank = rank
        self.world_size = world_size
        self.trainer_ranks = trainer_ranks

    # -- naming ------------------------------------------------------------------------------

    @property
    def where(self) -> str:
        return f"round {self.round} of generation {self.generation}"

    def role_of(self, rank: int) -> str:
        return "trainer" if rank < self.trainer_ranks else "worker"

    def named(self, ranks: Sequence[int]) -> str:
        """``"2 (worker), 3 (worker)"``: ranks with their roles, for messages."""
        return ", ".join(f"{r} ({self.role_of(r)})" for r in ranks)

    @property
    def peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    # -- the start ---------------------------------------------------------------------------

    def check_start(self, start: RoundStart) -> Failure | None:
        """A ``start`` record of another generation or round: trainer rank 0 broke the
        protocol (or a stale process wrote it)."""
        if (start.generation, start.round) == (self.generation, self.round):
            return None
        return Failure(Cause.PROTOCOL, 0, f"its round start names generation "
                                          f"{start.generation} round {start.round}")

    def closed_before_start(self) -> Failure:
        """Trainer rank 0's ``close()`` closed the job (this round's closing start) before
        its ``sync_weights`` published the round: it never starts on any rank."""
        return Failure(Cause.LEFT, 0, f"trainer rank 0 closed its engine before {self.where} "
                                      f"started; no rank runs it")

    def start_taken(self, raw: bytes | None) -> tuple[Failure, bool]:
        """Trainer rank 0 came to publish the round and found its ``start`` key written
        already (its compare-and-set lost): the failure it raises, and whether it writes
        that failure as the round's abort record.

        This round's closing start means rank 0's own ``close()`` came first
        (``closed_before_start``): the round never starts on any rank (each reads that start
        as the end of the job), so the failure is rank 0's alone and is not recorded (a
        record beside the closing start would make the ranks that read the key later raise
        it instead of ending). Any other value (another process's start, a record of another
        round or generation, bytes that do not decode) is recorded, naming rank 0: the ranks
        that read that start then fail the round with the same error instead of running a
        round rank 0 is not in.
        """
        try:
            found = decode_as(raw if raw is not None else b"", RoundStart)
        except M2NError as exc:
            return self.protocol(0, f"trainer rank 0 found the start key of {self.where} "
                                    f"already holding an invalid record: {exc}"), True
        if found.closing and self.check_start(found) is None:
            return self.closed_before_start(), False
        closing = ", closing" if found.closing else ""
        return self.protocol(0, f"trainer rank 0 found the start key of {self.where} already "
                                f"holding another start (generation {found.generation} round "
                                f"{found.round} version {found.version}{closing}), written by "
                                f"another process as trainer rank 0"), True

    def read_start(self, raw: bytes) -> RoundStart | Failure:
        """The ``start`` record read from the store, or the protocol failure (naming rank 0)
        of one that does not decode or names another generation or round."""
        try:
            start = decode_as(raw, RoundStart)
        except M2NError as exc:
            return self.protocol(0, f"its round start is invalid: {exc}")
        return self.check_start(start) or start

    def cancelled_waiting(self, found: Mapping[str, bytes]) -> Failure | None:
        """This rank's caller cancelled its wait for the round's start; ``found``: what the
        round's prefix held when it looked (after the cancel). The failure it posts
        (compare-and-set: a record there first wins) and raises on nothing, its engine
        poisoned with the winning record — or None: nothing is posted, the engine stays
        as it was.

        A start of this round means the round began on the ranks that read it: this rank's
        cancel is then a cancel in the round (``cancelled``), so the peers fail at once
        rather than at the deadline. An ``abort`` record means the round failed already (it
        is the failure). No start yet: the round began nowhere, and this rank may still
        join it with its next call (as a rank whose call refused its arguments may), so it
        declines nothing — if it neither calls again nor closes its engine, the peers it
        leaves in the round fail at the round deadline naming it. The job's closing start:
        there is no round to fail (a record beside it would make the ranks that read the
        key later raise it instead of ending). A start that is invalid fails the round as
        it fails a rank that reads it."""
        if self.keys.abort in found:
            return self.failure_of(found[self.keys.abort])
        raw = found.get(self.keys.start)
        if raw is None:
            return None
        start = self.read_start(raw)
        if isinstance(start, Failure):
            return start
        return None if start.closing else self.cancelled()

    def start_missed(self, timeout: float, refusal: str | None = None) -> Failure:
        """A trainer waited the round deadline for rank 0 to start the round. ``refusal``:
        the note rank 0 left when it refused its own call (``RoundKeys.refused``)."""
        if refusal is not None:
            return Failure(Cause.DEADLINE, 0, f"trainer rank 0 did not start {self.where} "
                                              f"within the round deadline of {timeout:g} s: "
                                              f"its sync_weights call was refused "
                                              f"({refusal}) and no call started the round "
                                              f"since")
        return Failure(Cause.DEADLINE, 0, f"trainer rank 0 did not start {self.where} within "
                                          f"the round deadline of {timeout:g} s (frozen, hung, "
                                          f"or not calling sync_weights)")

    # -- causes -------------------------------------------------------------------------------

    def own_error(self, exc: BaseException) -> Failure:
        return Failure(Cause.ERROR, self.rank, f"{type(exc).__name__}: {exc}")

    def cancelled(self) -> Failure:
        return Failure(Cause.CANCELLED, self.rank,
                       f"the round was cancelled by its caller on rank {self.rank}")

    def lost(self, rank: int) -> Failure:
        return Failure(Cause.LOST, rank, f"rank {self.named([rank])} was lost (its store "
                                         f"session ended: process died or disconnected)")

    def left(self, rank: int, error: str | None = None) -> Failure:
        """``rank`` closed its engine before its part of the round was done; ``error``: the
        text it left behind when it closed on an error (``RoundKeys``' ``gone`` note)."""
        how = "it closed its engine" if error is None else (
            f"it closed its engine on an error: {error}")
        return Failure(Cause.LEFT, rank, f"rank {self.named([rank])} left the job before "
                                         f"finishing its part of {self.where} ({how})")

    def closed(self, rank: int) -> Failure:
        """``rank`` (this one) closed its engine while the round was in progress."""
        return Failure(Cause.LEFT, rank, f"rank {self.named([rank])} closed its engine "
                                         f"during {self.where}")

    def store_lost(self) -> Failure:
        return Failure(Cause.STORE, None, "the control-plane store was lost (no rank could "
                                          "report its outcome)")

    def superseded(self, current: int) -> Failure:
        return Failure(Cause.SUPERSEDED, 0, f"trainer rank 0 opened generation {current} of "
                                            f"the job; {self.where} can no longer complete")

    def protocol(self, rank: int, what: str) -> Failure:
        return Failure(Cause.PROTOCOL, rank, what)

    # -- the departure rule -----------------------------------------------------------------

    @staticmethod
    def lost_matters(rank: int, reported: Collection[int]) -> bool:
        """Whether a peer's loss or leave fails the round: only if it had not reported."""
        return rank not in reported

    def left_ranks(self, alive: Collection[int], reported: Collection[int]) -> list[int]:
        """Peers whose liveness key is gone (a clean leave) and that had not reported."""
        return [r for r in self.peers if r not in alive and self.lost_matters(r, reported)]

    # -- reports -------------------------------------------------------------------------------

    def report(self, status: Status, *, nbytes: int = 0, seconds: float = 0.0,
               error: str | None = None, suspects: Sequence[int] = ()) -> RoundDone:
        """This rank's ``RoundDone``."""
        return RoundDone(PROTO_VERSION, self.generation, self.round, self.rank,
                         status is Status.OK, error, nbytes, seconds, status.value,
                         tuple(sorted(set(suspects))), self.rank)

    def late_report(self, rank: int, failure: Failure) -> RoundDone:
        """The ``done`` record this rank writes for ``rank``, which had not reported."""
        return RoundDone(PROTO_VERSION, self.generation, self.round, rank, False,
                         failure.reason, 0, 0.0, Status.LATE.value, (), self.rank)

    def fenced_report(self, rank: int, failure: Failure) -> RoundDone:
        """The ``done`` record this rank writes for ``rank``, missing when the round's abort
        record decided it: ``rank`` can no longer complete a set of ok reports."""
        return RoundDone(PROTO_VERSION, self.generation, self.round, rank, False,
                         failure.reason, 0, 0.0, Status.ABORTED.value, (), self.rank)

    def decode_reports(self, raw: Mapping[str, bytes]) -> dict[int, RoundDone] | Failure:
        """The gathered ``done`` records by rank, or the protocol failure of a bad one."""
        out: dict[int, RoundDone] = {}
        for key, value in raw.items():
            r = self.keys.rank_of_done(key)
            if r is None or r >= self.world_size:
                return self.protocol(self.rank, f"foreign key {key!r} under the round's "
                                                f"reports")
            try:
                d = decode_as(value, RoundDone)
            except M2NError as exc:
                return self.protocol(r, f"rank {r} wrote an invalid round report: {exc}")
            if (d.generation, d.round, d.rank) != (self.generation, self.round, r):
                return self.protocol(r, f"rank {r}'s report names generation {d.generation} "
                                        f"round {d.round} rank {d.rank}")
            if d.status not in _STATUSES:
                return self.protocol(r, f"rank {r}'s report has unknown status {d.status!r}")
            out[r] = d
        return out

    def judge(self, reports: Mapping[int, RoundDone]) -> Judgement:
        """The outcome check: commit only on an ok report from every rank."""
        if any(not d.ok for d in reports.values()):
            return Judgement.FAIL
        if len(reports) == self.world_size:
            return Judgement.COMMIT
        return Judgement.WAIT

    def deadline_verdict(self, reports: Mapping[int, RoundDone], timeout: float,
                         refusals: Mapping[int, str] | None = None) -> Failure:
        """Who failed the round, when the deadline passed with ``reports`` gathered.
        ``refusals``: rank -> the note a rank left when it refused its own call to the round
        (``RoundKeys.refused``): a missing rank that left one is named with it, not as frozen.

        First-failure choice, in order: a rank that failed by itself (its report says
        ``failed``; it normally wrote the abort record already); one written ``late`` by a
        peer; a rank with no report (frozen, hung before reporting, too late); among the
        ranks others were waiting on, one that itself waited on nobody (the end of a chain
        of waits), else any; a rank whose deadline passed waiting on nobody (stuck in its
        own step). Among equals, the most suspected, then the lowest rank.
        """
        votes = Counter(s for d in reports.values() for s in d.suspects
                        if 0 <= s < self.world_size)

        def pick(ranks: Sequence[int]) -> int:
            return min(ranks, key=lambda r: (-votes[r], r))

        failed = [r for r, d in reports.items() if d.status == Status.FAILED.value]
        if failed:
            r = pick(failed)
            return Failure(Cause.ERROR, r, reports[r].error or "failed")
        late = [r for r, d in reports.items() if d.status == Status.LATE.value]
        if late:
            r = pick(late)
            return Failure(Cause.DEADLINE, r, reports[r].error or "did not report")
        missing = [r for r in range(self.world_size) if r not in reports]
        if missing:
            r = pick(missing)
            waited = sorted(q for q, d in reports.items() if r in d.suspects)
            by = f"; rank(s) {waited} were waiting on it" if waited else ""
            refusal = (refusals or {}).get(r)
            if refusal is not None:
                return Failure(Cause.DEADLINE, r,
                               f"rank {self.named([r])} did not report its part of "
                               f"{self.where} by the round deadline of {timeout:g} s: its "
                               f"sync_weights call was refused ({refusal}) and no call "
                               f"of it joined the round since{by}")
            return Failure(Cause.DEADLINE, r,
                           f"rank {self.named([r])} did not report its part of {self.where} by "
                           f"the round deadline of {timeout:g} s (frozen, hung or too "
                           f"late{by})")
        if votes:
            # Waits chain: a healthy worker waits on the trainer that waits on the hung
            # worker, which waits on nobody (stuck in its own step). Votes alone would tie
            # the trainer with the hung worker; the end of the chain is the one at fault.
            ends = [r for r in votes if r in reports and not reports[r].ok
                    and not any(0 <= s < self.world_size and s != r
                                for s in reports[r].suspects)]
            r = pick(ends or list(votes))
            waited = sorted(q for q, d in reports.items() if r in d.suspects)
            return Failure(Cause.DEADLINE, r,
                           f"rank {self.named([r])} did not finish its part of {self.where} "
                           f"within the round deadline of {timeout:g} s (rank(s) {waited} "
                           f"were still waiting on it)")
        stuck = sorted(r for r, d in reports.items() if not d.ok)
        r = stuck[0] if stuck else self.rank
        return Failure(Cause.DEADLINE, r,
                       f"rank {self.named([r])} did not finish its own step of {self.where} "
                       f"within the round deadline of {timeout:g} s")

    # -- the abort record ----------------------------------------------------------------

    def abort_record(self, failure: Failure) -> Abort:
        assert failure.rank is not None, "a store loss has no record"
        return Abort(PROTO_VERSION, self.generation, self.round, failure.rank,
                     failure.cause.value, failure.reason, self.rank)

    def failure_of(self, raw: bytes) -> Failure:
        """The failure an ``abort`` record names (a bad record: its writer is unknown, so
        the protocol failure names this rank's view)."""
        try:
            ab = decode_as(raw, Abort)
        except M2NError as exc:
            return self.protocol(self.rank, f"the round's abort record is invalid: {exc}")
        if (ab.generation, ab.round) != (self.generation, self.round) or not (
                0 <= ab.rank < self.world_size) or ab.cause not in _CAUSES:
            return self.protocol(ab.reporter if 0 <= ab.reporter < self.world_size
                                 else self.rank,
                                 f"the round's abort record names generation {ab.generation} "
                                 f"round {ab.round} rank {ab.rank} cause {ab.cause!r}")
        return Failure(Cause(ab.cause), ab.rank, ab.reason)

    def error(self, failure: Failure) -> TransferError:
        """The ``TransferError`` every rank raises for ``failure`` (same text everywhere)."""
        if failure.rank is None:
            text = f"{self.where} failed: {failure.reason}"
        else:
            text = (f"{self.where} failed; first failure on rank "
                    f"{self.named([failure.rank])} ({failure.cause.value}): {failure.reason}")
        return TransferError(text, rank=failure.rank, round=self.round,
                             cause=failure.cause.value, generation=self.generation)


_STATUSES: Final[frozenset[str]] = frozenset(s.value for s in Status)
_CAUSES: Final[frozenset[str]] = frozenset(c.value for c in Cause)
