"""What ``stage``/``unpack`` take as sinks, on every lane (gloo for real, nccl and m2n over the
fake runtime): a ``SinkMap`` of ``Sink`` records is used as it is; a plain mapping of target
tensors and load callbacks (what these tests and the benches pass) is converted once per
mapping and round, never per bucket, and not kept past the round."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from m2n_async._data import _transport
from m2n_async._data._transport import Sink, SinkMap, Transport, sink_map
from m2n_async._proto.lanes import LANES

from . import fake_nccl
from ._world import R, drive, expected, make_plan, raise_first, run_world, sources, targets

ROUNDS = 3
PLAN = make_plan([(f"p{i}", (8, 4), torch.float32, (R, 0), (R, 1)) for i in range(6)],
                 (1, 2), (1, 2))


def test_sink_map_records_tensors_in_place_and_callbacks_not() -> None:
    x = torch.zeros(2)

    def load(name: str, tensor: torch.Tensor) -> None:
        pass

    kept = Sink.of(x, placements=(R, 0))
    got = sink_map({"t": x, "cb": load, "none": None, "kept": kept})
    assert isinstance(got, SinkMap) and sorted(got) == ["cb", "kept", "t"]
    assert (got["t"].in_place, got["t"].target is x, got["t"].declared is x) == (True,) * 3
    assert (got["cb"].in_place, got["cb"].load is load) == (False, True)
    assert got["kept"] is kept and kept.placements == (R, 0)
    assert sink_map(got) is got


@pytest.mark.asyncio
@pytest.mark.parametrize("records", [False, True], ids=["plain", "sinkmap"])
@pytest.mark.parametrize("lane", LANES)
async def test_sinks_are_converted_once_per_mapping_and_round(
        fake_world: fake_nccl.FakeWorld, monkeypatch: pytest.MonkeyPatch, lane: str,
        records: bool) -> None:
    converted: list[int] = []
    real = _transport.sink_map

    def counting(sinks: Any) -> SinkMap:
        converted.append(id(sinks))
        return real(sinks)

    monkeypatch.setattr(_transport, "sink_map", counting)
    called = PLAN.params[3].spec.name
    got: dict[int, list[str]] = {}

    async def body(rank: int, t: Transport) -> None:
        trainer = rank < PLAN.trainer_ranks
        mine: dict[str, Any] = {} if trainer else targets(PLAN, rank)
        got[rank] = []
        if not trainer:
            mine[called] = lambda name, tensor: got[rank].append(name)
        sinks = real(mine) if records else mine
        for rnd in range(ROUNDS):
            await drive(t, round=rnd, deadline=time.monotonic() + 30,
                        sources=sources(PLAN, rank, rnd) if trainer else None,
                        sinks=None if trainer else sinks, max_inflight=2)
            assert t._sink_cache is None  # nothing of the caller's kept past the round
            if not trainer:
                for k, v in expected(PLAN, rank, rnd).items():
                    if k != called:
                        assert torch.equal(mine[k], v), (rank, rnd, k)

    raise_first(await run_world(lane, PLAN, body=body, bucket_bytes=64, host="127.0.0.1"))
    workers = range(PLAN.trainer_ranks, PLAN.world_size)
    assert all(got[r] == [called] * ROUNDS for r in workers)
    per_mapping = {k: converted.count(k) for k in set(converted)}
    if records:
        assert converted == []
    else:
        # gloo keeps what it built from a mapping while it is given the same one; the GPU
        # lanes convert it again in each round (not per bucket: 6 buckets a round here)
        assert len(per_mapping) == len(workers), per_mapping
        assert set(per_mapping.values()) == ({1} if lane == "gloo" else {ROUNDS}), per_mapping
