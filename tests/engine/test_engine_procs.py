"""Engines end to end as separate processes over the TCP store: layouts, versions, load
callbacks, and kill -9 of a trainer or a worker mid-round."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from ._plans import R
from ._world import RankPool

CONFIG = dict(transport="gloo", bucket_bytes=1024, max_inflight=2, phase_timeout=30,
              round_timeout=30, abort_grace=3)

MIXED = [
    ("w_row", (12, 6), torch.float32, (R, 0), (R, 1)),       # row -> column
    ("w_col", (12, 6), torch.bfloat16, (R, 1), (R, 0)),      # column -> row
    ("experts", (6, 6, 6), torch.float32, (R, 0), (R, 2)),   # 3-D experts EP -> TP
    ("norm", (6,), torch.float32, None, None),               # replicated -> replicated
    ("emb", (12, 6), torch.float16, (R, 0), None),           # sharded -> replicated
    ("head", (6, 6), torch.int8, None, (R, 1)),              # replicated -> sharded
]


def _jobs(world: int, **kw: Any) -> list[tuple[str, dict[str, Any]]]:
    return [("engine._scenarios.engine_rank", dict(kw, rank=r)) for r in range(world)]


def _ok(results: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    for i, (kind, value) in enumerate(results):
        assert kind == "ok", f"rank {i}: {kind}: {value[1] if isinstance(value, tuple) else value}"
        assert value["error"] is None, f"rank {i}: {value['error']}"
    return [v for _, v in results]


@pytest.mark.parametrize("src_dims,dst_dims,load", [
    ((1, 2), (1, 3), ("experts",)),   # T=2 -> N=3, one param through a load callback
    ((1, 3), (1, 1), ()),             # T=3 -> N=1: replicated sources balanced over 3
])
def test_layouts_versions_callbacks(pool: RankPool, store_address: str, job: str,
                                    src_dims: tuple[int, int], dst_dims: tuple[int, int],
                                    load: tuple[str, ...]) -> None:
    world = src_dims[1] + dst_dims[1]
    out = _ok(pool.run(_jobs(world, address=store_address, job=job, defs=MIXED,
                             src_dims=src_dims, dst_dims=dst_dims, config=CONFIG,
                             versions=[3, 4], load=load), timeout=90))
    t = src_dims[1]
    for r, o in enumerate(out):
        assert o["versions"] == [3, 4] and o["version"] == 4 and o["state"] == "closed"
        assert o["bad"] == [], f"rank {r}: wrong bytes in {o['bad']}"
        if r >= t and load:
            assert o["loaded"].count("experts") == 2
    assert len({o["generation"] for o in out}) == 1


@pytest.mark.parametrize("victim", [0, 1, 3],
                         ids=["kill-trainer-rank0", "kill-trainer", "kill-worker"])
def test_kill_mid_round_then_new_generation(pool: RankPool, store_address: str, job: str,
                                            victim: int) -> None:
    """2 trainers + 2 workers; the victim blocks inside round 1 and is killed with SIGKILL.
    Every survivor raises a TransferError within the round deadline, its version unchanged;
    then a new generation on the same store and job succeeds."""
    world = 4
    jid = pool.submit(_jobs(world, address=store_address, job=job, defs=MIXED,
                            src_dims=(1, 2), dst_dims=(1, 2), config=CONFIG, versions=[1],
                            load=("experts",), victim=victim))
    index, _ = pool.wait_event("ready_to_die", timeout=60)
    assert index == victim
    killed_at = time.time()
    pool.kill(victim)
    results = pool.collect(jid, world, timeout=60, expect_dead=[victim])
    assert results[victim][0] == "dead"
    errors = []
    for r, (kind, o) in enumerate(results):
        if r == victim:
            continue
        assert kind == "ok", f"rank {r}: {o}"
        assert o["error"] is not None, f"rank {r} did not fail"
        name, msg, err_rank, when = o["error"]
        assert name == "TransferError", (r, o["error"])
        assert when - killed_at < CONFIG["round_timeout"], (r, when - killed_at)
        assert o["version"] == 0 and o["state"] == "closed"
        errors.append((msg, err_rank))
    assert len(set(errors)) == 1, errors  # the same error on every survivor
    assert errors[0][1] == victim, errors[0]

    out = _ok(pool.run(_jobs(world, address=store_address, job=job, defs=MIXED,
                             src_dims=(1, 2), dst_dims=(1, 2), config=CONFIG, versions=[1]),
                       timeout=90))
    assert all(o["versions"] == [1] and o["bad"] == [] for o in out)
    assert len({o["generation"] for o in out}) == 1 and out[0]["generation"] >= 2


@pytest.mark.parametrize("leaver", [1, 3], ids=["trainer-leaves", "worker-leaves"])
def test_a_rank_that_closes_between_rounds_is_named_by_every_survivor(
        pool: RankPool, store_address: str, job: str, leaver: int) -> None:
    """2 trainers + 2 workers; after round 1 the leaver closes its engine cleanly (its
    program ended) while the others start round 2. Every survivor raises the same
    TransferError naming the leaver, not itself or another survivor."""
    world = 4
    # A short deadline: a rank whose Gloo sends were in flight to a peer that aborted can
    # still sit in them until the deadline (gloo module docstring, "Abort"), and the test
    # checks the diagnosis, not that.
    config = {**CONFIG, "round_timeout": 10}
    results = pool.run(_jobs(world, address=store_address, job=job, defs=MIXED,
                             src_dims=(1, 2), dst_dims=(1, 2), config=config, versions=[1, 2],
                             leaver=leaver), timeout=90)
    errors = []
    for r, (kind, o) in enumerate(results):
        assert kind == "ok", f"rank {r}: {o}"
        assert o["versions"][:1] == [1], (r, o)
        if r == leaver:
            assert o["error"] is None and o["state"] == "closed", o
            continue
        assert o["error"] is not None, f"rank {r} did not fail"
        name, msg, err_rank, _ = o["error"]
        assert name == "TransferError", (r, o["error"])
        errors.append((msg, err_rank))
    assert len(set(errors)) == 1, errors
    assert errors[0][1] == leaver and "left the job" in errors[0][0], errors[0]
