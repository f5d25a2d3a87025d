"""Named fault points in the engine's driver code, for tests of how a job fails.

Theory of operation: the drivers (``_preflight``, ``_round``, ``_pipeline``) call a point at a
few named places, always behind the module flag::

    if _faults.armed:
        await _faults.hit("round.bucket", rank=r, round=n, bucket=k)

so an unarmed process pays one global read per point and nothing else. A test arms a list of
``Fault`` s — through ``arm()`` (``m2n_async.testing.LocalWorld`` does this in every rank
process) or the ``M2N_ASYNC_FAULTS`` environment variable (a JSON list of ``Fault`` fields,
read once at import, for processes a test does not start itself). A fault fires when its
``point`` is the one hit and every coordinate it names (``rank``, ``round``, ``bucket``,
``phase``) equals the point's; it fires ``times`` times in a process (once by default), so a
run is deterministic. ``observer`` (set by the testing world) is told of every point hit,
fault or not — that is how the world learns which versions each rank committed.

The points (each with its coordinates):

- ``handshake.phase`` (``rank``, ``phase``): this rank's local step of a preflight phase, after
  it joined the group. ``raise`` here is this rank's own step failing (every rank raises the
  same ``PreflightError`` naming it); ``hang`` overruns the step, which its rank reports
  as its own failure before the phase deadline (every rank raises the same
  ``PreflightError`` naming it); ``freeze`` never posts (the others time out naming it);
  ``die`` ends the process (the others raise ``PeerLostError`` naming it).
- ``round.start`` (``rank``, ``round``): a rank enters round ``round``'s part, before its first
  bucket — with ``freeze``, a rank frozen between rounds.
- ``round.bucket`` (``rank``, ``round``, ``bucket``): before bucket ``bucket`` is staged.
- ``round.commit`` (``rank``, ``round``, ``version``): every rank reported ok and this rank
  committed ``version`` (observed by the world; a fault here acts after the commit). ``raise``
  here fails no other rank: this rank's ``sync_weights``/``receive`` raises the
  ``InjectedFault`` itself, with the version advanced and the engine READY.

Actions: ``raise`` (``InjectedFault``), ``hang`` (an await that never returns but can be
cancelled), ``freeze`` (the process stops itself with ``SIGSTOP``: its sockets stay open, as a
frozen host's do), ``die`` (``SIGKILL`` to itself: no cleanup, as a crash), ``disconnect``
(every store connection of the event loop that hit it breaks, as a lost network would, and
the process lives on: its sessions end, so its peers see it lost, and its own next store
call fails),
``slow`` (sleeps ``seconds`` on the loop), ``cancel`` (cancels the task running the point, as
a caller that cancels ``sync_weights``/``receive`` would). ``round.commit`` is a synchronous
point: only ``raise``, ``freeze``, ``die`` and ``disconnect`` act there.

Cancellation: ``hang`` and ``slow`` are cancellable awaits; nothing else awaits.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from m2n_async._proto.handshake import Phase as PreflightPhase

__all__ = ["ENV", "Fault", "InjectedFault", "arm", "armed", "disarm", "hit", "hit_now"]

ENV = "M2N_ASYNC_FAULTS"

Action = Literal["raise", "hang", "freeze", "die", "disconnect", "slow", "cancel"]
POINTS = ("handshake.phase", "round.start", "round.bucket", "round.commit")
ACTIONS = ("raise", "hang", "freeze", "die", "disconnect", "slow", "cancel")
_WHERE = ("rank", "round", "bucket", "phase")
#: The phases whose local step ``handshake.phase`` hits (``connected``/``failed`` have none).
PHASES = tuple(p.value for p in PreflightPhase
               if p not in (PreflightPhase.CONNECTED, PreflightPhase.FAILED))
#: The coordinates each point is hit with: one a point lacks never matches there.
_POINT_WHERE = {"handshake.phase": ("rank", "phase"), "round.start": ("rank", "round"),
                "round.bucket": ("rank", "round", "bucket"), "round.commit": ("rank", "round")}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is no rank 1


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault; the message names the point and where it fired."""


