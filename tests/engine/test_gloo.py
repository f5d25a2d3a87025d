"""The Gloo transport and the bucket pipeline across real processes (no engine)."""

from __future__ import annotations

import socket

import torch

from ._plans import R
from ._world import RankPool

_MIXED = [
    ("w_row", (12, 6), torch.float32, (R, 0), (R, 1)),   # row -> column
    ("w_col", (12, 6), torch.bfloat16, (R, 1), (R, 0)),  # column -> row
    ("rep_to_shard", (6, 4), torch.float16, None, (R, 0)),
    ("shard_to_rep", (6, 2), torch.int64, (R, 0), None),
    ("experts", (4, 6, 6), torch.float32, (R, 0), (R, 2)),  # EP -> TP
    ("flags", (6,), torch.bool, (R, 0), None),
    ("same", (12, 4), torch.float32, (R, 0), (R, 0)),  # zero-copy both sides when aligned
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _jobs(world: int, **kw: object) -> list[tuple[str, dict[str, object]]]:
    return [("engine._scenarios.transport_rounds", dict(kw, rank=r)) for r in range(world)]


def _ok(results: list[tuple[str, object]]) -> list[dict[str, object]]:
    for i, (kind, value) in enumerate(results):
        assert kind == "ok", f"rank {i}: {kind}: {value[1] if isinstance(value, tuple) else value}"
    return [v for _, v in results]  # type: ignore[misc]


def test_mixed_layouts_pipelined_and_default_group(pool: RankPool, store_address: str,
                                                   job: str) -> None:
    """2 trainers -> 3 workers, small buckets so several are in flight; a torch default
    process group (the trainer's own world) keeps working beside our Gloo group."""
    out = _ok(pool.run(_jobs(5, address=store_address, job=job, defs=_MIXED, src_dims=(1, 2),
                             dst_dims=(1, 3), bucket_bytes=256, max_inflight=3,
                             versions=[1, 2],
                             default_group=f"tcp://127.0.0.1:{_free_port()}")))
    for r, o in enumerate(out):
        assert o["bad"] == [], f"rank {r} got wrong bytes for {o['bad']}"
        assert o["allreduce"] == [15.0, 15.0, 15.0]
        assert all(b > 0 for b in o["bytes"])  # type: ignore[union-attr]
        # extra memory bounded by max_inflight arenas of this rank's largest bucket staging
        assert max(o["peak"]) <= o["static"] <= 3 * o["arena"]  # type: ignore[operator]


def test_t_ne_n_single_bucket(pool: RankPool, store_address: str, job: str) -> None:
    """1 trainer -> 2 workers (2, 1) mesh: replicated destination, one big bucket."""
    defs = [("a", (12, 6), torch.float32, (R, 0), None),
            ("b", (6,), torch.int8, None, (0, R))]
    out = _ok(pool.run(_jobs(3, address=store_address, job=job, defs=defs, src_dims=(1, 1),
                             dst_dims=(2, 1), bucket_bytes=1 << 20, max_inflight=1,
                             versions=[7])))
    assert all(o["bad"] == [] for o in out)
