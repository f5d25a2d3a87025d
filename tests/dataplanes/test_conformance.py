"""Every lane against the ``Transport`` contract (``conformance``): gloo for real on CPU, the
nccl and m2n lanes over the fake runtime (``fake_nccl``), each rank a task of one event loop
(``_world.run_world``). ``tests/gpu/test_gpu_conformance.py`` runs the same checks on a GPU."""

from __future__ import annotations

import pytest

from m2n_async._proto.lanes import LANES

from . import conformance, fake_nccl
from ._world import raise_first, run_world


async def _run(lane: str, check: str, layout: str = "2+2") -> None:
    results = await run_world(lane, conformance.plan_for(layout), body=conformance.CHECKS[check],
                              bucket_bytes=conformance.BUCKET_BYTES,
                              max_inflight=conformance.MAX_INFLIGHT, host="127.0.0.1")
    raise_first(results)


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", sorted(conformance.LAYOUTS))
@pytest.mark.parametrize("lane", LANES)
async def test_moves_bytes_bit_exact(fake_world: fake_nccl.FakeWorld, lane: str,
                                     layout: str) -> None:
    await _run(lane, "bit_exact", layout)


@pytest.mark.asyncio
@pytest.mark.parametrize("lane", LANES)
async def test_abort_wakes_a_pending_completion(fake_world: fake_nccl.FakeWorld,
                                                lane: str) -> None:
    await _run(lane, "abort")


@pytest.mark.asyncio
@pytest.mark.parametrize("lane", LANES)
async def test_close_is_idempotent_and_releases(fake_world: fake_nccl.FakeWorld,
                                                lane: str) -> None:
    await _run(lane, "close")


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["2+2", "2+3"])
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("check", [
    "reuse",   # later rounds reuse cached state only where it still holds
    "grad",    # parameters requiring grad move like plain tensors
    "swap",    # tensors swapped by swap_tensors between rounds are followed
    "let_go",  # storage given up between rounds is not held
])
async def test_across_rounds(fake_world: fake_nccl.FakeWorld, check: str, lane: str,
                             layout: str) -> None:
    await _run(lane, check, layout)


def test_every_check_runs_here() -> None:
    # a check added to the suite needs its test above (and in tests/gpu)
    assert set(conformance.CHECKS) == {"bit_exact", "abort", "close", "reuse", "grad", "swap",
                                    "let_go"}