@dataclass(frozen=True)
class Fault:
    """One fault: ``action`` at ``point`` when every coordinate given matches (None: any).

    A fault that could never fire is a ``ValueError`` here, naming the value and the valid
    ones: an unknown point, action or ``phase`` (a name or a ``PreflightPhase`` member,
    kept as its name), a coordinate its point is never hit with, a ``rank`` or ``bucket``
    below 0, a ``round`` below 1.
    """

    point: str
    action: Action = "raise"
    rank: int | None = None
    round: int | None = None
    bucket: int | None = None
    #: a phase's name or its ``PreflightPhase`` member (kept as the name)
    phase: str | PreflightPhase | None = None
    #: ``slow``: how long to sleep
    seconds: float = 1.0
    #: how many times it fires in one process
    times: int = 1

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; points: {', '.join(POINTS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; actions: "
                             f"{', '.join(ACTIONS)}")
        if self.point == "round.commit" and self.action not in ("raise", "freeze", "die",
                                                                 "disconnect"):
            raise ValueError(f"round.commit is synchronous: {self.action!r} cannot act there")
        if not _is_int(self.times) or self.times < 1:
            raise ValueError(f"times must be an int >= 1, got {self.times!r}")
        # A fault that can never fire must fail where it is written, not pass as a test of
        # a fault that "changes nothing".
        lacks = [k for k in _WHERE if getattr(self, k) is not None
                 and k not in _POINT_WHERE[self.point]]
        if lacks:
            raise ValueError(f"{self.point} has no coordinate {', '.join(map(repr, lacks))}: "
                             f"such a fault never fires; its coordinates: "
                             f"{', '.join(_POINT_WHERE[self.point])}")
        if isinstance(self.phase, PreflightPhase):  # the enum's value is the name the point passes
            object.__setattr__(self, "phase", self.phase.value)
        if self.phase is not None and self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}: handshake.phase fires in "
                             f"{', '.join(PHASES)} (a name or a PreflightPhase member)")
        for name, low in (("rank", 0), ("round", 1), ("bucket", 0)):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < low):
                raise ValueError(f"{name} must be an int >= {low} (or None: any), got "
                                 f"{value!r}: no point is hit with it")
        if (isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float))
                or not 0 <= self.seconds < float("inf")):
            raise ValueError(f"seconds must be a finite number >= 0, got {self.seconds!r}")

    def matches(self, point: str, where: Mapping[str, Any]) -> bool:
        if point != self.point:
            return False
        return all(getattr(self, k) is None or where.get(k) == getattr(self, k)
                   for k in _WHERE)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Fault:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown fault field(s) {sorted(unknown)} in {dict(d)}")
        return cls(**d)


#: Whether any fault or observer is armed in this process (the drivers read only this).
armed = False
_faults: list[Fault] = []
_fired: dict[int, int] = {}  # index in _faults -> times fired
observer: Callable[[str, Mapping[str, Any], Fault | None], None] | None = None


def arm(faults: Iterable[Fault], *,
        observe: Callable[[str, Mapping[str, Any], Fault | None], None] | None = None) -> None:
    """Replace this process's faults (and observer); counts start afresh."""
    global armed, observer
    _faults[:] = list(faults)
    _fired.clear()
    observer = observe
    armed = bool(_faults) or observer is not None


def disarm() -> None:
    """No faults, no observer: the points cost nothing again."""
    arm(())


def _select(point: str, where: Mapping[str, Any]) -> Fault | None:
    for i, f in enumerate(_faults):
        if _fired.get(i, 0) < f.times and f.matches(point, where):
            _fired[i] = _fired.get(i, 0) + 1
            return f
    return None


def hit_now(point: str, **where: Any) -> Fault | None:
    """A synchronous point: act on ``raise``/``freeze``/``die``; return the fault that fired
    (for ``hit`` to act on the awaiting actions), else None."""
    fault = _select(point, where)
    if observer is not None:
        observer(point, where, fault)
    if fault is None:
        return None
    if fault.action == "raise":
        raise InjectedFault(f"injected fault at {point} ({_describe(where)})")
    if fault.action == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "disconnect":
        from m2n_async._store._client import sever_all

        sever_all(f"injected fault at {point} ({_describe(where)})")
    return fault


async def hit(point: str, **where: Any) -> None:
    """An awaiting point: everything ``hit_now`` does, plus ``hang``, ``slow``, ``cancel``."""
    fault = hit_now(point, **where)
    if fault is None:
        return
    import anyio

    if fault.action == "hang":
        await anyio.sleep_forever()
    elif fault.action == "slow":
        await anyio.sleep(fault.seconds)
    elif fault.action == "cancel":
        import asyncio

        task = asyncio.current_task()
        assert task is not None, "the cancel fault needs anyio's asyncio backend"
        task.cancel(f"injected cancel at {point} ({_describe(where)})")
        await anyio.lowlevel.checkpoint()


def _describe(where: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in where.items())


def _from_env() -> None:
    raw = os.environ.get(ENV, "").strip()
    if raw:
        try:
            given = json.loads(raw)
            if not isinstance(given, list) or not all(isinstance(d, dict) for d in given):
                raise ValueError("expected a JSON list of fault objects, e.g. "
                                 '[{"point": "round.start", "action": "raise"}]')
            faults = [Fault.from_json(d) for d in given]
        except (ValueError, TypeError) as exc:  # it fails the import: say where it came from
            raise ValueError(f"{ENV}={raw!r}: {exc}") from exc
        arm(faults)


_from_env()
