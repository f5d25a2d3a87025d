"""The round core (``_proto/round.py``): keys, the outcome check, the departure rule, the
deadline verdict and the error every rank raises — from gathered records alone."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from m2n_async._proto.errors import TransferError
from m2n_async._proto.messages import PROTO_VERSION, RoundStart, encode
from m2n_async._proto.round import Cause, Failure, Judgement, Round, RoundKeys, Status


def _core(rank: int = 0, world: int = 4, trainers: int = 2, round_: int = 3) -> Round:
    return Round(namespace="job/7", generation=7, round=round_, rank=rank, world_size=world,
                 trainer_ranks=trainers)


def _reports(statuses: dict[int, tuple[Status, tuple[int, ...]]], world: int = 4
             ) -> dict[int, object]:
    out = {}
    for r, (status, suspects) in statuses.items():
        out[r] = _core(r, world).report(status, suspects=suspects)
    return out


def test_keys() -> None:
    k = RoundKeys("job/7", 12)
    assert k.start == "job/7/round/12/start" and k.abort == "job/7/round/12/abort"
    assert k.done(3) == "job/7/round/12/done/3" and k.rank_of_done(k.done(3)) == 3
    assert k.rank_of_done("job/7/round/12/start") is None
    assert k.rank_of_done("job/7/round/1/done/3") is None  # another round's prefix


def test_judge_commits_only_on_every_ok() -> None:
    c = _core()
    ok = _reports({r: (Status.OK, ()) for r in range(4)})
    assert c.judge(ok) is Judgement.COMMIT  # type: ignore[arg-type]
    assert c.judge({r: ok[r] for r in range(3)}) is Judgement.WAIT  # type: ignore[misc]
    bad = {**ok, 2: _core(2).report(Status.ABORTED, suspects=(1,))}
    assert c.judge(bad) is Judgement.FAIL  # type: ignore[arg-type]


def test_reports_round_trip_through_the_store_encoding() -> None:
    c = _core(rank=1)
    raw = {c.keys.done(r): encode(_core(r).report(Status.OK, nbytes=10)) for r in range(4)}
    got = c.decode_reports(raw)
    assert isinstance(got, dict) and sorted(got) == [0, 1, 2, 3]
    assert c.judge(got) is Judgement.COMMIT


def test_a_report_of_another_round_is_a_protocol_failure_naming_its_rank() -> None:
    c = _core(rank=0)
    other = _core(2, round_=2).report(Status.OK)
    got = c.decode_reports({c.keys.done(2): encode(other)})
    assert isinstance(got, Failure) and got.cause is Cause.PROTOCOL and got.rank == 2


def test_departure_rule() -> None:
    c = _core(rank=0)
    assert not Round.lost_matters(3, reported={1, 3})
    assert Round.lost_matters(2, reported={1, 3})
    # Ranks 2 and 3 are gone; 3 had reported: only 2 left the round.
    assert c.left_ranks(alive={0, 1}, reported={3}) == [2]


@pytest.mark.parametrize("case,want_rank", [
    # worker 3 frozen: nobody hears from it, ranks 0 and 2 were waiting on it
    ({0: (Status.DEADLINE, (3,)), 1: (Status.OK, ()), 2: (Status.DEADLINE, (3,))}, 3),
    # frozen after its part, before its report: everyone else reported ok
    ({1: (Status.OK, ()), 2: (Status.OK, ()), 3: (Status.OK, ())}, 0),
    # a hung (not frozen) rank reports too: the one the others were waiting on is blamed,
    # not the lowest rank whose deadline fired, and not a rank that saw the hung one abort
    ({0: (Status.DEADLINE, (2,)), 1: (Status.DEADLINE, (2,)), 2: (Status.DEADLINE, ()),
      3: (Status.ABORTED, (0,))}, 2),
    # nobody waited on anybody: the rank stuck in its own step
    ({0: (Status.OK, ()), 1: (Status.OK, ()), 2: (Status.OK, ()),
      3: (Status.DEADLINE, ())}, 3),
    # a chain of waits (more buckets than max_inflight): worker 1 waits on trainer 0, which
    # waits on worker 2, stuck in its own step: the end of the chain, not the tie's lower rank
    ({0: (Status.DEADLINE, (2,)), 1: (Status.DEADLINE, (0,)), 2: (Status.DEADLINE, ()),
      3: (Status.OK, ())}, 2),
    # a cycle has no end: the votes decide, then the lowest rank
    ({0: (Status.DEADLINE, (1,)), 1: (Status.DEADLINE, (0,)), 2: (Status.OK, ()),
      3: (Status.OK, ())}, 0),
])
def test_deadline_verdict_names_the_cause_not_the_first_deadline(
        case: dict[int, tuple[Status, tuple[int, ...]]], want_rank: int) -> None:
    reports = _reports(case)
    verdicts = {_core(r).deadline_verdict(reports, 10.0) for r in range(4)}  # type: ignore[arg-type]
    assert len(verdicts) == 1  # the same verdict whichever rank computes it
    (v,) = verdicts
    assert v.cause is Cause.DEADLINE and v.rank == want_rank, v


def test_a_failed_report_beats_deadlines() -> None:
    reports = _reports({0: (Status.DEADLINE, (1,)), 1: (Status.FAILED, ()),
                        2: (Status.ABORTED, (1,))})
    v = _core(0).deadline_verdict(reports, 5.0)  # type: ignore[arg-type]
    assert v.cause is Cause.ERROR and v.rank == 1


def test_a_late_record_stands() -> None:
    c = _core(0)
    late = c.late_report(3, c.deadline_verdict({}, 5.0))
    assert late.rank == 3 and late.reporter == 0 and late.status == Status.LATE.value
    reports = _reports({0: (Status.OK, ()), 1: (Status.OK, ()), 2: (Status.OK, ())})
    reports[3] = late
    assert c.judge(reports) is Judgement.FAIL  # type: ignore[arg-type]
    assert c.deadline_verdict(reports, 5.0).rank == 3  # type: ignore[arg-type]


def test_abort_record_round_trip_and_one_text_everywhere() -> None:
    failure = _core(2).lost(3)
    raw = encode(_core(2).abort_record(failure))
    errors = [_core(r).error(_core(r).failure_of(raw)) for r in range(4)]
    assert len({str(e) for e in errors}) == 1
    e = errors[0]
    assert isinstance(e, TransferError) and (e.rank, e.cause, e.round, e.generation) == (
        3, "lost", 3, 7)
    assert "rank 3 (worker)" in str(e)
    again = pickle.loads(pickle.dumps(e))
    assert (again.rank, again.cause, again.round, again.generation) == (3, "lost", 3, 7)


def test_a_foreign_abort_record_is_a_protocol_failure() -> None:
    other = Round(namespace="job/6", generation=6, round=3, rank=1, world_size=4,
                  trainer_ranks=2)
    f = _core(0).failure_of(encode(other.abort_record(other.cancelled())))
    assert f.cause is Cause.PROTOCOL and f.rank == 1


def test_store_loss_names_no_rank() -> None:
    e = _core(1).error(_core(1).store_lost())
    assert e.rank is None and e.cause == "store" and "store was lost" in str(e)
    assert str(e) == str(_core(3).error(_core(3).store_lost()))


def test_start_checks() -> None:
    c = _core(2)
    ok = RoundStart(PROTO_VERSION, 7, 3, 5, 10.0, False)
    assert c.check_start(ok) is None
    bad = c.check_start(RoundStart(PROTO_VERSION, 6, 3, 5, 10.0, False))
    assert bad is not None and bad.cause is Cause.PROTOCOL and bad.rank == 0
    missed = c.start_missed(10.0)
    assert missed.cause is Cause.DEADLINE and missed.rank == 0


def test_a_taken_start_key_is_the_job_closed_or_a_recorded_protocol_failure() -> None:
    c = _core(0)
    # This round's closing start: rank 0's close() came first; nothing to record.
    closed, record = c.start_taken(encode(RoundStart(PROTO_VERSION, 7, 3, 5, 10.0, True)))
    assert not record and (closed.cause, closed.rank) == (Cause.LEFT, 0)
    assert closed == c.closed_before_start()
    assert str(c.error(closed)) == (
        "round 3 of generation 7 failed; first failure on rank 0 (trainer) (left): trainer "
        "rank 0 closed its engine before round 3 of generation 7 started; no rank runs it")
    # Anything else was written by another process: recorded, naming rank 0.
    for raw in (encode(RoundStart(PROTO_VERSION, 7, 3, 9, 10.0, False)),
                encode(RoundStart(PROTO_VERSION, 6, 3, 5, 10.0, True)), b"\x00junk", None):
        other, record = c.start_taken(raw)
        assert record and (other.cause, other.rank) == (Cause.PROTOCOL, 0), raw
    other, _ = c.start_taken(encode(RoundStart(PROTO_VERSION, 7, 3, 9, 10.0, False)))
    assert "already holding another start (generation 7 round 3 version 9)" in other.reason


def test_a_cancel_while_waiting_fails_a_started_round_and_declines_nothing_before() -> None:
    c = _core(1)  # a trainer other than rank 0
    keys = c.keys
    start = encode(RoundStart(PROTO_VERSION, 7, 3, 5, 10.0, False))
    # No start: the round began nowhere; this rank's next call may still join it.
    assert c.cancelled_waiting({}) is None
    assert c.cancelled_waiting({keys.refused(2): b"a note"}) is None
    # A start of this round: the cancel is a cancel in the round, naming this rank.
    got = c.cancelled_waiting({keys.start: start})
    assert got == c.cancelled() and (got.cause, got.rank) == (Cause.CANCELLED, 1)
    assert c.cancelled_waiting({keys.start: start, keys.done(0): b"x"}) == c.cancelled()
    # A record there already (with a start or without): it is the round's failure.
    lost = encode(_core(0).abort_record(_core(0).lost(3)))
    for found in ({keys.abort: lost}, {keys.start: start, keys.abort: lost}):
        got = c.cancelled_waiting(found)
        assert got is not None and (got.cause, got.rank) == (Cause.LOST, 3), found
    # The job's closing start: no round to fail, nothing to record beside it.
    closing = encode(RoundStart(PROTO_VERSION, 7, 3, 5, 10.0, True))
    assert c.cancelled_waiting({keys.start: closing}) is None
    # A start that is invalid or of another round fails the round as it fails its readers.
    for bad in (b"\x00junk", encode(RoundStart(PROTO_VERSION, 7, 4, 5, 10.0, False))):
        got = c.cancelled_waiting({keys.start: bad})
        assert got is not None and (got.cause, got.rank) == (Cause.PROTOCOL, 0), bad
    # A worker decides alike.
    assert _core(3).cancelled_waiting({keys.start: start}) == _core(3).cancelled()


def test_read_start() -> None:
    c = _core(2)
    ok = RoundStart(PROTO_VERSION, 7, 3, 5, 10.0, False)
    assert c.read_start(encode(ok)) == ok
    bad = c.read_start(b"\x00junk")
    assert isinstance(bad, Failure) and (bad.cause, bad.rank) == (Cause.PROTOCOL, 0)
    assert "round start is invalid" in bad.reason
    other = c.read_start(encode(RoundStart(PROTO_VERSION, 6, 3, 5, 10.0, False)))
    assert isinstance(other, Failure) and other == c.check_start(
        RoundStart(PROTO_VERSION, 6, 3, 5, 10.0, False))


def test_rejects_impossible_rounds() -> None:
    with pytest.raises(ValueError):
        Round(namespace="j/1", generation=1, round=0, rank=0, world_size=2, trainer_ranks=1)


def test_a_missing_rank_that_left_a_refusal_is_named_with_it() -> None:
    from m2n_async._proto.round import Cause, Round

    core = Round(namespace="j/1", generation=1, round=3, rank=0, world_size=4,
                 trainer_ranks=2)
    assert core.keys.refused(1) == "j/1/round/3/refused/1"
    assert core.keys.refused(1).startswith(core.keys.refused_prefix)
    assert core.keys.rank_of_done(core.keys.refused(1)) is None  # not a report
    reports: dict[int, Any] = {}  # no rank reported
    plain = core.deadline_verdict(reports, 5.0)
    named = core.deadline_verdict(reports, 5.0, {0: "PlanError: bad w"})
    assert plain.cause is named.cause is Cause.DEADLINE and plain.rank == named.rank == 0
    assert "frozen" in plain.reason and "frozen" not in named.reason
    assert "call was refused (PlanError: bad w)" in named.reason
    missed = core.start_missed(5.0, "PlanError: bad w")
    assert missed.rank == 0 and "call was refused (PlanError: bad w)" in missed.reason
