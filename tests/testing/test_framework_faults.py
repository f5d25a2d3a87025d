"""The toolkit as a framework's tests use it from docs/testing.md: a rank process that ends
before it is ready, the world's own event names, faults that could never fire, fields an
exception lacks, acting on a rank by its number."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from m2n_async import PreflightError, PreflightPhase
from m2n_async.testing import (
    Fault,
    LocalWorld,
    RankResult,
    assert_same_failure,
)

from ._ranks import returns_rank, toy_rank

World = Callable[[int, int], LocalWorld]
REPO = Path(__file__).resolve().parents[2]


# -- a rank process that ends before it is ready ---------------------------------------------








# -- the world's own event names ------------------------------------------------------------










# -- faults that could never fire ----------------------------------------------------------


@pytest.mark.parametrize(("kw", "match"), [
    ({"point": "handshake.phase", "phase": "sorce"},
     r"unknown phase 'sorce': handshake.phase fires in hello, source, destination"),
    ({"point": "handshake.phase", "phase": PreflightPhase.CONNECTED},
     r"unknown phase 'connected'"),
    ({"point": "round.start", "round": 0}, r"round must be an int >= 1 .*got 0"),
    ({"point": "round.bucket", "bucket": -1}, r"bucket must be an int >= 0 .*got -1"),
    ({"point": "round.start", "rank": -1}, r"rank must be an int >= 0 .*got -1"),
    ({"point": "round.start", "rank": True}, r"rank must be an int >= 0 .*got True"),
    ({"point": "round.start", "round": "1"}, r"round must be an int >= 1 .*got '1'"),
    ({"point": "round.start", "bucket": 1},
     r"round.start has no coordinate 'bucket'.*its coordinates: rank, round"),
    ({"point": "round.commit", "phase": "hello"}, r"round.commit has no coordinate 'phase'"),
    ({"point": "handshake.phase", "round": 1}, r"handshake.phase has no coordinate 'round'"),
    ({"point": "round.start", "times": 0}, r"times must be an int >= 1, got 0"),
    ({"point": "round.start", "action": "slow", "seconds": -1.0}, r"seconds must be"),
])
def test_a_fault_that_can_never_fire_is_refused_where_it_is_written(
        kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Fault(**kw)  # type: ignore[arg-type]


def test_a_fault_for_a_rank_outside_the_world_is_refused_at_start(m2n_world: World) -> None:
    with pytest.raises(ValueError, match=r"rank 2 is outside this world of 2 ranks \(0 \.\. 1\)"):
        m2n_world(1, 1).start(returns_rank, faults=[Fault("round.start", rank=2)])




def test_a_preflight_phase_member_is_a_phase_name() -> None:
    fault = Fault("handshake.phase", rank=1, phase=PreflightPhase.SOURCE)
    assert fault == Fault("handshake.phase", rank=1, phase="source")
    assert fault.matches("handshake.phase", {"rank": 1, "phase": "source"})
    assert Fault.from_json(fault.to_json()) == fault  # its JSON form is the name
    res = [RankResult(r, "trainer", "error", error=PreflightError("source", {1: "bad"}))
           for r in range(2)]
    assert_same_failure(res, PreflightError, culprit=1, phase=PreflightPhase.SOURCE)
    with pytest.raises(ValueError, match="unknown phase 'sorce'; phases: hello, source"):
        assert_same_failure(res, PreflightError, phase="sorce")


def test_a_phase_member_fault_fires_in_a_world(m2n_world: World) -> None:
    fault = Fault("handshake.phase", "raise", rank=1, phase=PreflightPhase.SOURCE)
    res = m2n_world(1, 1).run(toy_rank, faults=[fault], timeout=60)
    assert_same_failure(res, PreflightError, culprit=1, phase=PreflightPhase.SOURCE)


# -- the failure contract: what an exception lacks -----------------------------------------


def _raised(*errors: BaseException) -> list[RankResult]:
    return [RankResult(r, "worker", "error", error=e) for r, e in enumerate(errors)]


@pytest.mark.parametrize(("kw", "match"), [
    ({"phase": "hello"}, r"rank 0: ValueError has no `phase` attribute, so its phase cannot be "
                         r"'hello'"),
    ({"culprit": 1}, r"rank 0: ValueError has no `rank`, `failures` or `ranks` attribute"),
    ({"cause": "lost"}, r"ValueError has no `cause` attribute"),
    ({"round": 1}, r"ValueError has no `round` attribute"),
])
def test_assert_same_failure_says_which_field_an_exception_lacks(
        kw: dict[str, object], match: str) -> None:
    res = _raised(ValueError("bad"), ValueError("bad"))
    with pytest.raises(AssertionError, match=match):
        assert_same_failure(res, ValueError, **kw)  # type: ignore[arg-type]
    assert_same_failure(res, ValueError)  # nothing asked of those fields: the same failure


def test_a_field_that_is_there_but_none_is_a_value_not_a_lack() -> None:
    class Blames(Exception):
        rank = None  # the store's failure: nobody to blame

    res = _raised(Blames("x"), Blames("x"))
    assert_same_failure(res, Blames, culprit=None)
    with pytest.raises(AssertionError, match=r"rank 0: culprit is None, expected 1"):
        assert_same_failure(res, Blames, culprit=1)


# -- acting on a rank by its number ----------------------------------------------------------


