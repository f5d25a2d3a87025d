"""Round failures as separate processes over the TCP store: a rank frozen (SIGSTOP) mid-round,
before its outcome report or between rounds, and the store killed mid-round.

The contract (docs/concepts.md, "When a round fails"): every survivor raises a
``TransferError`` whose ``rank`` is the rank that caused the failure (``None`` for the store)
and whose ``cause`` says why, the same on every survivor, within the round deadline plus the
report window (``_proto.round.REPORT_WINDOW_S``) plus a few seconds of slack for a loaded
2-core host; no version commits on some ranks and not others; a new generation then moves
every byte exactly. Short round deadlines keep each case a few seconds long.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import pytest

from m2n_async._proto.round import REPORT_WINDOW_S

from ._world import RankPool
from .test_engine_procs import MIXED, _jobs, _ok

CONFIG = dict(transport="gloo", bucket_bytes=1024, max_inflight=2, phase_timeout=30,
              round_timeout=3, abort_grace=2, host="127.0.0.1")
#: Beyond the deadline and the report window: store round trips, Gloo aborts, a busy host.
SLACK_S = 2.5
WORLD = 4  # 2 trainers + 2 workers


def _survivors(results: list[tuple[str, Any]], victim: int | None) -> dict[int, dict[str, Any]]:
    out = {}
    for r, (kind, o) in enumerate(results):
        if r == victim:
            continue
        assert kind == "ok", f"rank {r}: {o}"
        out[r] = o
    return out


def _check_failure(survivors: dict[int, dict[str, Any]], *, culprit: int | None, cause: str,
                   since: float, bound: float, version: int) -> None:
    texts = set()
    for r, o in survivors.items():
        assert o["error"] is not None, f"rank {r} did not fail: {o}"
        name, msg, err_rank, when = o["error"]
        assert name == "TransferError", (r, o["error"])
        assert (err_rank, o["cause"]) == (culprit, cause), (r, o["error"], o["cause"])
        assert when - since < bound, (r, when - since, bound)
        assert o["version"] == version and o["state"] == "closed", (r, o)
        texts.add(msg)
    assert len(texts) == 1, texts  # the same error on every survivor


def _recover(pool: RankPool, address: str, job: str) -> None:
    out = _ok(pool.run(_jobs(WORLD, address=address, job=job, defs=MIXED, src_dims=(1, 2),
                             dst_dims=(1, 2), config=CONFIG, versions=[1]), timeout=90))
    assert all(o["versions"] == [1] and o["bad"] == [] for o in out)
    assert len({o["generation"] for o in out}) == 1


@pytest.mark.parametrize("victim,freeze_at", [
    (3, "mid"), (0, "mid"), (3, "before_report"), (0, "between"),
], ids=["worker-mid-round", "trainer0-mid-round", "worker-before-its-report",
        "trainer0-between-rounds"])
def test_a_frozen_rank_is_named_by_every_survivor(pool: RankPool, store_address: str,
                                                  job: str, victim: int,
                                                  freeze_at: str) -> None:
    """The frozen rank keeps its store session (a stopped process's sockets stay open), so
    nothing but the deadline reveals it; every survivor names it — not the first rank whose
    deadline fired — within the deadline plus the report window."""
    versions = [1, 2] if freeze_at == "between" else [1]
    jid = pool.submit(_jobs(WORLD, address=store_address, job=job, defs=MIXED,
                            src_dims=(1, 2), dst_dims=(1, 2), config=CONFIG,
                            versions=versions, load=("experts",), freeze=victim,
                            freeze_at=freeze_at))
    index, _ = pool.wait_event("ready_to_freeze", timeout=60)
    assert index == victim
    frozen_at = time.time()
    os.kill(pool.pid(victim), signal.SIGSTOP)
    try:
        results = pool.collect(jid, WORLD, timeout=60, expect_dead=[victim])
    finally:
        pool.kill(victim)  # SIGKILL ends a stopped process too
    window = min(REPORT_WINDOW_S, CONFIG["abort_grace"])
    _check_failure(_survivors(results, victim), culprit=victim, cause="deadline",
                   since=frozen_at, bound=CONFIG["round_timeout"] + window + SLACK_S,
                   version=1 if freeze_at == "between" else 0)
    _recover(pool, store_address, job)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_store_killed_mid_round_names_the_store(pool: RankPool, job: str) -> None:
    """Every rank raises TransferError(rank=None, cause="store"): no rank is blamed (each
    used to name itself), no version commits; a new store then serves a new job."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    ranks = _jobs(WORLD, address=address, job=job, defs=MIXED, src_dims=(1, 2),
                  dst_dims=(1, 2), config=CONFIG, versions=[1], signal_in_round=True,
                  wait_store=True)
    store_slot = WORLD  # the pool's fifth process runs the store
    jid = pool.submit([*ranks, ("engine._scenarios.store_process", {"port": port})])
    pool.wait_event("in_round", timeout=60)
    killed_at = time.time()
    pool.kill(store_slot)
    results = pool.collect(jid, WORLD + 1, timeout=60, expect_dead=[store_slot])
    _check_failure(_survivors(results[:WORLD], None), culprit=None, cause="store",
                   since=killed_at, bound=CONFIG["abort_grace"] + SLACK_S + 1.0, version=0)

    port = _free_port()
    address = f"127.0.0.1:{port}"
    ranks = _jobs(WORLD, address=address, job=job, defs=MIXED, src_dims=(1, 2),
                  dst_dims=(1, 2), config=CONFIG, versions=[1], wait_store=True)
    jid = pool.submit([*ranks, ("engine._scenarios.store_process", {"port": port})])
    try:
        out = _ok(pool.collect(jid, WORLD, timeout=90))
    finally:
        pool.kill(store_slot)
    assert all(o["versions"] == [1] and o["bad"] == [] for o in out)
