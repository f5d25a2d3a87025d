"""Assertions on a ``WorldResult``: the failure contract, checked the way a framework needs it.

Theory of operation: the contract (DESIGN §6, docs/concepts.md "When a round fails") says
every rank raises the same diagnosis — one class, one text, the same ``exc.rank`` (the rank
that caused it), ``exc.cause``, and the same phase (handshake) or round — and that a version
commits on every rank or on none. ``assert_same_failure`` compares every surviving rank's
exception field by field and, when something differs, fails with a table of all ranks so the
odd one out is visible; ``assert_not_committed`` reads the versions each rank committed (the
world records them as they happen, so even a rank killed later counts).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from m2n_async._proto.handshake import Phase as PreflightPhase
from m2n_async.testing._world import RankResult

__all__ = ["assert_committed", "assert_not_committed", "assert_same_failure"]

_UNSET: Any = object()
_PHASES = tuple(p.value for p in PreflightPhase)


def _table(results: Iterable[RankResult]) -> str:
    rows = []
    for r in results:
        e = r.error
        what = (f"{type(e).__name__}(rank={getattr(e, 'rank', '-')}, "
                f"cause={getattr(e, 'cause', '-')}, phase={getattr(e, 'phase', '-')}, "
                f"round={getattr(e, 'round', '-')}): {e}" if e is not None else "")
        rows.append(f"  rank {r.rank} ({r.role}): {r.status} {what}".rstrip())
    return "\n".join(rows)


def assert_same_failure(results: Sequence[RankResult], exc_type: type[BaseException]
                        = Exception, *, culprit: int | tuple[int, ...] | None = _UNSET,
                        cause: str | None = _UNSET, phase: str | PreflightPhase | None = _UNSET,
                        round: int | None = _UNSET,
                        ranks: Iterable[int] | None = None, same_text: bool = True
                        ) -> BaseException:
    """Every rank in ``ranks`` (default: every rank whose process did not die or freeze)
    raised the same diagnosis; return one of the exceptions.

    Checked: each raised (none returned); each is an ``exc_type``; all share one class, one
    ``exc.rank``, ``exc.cause``, ``exc.phase`` and ``exc.round`` (attributes an exception
    lacks count as None) and, with ``same_text``, one message. ``culprit``, ``cause``,
    ``phase``, ``round``, when given, are what those must be (``culprit=None`` is the store's
    failure: nobody to blame; ``phase`` a name or a ``PreflightPhase`` member); an exception
    that lacks the attribute a given one checks fails, saying so. A ``PreflightError``'s
    culprit is the set of ranks it names: pass ``culprit=r`` for ``failures == {r: ...}``
    and the sorted tuple ``culprit=(r, s)`` for two or more; a ``PeerLostError``'s is its
    ``ranks``, likewise.
    """
    if isinstance(phase, PreflightPhase):  # the enum's value is the name errors carry
        phase = phase.value
    elif phase is not _UNSET and phase is not None and phase not in _PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(_PHASES)}")
    by_rank = {r.rank: r for r in results}
    chosen = (sorted(ranks) if ranks is not None
              else [r.rank for r in results if r.status not in ("dead", "frozen")])
    problems: list[str] = []
    odd: RankResult | None = None  # the first rank that raised something else: its traceback
    if not chosen:
        problems.append("no rank to check (every rank died or froze)")
    for k in chosen:
        r = by_rank.get(k)
        if r is None:
            problems.append(f"rank {k} is not in the results")
        elif r.status != "error":
            problems.append(f"rank {k} did not raise ({r.status})")
        elif not isinstance(r.error, exc_type):
            problems.append(f"rank {k} raised {type(r.error).__name__}, not "
                            f"{exc_type.__name__}")
            odd = odd or r
    errors: dict[int, BaseException] = {}
    for k in chosen:
        e = by_rank[k].error if k in by_rank else None
        if e is not None:
            errors[k] = e

    def blamed(e: BaseException) -> Any:
        # TransferError: .rank; PreflightError: the ranks in .failures; PeerLostError: .ranks
        if hasattr(e, "rank"):
            return e.rank
        named = getattr(e, "failures", None) or getattr(e, "ranks", None)
        if named:
            named = tuple(sorted(named))
            return named[0] if len(named) == 1 else named
        return None

    fields: dict[str, Any] = {
        "class": lambda e: type(e).__name__, "culprit": blamed,
        "cause": lambda e: getattr(e, "cause", None),
        "phase": lambda e: getattr(e, "phase", None),
        "round": lambda e: getattr(e, "round", None),
    }
    if same_text:
        fields["text"] = str
    for name, get in fields.items():
        seen = {k: get(e) for k, e in errors.items()}
        if len(set(map(repr, seen.values()))) > 1:
            problems.append(f"ranks differ in {name}: {seen}")
    wanted = {"culprit": culprit, "cause": cause, "phase": phase, "round": round}
    for name, want in wanted.items():
        if want is _UNSET:
            continue
        for k, e in errors.items():
            if not _has(e, name):
                # "None" would read as a wrong value: the exception has no such field at all.
                problems.append(f"rank {k}: {type(e).__name__} has no {_ATTRS[name]} "
                                f"attribute, so its {name} cannot be {want!r}")
                break
            got = fields[name](e)
            if got != want:
                problems.append(f"rank {k}: {name} is {got!r}, expected {want!r}")
                break
    if problems:
        # An unexpected class is most often the integration's own bug (a KeyError in a
        # rank function): where it was raised, not only its text, points at the cause.
        where = (f"\nrank {odd.rank}'s traceback:\n{odd.traceback}"
                 if odd is not None and odd.traceback else "")
        raise AssertionError("not the same failure on every rank:\n- " + "\n- ".join(problems)
                             + "\n" + _table(results) + where)
    return next(iter(errors.values()))


#: The attributes each checked field is read from (the culprit: any of them).
_ATTRS = {"culprit": "`rank`, `failures` or `ranks`", "cause": "`cause`", "phase": "`phase`",
          "round": "`round`"}


def _has(e: BaseException, name: str) -> bool:
    if name == "culprit":
        return any(hasattr(e, a) for a in ("rank", "failures", "ranks"))
    return hasattr(e, name)


def assert_not_committed(results: Sequence[RankResult], version: int) -> None:
    """No rank committed ``version`` (nor a later one): a failed round commits nowhere."""
    bad = {r.rank: r.committed for r in results
           if any(v is not None and v >= version for v in r.committed)}
    if bad:
        raise AssertionError(f"version {version} was committed on ranks {sorted(bad)} "
                             f"(their committed versions: {bad})\n{_table(results)}")


def assert_committed(results: Sequence[RankResult], version: int,
                     ranks: Iterable[int] | None = None) -> None:
    """Every rank (or each of ``ranks``, all of them in the results) committed
    ``version``."""
    chosen = set(ranks) if ranks is not None else {r.rank for r in results}
    absent = sorted(chosen - {r.rank for r in results})
    if absent:  # a rank the results lack would pass unchecked
        raise AssertionError(f"ranks {absent} are not in the results (ranks "
                             f"{sorted(r.rank for r in results)})")
    bad = {r.rank: r.committed for r in results
           if r.rank in chosen and version not in r.committed}
    if bad:
        raise AssertionError(f"version {version} was not committed on ranks {sorted(bad)} "
                             f"(their committed versions: {bad})\n{_table(results)}")
