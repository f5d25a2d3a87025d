"""The ``m2n`` lane's coalesced (stacked) reshards on a real GPU, bit-exact.

Each world runs the lane with coalescing on (default threshold, tiny buckets that cut the
groups, a low threshold that leaves the larger parameters single) and off, two rounds of
different bytes each, and checks every byte every worker received, for every layout pair of
the suite (with repeats, so that same-geometry parameters really stack, and rank-3 tensors,
which never do) and for a tiny mixed MoE-like model (stackable groups across layers, experts
and names, replicated norms and router, rank-3 fused experts, embedding / lm_head above the
low threshold), also with fp32 sources cast into the stacked bf16 staging.
"""

from __future__ import annotations

import pytest

from .conftest import gpu_skip_reason
from .test_gpu_planes import TOPOLOGY, _ok, _require, _run

_reason = gpu_skip_reason("m2n", 2)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_reason is not None, reason=_reason or "")]

#: (tag, coalesce, coalesce_below or None for the default, bucket_bytes, source dtype)
VARIANTS = [("on", True, None, 1 << 20, None),
            ("on-small-buckets", True, None, 160 << 10, None),
            ("on-low-threshold", True, 4096, 1 << 20, None),
            ("off", False, None, 1 << 20, None)]


def _check(res: dict, trainer_ranks: int, variants: list) -> None:
    for rank, per in res.items():
        assert sorted(per) == sorted(v[0] for v in variants), (rank, sorted(per))
        for tag, rec in per.items():
            assert rec["moved"] == [rec["plan_bytes"]] * 2 or rank < trainer_ranks, (
                rank, tag, rec["moved"], rec["plan_bytes"])
            if rank >= trainer_ranks:
                assert rec["bad"] == [[], []], (rank, tag, rec["bad"])
            assert rec["teardown_finished"], (rank, tag, rec)
    # the plan really exercises stacking: the default variant issues fewer calls than params
    on = res[0]["on"]
    assert on["calls"] < on["params"], on
    assert res[0]["off"]["calls"] == on["params"]


@pytest.mark.parametrize("topology", sorted(TOPOLOGY))
def test_coalescing_on_and_off_bit_exact_every_layout_pair(topology):
    t, w = TOPOLOGY[topology]
    _require("m2n", w)
    case = {"plan": "layouts", "topology": topology, "variants": VARIANTS}
    _check(_ok(_run("coalesce_planes", case, t, w), w), t, VARIANTS)


def test_coalescing_mixed_model_bit_exact():
    _require("m2n", 4)
    variants = [*VARIANTS, ("on+fp32src", True, None, 1 << 20, "float32"),
                ("on-low-threshold+fp32src", True, 4096, 1 << 20, "float32")]
    case = {"plan": "mixed", "topology": "2+2", "variants": variants}
    res = _ok(_run("coalesce_planes", case, 2, 4), 4)
    _check(res, 2, variants)
    # connect warmed every copy the stacks need (``M2NTransport._copy_forms``): no round
    # compiled a variant of the Triton copy (None: Triton is not installed)
    for rank, per in res.items():
        for tag, rec in per.items():
            before, after = rec["variants"]
            assert before is None or before > 0, (rank, tag, "the count does not work")
            assert before == after, (rank, tag, rec["variants"])


def test_targets_moved_between_rounds_get_the_bytes():
    # Round 2 after every worker target's .data was reassigned (the same tensors, new
    # storage): the scatter (the Triton copy through pointer tables, where Triton is
    # installed) must write the new storage, not the old.
    _require("m2n", 4)
    variants = [("on", True, None, 1 << 20, None)]
    case = {"plan": "mixed", "topology": "2+2", "variants": variants, "move_targets": True}
    res = _ok(_run("coalesce_planes", case, 2, 4), 4)
    for rank in (2, 3):
        rec = res[rank]["on"]
        assert rec["bad"] == [[], []], (rank, rec["bad"])
        assert rec["moved"] == [rec["plan_bytes"]] * 2, (rank, rec)
    assert res[0]["on"]["calls"] < res[0]["on"]["params"]  # stacked: a scatter to check


def test_stacks_in_one_buffer_are_resharded_in_place():
    # Sources and targets as views of one buffer per rank, each stack's members back to
    # back (a flat parameter buffer): every stacked call reads and writes those bytes
    # themselves (no pack, no scatter), and every byte is right. With fp32 sources (a cast)
    # the trainers pack as usual; the workers still receive in place.
    _require("m2n", 4)
    variants = [("on", True, None, 1 << 20, None),
                ("on+fp32src", True, None, 1 << 20, "float32")]
    case = {"plan": "mixed", "topology": "2+2", "variants": variants, "flat": True}
    res = _ok(_run("coalesce_planes", case, 2, 4), 4)
    for rank, per in res.items():
        for tag, rec in per.items():
            assert rec["stacked_calls"] > 0, (rank, tag, rec)
            if rank >= 2:
                assert rec["bad"] == [[], []], (rank, tag, rec["bad"])
                assert rec["moved"] == [rec["plan_bytes"]] * 2, (rank, tag, rec)
            every = tag == "on" or rank >= 2
            assert rec["in_place_stacks"] == [rec["stacked_calls"] if every else 0] * 2, (
                rank, tag, rec)
            assert rec["teardown_finished"], (rank, tag, rec)
