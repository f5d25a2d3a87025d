"""The GPU data planes on a real GPU: several NCCL ranks per GPU as spawned processes.

Each test spawns one world (``_world.run_world``) and checks what came back: bytes bit-exact
on every worker for every layout pair of the CPU suite, byte counts equal to the plan, the
M2N grouping decision identical on every rank, no hang when grouping is forced on a host
that cannot group, survivors of a killed rank ending within the deadline, event-loop lag.
``M2N_GPU_REPORT=path`` appends each world's JSON summary there (BENCHMARKS.md figures).
"""

from __future__ import annotations

import json
import os

import pytest

from m2n_async.testing import _gpu as _world

from .conftest import gpu_skip_reason

_reason = gpu_skip_reason("nccl", 2)  # the least any test here needs
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_reason is not None, reason=_reason or "")]


def _require(transport: str, world_size: int) -> None:
    reason = gpu_skip_reason(transport, world_size)
    if reason is not None:
        pytest.skip(reason)

PKG = __name__.rsplit(".", 1)[0]
TOPOLOGY = {"1+1": (1, 2), "2+2": (2, 4), "2+3": (2, 5)}


def _run(scenario: str, case: dict, trainer_ranks: int, world_size: int,
         timeout: float = 240.0) -> dict:
    out = _world.run_world(f"{PKG}._scenarios:{scenario}", case, trainer_ranks=trainer_ranks,
                           world_size=world_size, timeout=timeout)
    path = os.environ.get("M2N_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, "case": case, **out}) + "\n")
    return out


def _ok(out: dict, world_size: int, victims: tuple[int, ...] = ()) -> dict:
    res = out["results"]
    missing = [r for r in range(world_size) if r not in res and r not in victims]
    assert not missing, f"ranks {missing} never reported (hang?): {out}"
    errors = {r: v for r, v in res.items() if "error" in v}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    return res


@pytest.mark.parametrize("topology", sorted(TOPOLOGY))
def test_layout_pairs_bit_exact_both_transports(topology):
    t, w = TOPOLOGY[topology]
    transports = [tr for tr in ("m2n", "nccl") if gpu_skip_reason(tr, w) is None]
    if not transports:
        pytest.skip(gpu_skip_reason("nccl", w) or "")
    case = {"topology": topology, "transports": transports, "rounds": 2,
            "bucket_bytes": 1 << 14, "cast": topology == "2+2"}
    res = _ok(_run("planes", case, t, w), w)
    reasons = set()
    for rank, per in res.items():
        for tag, rec in per.items():
            assert rec["moved"] == [rec["plan_bytes"]] * 2 or (
                tag.startswith("m2n") and rank < t), (rank, tag, rec["moved"], rec["plan_bytes"])
            if rank >= t:
                assert rec["bad"] == [[], []], (rank, tag, rec["bad"])
            if tag == "m2n":
                reasons.add((rec["grouped"], rec["grouping_reason"]))
            assert rec["teardown_finished"], (rank, tag, rec)
            # the loop stayed responsive while buckets moved (generous: shared CPU)
            assert rec["lag_max_ms"] < 250, (rank, tag, rec["lag_max_ms"])
    if "m2n" not in transports:  # nccl passed above; say visibly what did not run
        pytest.skip(f"nccl bit-exact; m2n not run: {gpu_skip_reason('m2n', w)}")
    assert len(reasons) == 1, reasons  # grouping decided identically on every rank


def test_forced_grouping_fails_fast_on_a_gin_less_host():
    _require("m2n", 2)
    out = _run("grouping_on", {"env": {"M2N_ASYNC_M2N_GROUPING": "on"}}, 1, 2, timeout=120)
    res = _ok(out, 2)
    if any(v.get("connected") and v.get("grouped") for v in res.values()):
        pytest.skip("this host supports grouped M2N submission (GIN present)")
    for rank, v in res.items():
        assert v.get("error_type") == "LocalProtocolError", (rank, v)
        assert "M2N_ASYNC_M2N_GROUPING=on" in v["message"]
        assert v["seconds"] < 30


@pytest.mark.parametrize("transport", ["nccl", "m2n"])
def test_killed_rank_survivors_end_within_deadline(transport):
    _require(transport, 4)
    deadline = 8.0
    case = {"transport": transport, "victims": [3], "deadline_s": deadline, "linger_s": 40}
    out = _run("kill", case, 2, 4, timeout=150)
    res = _ok(out, 4, victims=(3,))
    assert out["exitcodes"][3] == 9
    for rank in (0, 1, 2):
        v = res[rank]
        # every survivor's round ended by the deadline (+ slack for a loaded host)...
        assert v["round_end_s"] < deadline + 5, (rank, v)
        # ...and close is bounded even when the communicator abort never returns
        assert v["total_s"] < deadline + 5 + 15, (rank, v)
    # the trainers send 128 MiB to the dead rank: their round must fail, not "succeed"
    # (verified for m2n; for nccl only with a 16 MiB payload, which completed eagerly —
    # DEVELOPERS "GPU notes")
    for rank in (0, 1):
        assert res[rank]["round"].startswith(("TimeoutError", "TransferError")), res[rank]
    if transport == "nccl":
        # NCCL point-to-point: the abort returns and frees the survivors completely
        assert all(res[r]["teardown_finished"] for r in (0, 1, 2)), res


# 1+1 as well as 2+2: with torch's own libnccl 2.28 (one rank per GPU) an x2 host can run the
# whole engine on the ``nccl`` transport only in 1+1. ``auto`` must pick m2n where the stack
# has it and nccl where it does not (libnccl 2.28), and say why.
@pytest.mark.parametrize("topology", ["1+1", "2+2"])
@pytest.mark.parametrize("transport", ["m2n", "nccl", "auto"])
def test_engine_on_gpu(transport, topology):
    t, w = TOPOLOGY[topology]
    _require("nccl" if transport == "auto" else transport, w)
    expected = transport
    if transport == "auto":
        expected = "m2n" if gpu_skip_reason("m2n", w) is None else "nccl"
    case = {"transport": transport, "topology": topology, "bucket_bytes": 1 << 14}
    res = _ok(_run("engine", case, t, w), w)
    for rank, v in res.items():
        for rnd in (0, 1):
            r = v[f"round{rnd}"]
            assert r["transport"] == expected and r["bytes"] == v["plan_bytes"], (rank, r)
            assert r["version"] == rnd + 1
            if transport == "auto":
                assert r["reason"], (rank, r)
        if rank >= t:
            assert v["bad0"] == [] and v["bad1"] == [], (rank, v)
