"""The exception hierarchy: what survives a pickle (rank processes send their errors to the
test process that way), text and notes included."""

from __future__ import annotations

import pickle

from m2n_async import PeerLostError, PhaseTimeoutError, PreflightError, TransferError
from m2n_async._store._claims import JobClaim, JobClaimedError
from m2n_async._store._core import StaleGenerationError, StoreLimitError


def test_errors_keep_text_attributes_and_notes_across_a_pickle() -> None:
    errors: list[Exception] = [
        PreflightError("source", {1: "local step failed"}, generation=3),
        PeerLostError("rank 2 was lost", ranks=(2,), key="job/3/alive/2"),
        TransferError("round 1 failed", rank=2, round=1, cause="lost", generation=3),
        PhaseTimeoutError("preflight phase 'source' timed out", phase="source", ranks=(2,),
                          generation=3),
        # The store's errors with keyword-only attributes: rebuilt through the constructor.
        JobClaimedError("rank 0 of job 'j' is held", job="j", rank=0, holder=JobClaim(
            job="j", rank=0, ticket=4, host="h", pid=12, since=1.5, generation=2)),
        StaleGenerationError("generation 1 is stale", job="j", generation=1, current=2),
        StoreLimitError("past max_bytes", limit="max_bytes"),
    ]
    for e in errors:
        e.add_note("seen by rank 0")
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is type(e) and str(again) == str(e)
        assert vars(again) == vars(e)  # every attribute, __notes__ among them
    assert "(generation 3)" in str(pickle.loads(pickle.dumps(errors[0])))
