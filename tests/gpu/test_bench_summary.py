"""The GPU bench's arithmetic on CPU: per-GPU bytes, GB/s per receiving GPU, the NVLink
efficiency and the ratios (the figures BENCHMARKS.md "Multi-GPU" quotes come from it)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_sync_bench
        yield gpu_sync_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))


PATHS = ("raw", "per_param", "m2n", "nccl", "m2n_cast", "pack_only")


def _rank(seconds: dict[str, list[float]], nbytes: int, gpu: int) -> dict:
    return {**seconds, "bytes": nbytes, "gpu": gpu, "gpu_name": "H200"}


def test_two_plus_two_on_separate_gpus(bench) -> None:
    gib = 1 << 30
    times = {p: [0.02, 0.01, 0.01, 0.03] for p in PATHS}  # warm-up excluded already
    times["m2n"] = [0.02, 0.02, 0.02, 0.02]
    slow_worker = {**times, "raw": [0.01, 0.012, 0.01, 0.01]}
    res = {0: _rank(times, 2 * gib, 0), 1: _rank(times, 2 * gib, 1),
           2: _rank(slow_worker, 2 * gib, 2), 3: _rank(times, 2 * gib, 3)}
    s = bench.summarize({"results": res}, trainer_ranks=2, link_gbps=370.0)
    assert s["gpus"]["split"] is True
    assert s["gpus"]["bytes_in_per_gpu"] == {2: 2 * gib, 3: 2 * gib}
    assert s["bytes_received_by_workers"] == 4 * gib
    # per iteration the slowest rank counts: raw is [0.02, 0.012, 0.01, 0.03] -> median 0.016
    assert s["raw"]["median_s"] == pytest.approx(0.016)
    # the rank that bounded each iteration (ties: the lowest rank): the worker once
    assert s["raw"]["slowest_rank"] == {0: 3, 2: 1}
    assert s["raw"]["GBps_per_receiving_gpu"] == pytest.approx(2 * gib / 0.016 / 1e9, rel=1e-3)
    bound = 2 * gib / 370e9
    assert s["gpus"]["lower_bound_s"] == pytest.approx(bound, rel=1e-4)
    assert s["m2n"]["efficiency_vs_370GBps"] == pytest.approx(bound / 0.02, abs=1e-3)
    assert s["ratios"]["m2n_vs_raw (raw/m2n, goal >= 0.95)"] == pytest.approx(0.8)


def test_shared_gpu_has_no_nvlink_efficiency(bench) -> None:
    times = {p: [0.01, 0.01] for p in PATHS}
    res = {r: _rank(times, 10**8, 0) for r in range(4)}
    s = bench.summarize({"results": res}, trainer_ranks=2)
    assert s["gpus"]["split"] is False  # trainers and workers share GPU 0: no link figure
    assert not any(k.startswith("efficiency") for k in s["m2n"])
    assert s["m2n"]["GBps_per_receiving_gpu"] == pytest.approx(2 * 10**8 / 0.01 / 1e9)


def test_round_marks_medians_sorted_by_time():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_round_marks
    finally:
        sys.path.remove(str(ROOT / "bench"))
    rows = [{"t0": 0.0, "b0.src": 90.0, "end": 3000.0},
            {"t0": 0.0, "b0.src": 80.0, "end": 3400.0, "b1.src": 500.0},
            {"t0": 0.0, "b0.src": 300.0, "end": 3100.0}]
    got = gpu_round_marks.median_marks(rows)
    # a mark missing from some rounds is the median of the rounds that have it
    assert got == {"t0": 0.0, "b0.src": 90.0, "b1.src": 500.0, "end": 3100.0}
    assert list(got) == ["t0", "b0.src", "b1.src", "end"]


# -- the coalescing comparison: models, descriptors, broadcast, pack, summaries (CPU) ---------


def test_every_model_divides_for_one_two_four_ranks(bench) -> None:
    for model in bench.MODELS:
        for t in (1, 2, 4):
            for n in (1, 2, 4):
                bench.model_plan(model, t, n).validate("m2n")
    plan = bench.model_plan("mixed", 2, 2)
    total = sum(p.spec.nbytes for p in plan.params)
    assert 256 << 20 <= total <= 1536 << 20, total
    assert len(plan.params) > 500
    names = [p.spec.name for p in plan.params]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    groups = bench.stack_groups(plan, 16 << 20)
    # embedding and lm_head (64 MiB a rank) stay single; the rest is a handful of stacks
    singles = {plan.params[g[0]].spec.name for g in groups if len(g) == 1}
    assert singles == {"model.embed_tokens.weight", "lm_head.weight"}
    assert len(groups) < 12
    # grouping is by geometry: k/v projections and expert gate/up share one stack
    kv = next(g for g in groups if names[g[0]].endswith("k_proj.weight"))
    assert any(names[i].endswith("gate_proj.weight") for i in kv)


def test_tiny_mixed_plan_has_stacks_rank3_and_large_singles() -> None:
    sys.path.insert(0, str(ROOT))
    from m2n_async.testing import _gpu as _world

    plan = _world.make_plan(_world.mixed_defs(**_world.TINY_MIXED), (1, 2), (1, 2))
    from m2n_async._proto.stacking import stack_problem

    why = [stack_problem(plan, i, 4096) for i in range(len(plan.params))]
    assert any(w and "tensor rank 3" in w for w in why)
    assert any(w and "coalesce_below" in w for w in why)
    assert sum(w is None for w in why) > 10


def _fake_m2n_world(bench, plan, groups):
    """Every rank of ``plan`` as a thread through the FAKE nccl.m2n: raw per-parameter and raw
    stacked descriptors; returns per worker (per-param mismatches, stacked mismatches)."""
    import threading

    sys.path.insert(0, str(ROOT))
    from tests.dataplanes import fake_nccl

    w = bench._world
    world = fake_nccl.FakeWorld()
    saved = fake_nccl.install(world)
    try:
        m2n = sys.modules["nccl.m2n"]
        size, uid = plan.world_size, b"u" * 128
        found: dict[int, tuple[list[str], list[str]]] = {}
        errors: list[str] = []

        def rank_fn(r: int) -> None:
            try:
                comm = fake_nccl.Comm(size, r, uid)
                handle = m2n.Handle.create()
                trainer = r < plan.trainer_ranks
                srcs = w.source_shards(plan, r, 0, "cpu") if trainer else None
                tg = None if trainer else w.zero_targets(plan, r, "cpu")
                per, _ = bench.raw_descriptors(m2n, plan, r, srcs, tg)
                stk, bufs = bench.raw_descriptors(m2n, plan, r, srcs, tg, groups)
                for src, dst in per + stk:
                    handle.reshard(comm, src, dst, stream=0)
                if not trainer:
                    want = w.expected_shards(plan, r, 0, "cpu")
                    found[r] = (w.mismatches(tg, want), bench.stacked_mismatches(plan, bufs, want))
            except BaseException as exc:  # reported below
                errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(size)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        return found, world
    finally:
        fake_nccl.uninstall(saved)


@pytest.mark.parametrize("dims", [((1, 2), (1, 2)), ((1, 1), (1, 2)), ((1, 2), (1, 1))])
def test_raw_and_stacked_descriptors_bit_exact_through_fake_m2n(bench, dims) -> None:
    w = bench._world
    plan = w.make_plan(w.mixed_defs(**w.TINY_MIXED), *dims)
    groups = bench.stack_groups(plan, 4096)
    assert any(len(g) > 1 for g in groups) and len(groups) < len(plan.params)
    found, world = _fake_m2n_world(bench, plan, groups)
    assert sorted(found) == list(range(plan.trainer_ranks, plan.world_size))
    for r, (per, stk) in found.items():
        assert per == [] and stk == [], (r, per[:3], stk[:3])
    assert world.reshard_calls[0] == len(plan.params) + len(groups)


def test_broadcast_gather_assembles_every_full_tensor(bench) -> None:
    import torch

    w = bench._world
    for t in (1, 2, 4):
        plan = w.make_plan(w.mixed_defs(**{**w.TINY_MIXED, "fused_experts": False}), (1, t),
                           (1, 2))
        srcs = {r: w.source_shards(plan, r, 0, "cpu") for r in range(t)}
        sends = bench.bcast_sends(plan)
        got = {r: torch.cat([srcs[r][plan.params[i].spec.name].reshape(-1) for i, _ in v])
               for r, v in sends.items() if v}
        full = bench.assemble_full(plan, srcs[0], got, sends)
        for p, f in zip(plan.params, full, strict=True):
            g = w.global_tensor(p.spec.name, p.spec.shape, p.spec.dtype, 0, "cpu")
            assert torch.equal(f.view(torch.int16), g.view(torch.int16)), (t, p.spec.name)
    runs = bench.bcast_buckets(plan, 16 << 10)
    assert runs[0][0] == 0 and runs[-1][1] == len(plan.params)
    assert all(a < b for a, b in runs) and all(x[1] == y[0] for x, y in itertools.pairwise(runs))


def test_pack_only_mirrors_the_stacked_staging(bench) -> None:
    import torch

    w = bench._world
    plan = w.make_plan(w.mixed_defs(**w.TINY_MIXED), (1, 2), (1, 2))
    srcs = w.source_shards(plan, 0, 0, "cpu")
    s32 = {k: v.float() for k, v in srcs.items()}
    layout = bench.pack_layout(plan, 0, 1 << 20, 4096)
    keep = bench.pack_stacked(plan, layout, s32, torch.bfloat16, "cpu")
    seen = []
    k = 0
    for calls in layout:
        for idx, shape in calls:
            buf = keep[k]
            k += 1
            assert tuple(buf.shape) == shape and buf.dtype == torch.bfloat16
            for i, part in zip(idx, buf.unbind(0) if len(idx) > 1 else [buf], strict=True):
                assert torch.equal(part.view(torch.int16),
                                   srcs[plan.params[i].spec.name].view(torch.int16))
                seen.append(i)
    assert sorted(seen) == list(range(len(plan.params)))


ALL = ("raw", "raw_stacked", "per_param", "m2n", "m2n_nocoalesce", "nccl", "m2n_cast",
       "pack_only", "pack_per_tensor", "pack_flat", "broadcast", "api_bf16", "api_fp32")


def test_summary_goals_for_moe(bench) -> None:
    times = {p: [0.01, 0.01] for p in ALL}
    times.update({"raw": [0.6, 0.6], "raw_stacked": [0.003, 0.003], "m2n": [0.004, 0.004],
                  "m2n_nocoalesce": [0.64, 0.64], "pack_only": [0.001, 0.001],
                  "pack_lane": [0.0012, 0.0012],
                  "m2n_cast": [0.0042, 0.0042], "api_bf16": [0.005, 0.005],
                  "api_fp32": [0.007, 0.007]})
    res = {r: {**_rank(times, 10**8, 0), "calls": {"raw": 1024, "raw_stacked": 1},
               **({"bad_m2n": [], "bad_raw_stacked": []} if r >= 2 else {})}
           for r in range(4)}
    s = bench.summarize({"results": res}, trainer_ranks=2, model="moe")
    goals = {g["goal"].split(" (")[0].split(":")[1].strip(): g for g in s["goals"]}
    by_text = {g["goal"]: g for g in s["goals"]}
    assert s["bit_exact"] is True and s["bit_exact_paths"] == {"m2n": True, "raw_stacked": True}
    stacked = next(g for t, g in by_text.items() if "raw stacked" in t)
    assert stacked["value"] == pytest.approx(4 / 3, rel=1e-3) and stacked["pass"] is True
    off = next(g for t, g in by_text.items() if "coalescing off" in t)
    assert off["value"] == pytest.approx(160) and off["pass"] is True
    pack = next(g for t, g in by_text.items() if "pack_lane" in t)
    assert pack["value"] == pytest.approx(1.2) and pack["pass"] is True
    cast = next(g for t, g in by_text.items() if t.startswith("moe: cast sync"))
    assert cast["value"] == pytest.approx(1.05) and cast["pass"] is True
    api = next(g for t, g in by_text.items() if "public API cast" in t)
    assert api["value"] == pytest.approx(1.4) and api["pass"] is False
    assert goals  # every line has a model prefix
    lines = bench.goal_lines(s["goals"])
    assert any(line.startswith("GOAL FAIL") and "public API" in line for line in lines)
    table = "\n".join(bench.table_lines(s))
    assert "raw_stacked" in table and "1024" in table


def test_summary_reports_failed_and_missing_paths(bench) -> None:
    times = {p: [0.02, 0.02] for p in ("raw", "raw_stacked", "per_param", "pack_only",
                                       "nccl", "broadcast")}
    res = {r: {**_rank(times, 10**8, 0), "errors": {"m2n": "AttributeError: boom"},
               **({"bad_nccl": ["x"]} if r == 3 else {})} for r in range(4)}
    s = bench.summarize({"results": res}, trainer_ranks=2, model="mixed")
    assert "m2n" not in s and s["path_errors"] == {"m2n": {r: "AttributeError: boom"
                                                            for r in range(4)}}
    bcast = next(g for g in s["goals"] if "packed broadcast / engine" in g["goal"])
    assert bcast["value"] is None and bcast["pass"] is None
    assert s["bit_exact"] is False and s["mismatches"] == {"nccl": {3: ["x"]}}
    assert s["ratios"]["m2n_vs_raw (raw/m2n, goal >= 0.95)"] is None
    assert any(line.startswith("GOAL N/A") for line in bench.goal_lines(s["goals"]))
    assert "failed: AttributeError" in "\n".join(bench.table_lines(s))


def test_dense_goal_and_api_rounds(bench) -> None:
    times = {p: [0.0130, 0.0130] for p in ("raw", "m2n", "m2n_cast", "pack_only")}
    times["m2n"] = [0.0135, 0.0135]
    res = {r: _rank(times, 10**8, 0) for r in range(4)}
    s = bench.summarize({"results": res}, trainer_ranks=2, model="dense")
    dense = next(g for g in s["goals"] if g["goal"].startswith("dense: engine / raw"))
    assert dense["value"] == pytest.approx(0.963, abs=1e-3) and dense["pass"] is True


def test_threshold_summary(bench) -> None:
    def rank(scale: float) -> dict:
        sizes = {}
        for size in bench.THRESHOLD_SIZES:
            count = bench.threshold_count(size, 256 << 20, 1024)
            call = 6e-4 + size / 100e9  # fixed cost + bandwidth
            sizes[str(size)] = {"count": count, "shape": [size // 1024, 1024],
                                "per_param": [count * call * scale] * 2,
                                "stacked": [(6e-4 + count * size / 100e9) * scale] * 5,
                                "copy": [1e-4] * 5, "bad_stacked": [], "bad_per_param": []}
        return {"gpu": 0, "gpu_name": "H200", "sizes": sizes}

    run = {"results": {0: rank(1.0), 1: rank(1.1), 2: rank(1.0), 3: rank(1.0)}}
    s = bench.summarize_threshold(run, 2)
    row = s["sizes"][str(16 << 20)]
    assert row["count"] == 16 and row["bit_exact"] is True
    # 16 MiB: 168 us of bandwidth + 600 us fixed per call vs one call of 16 x 16 MiB
    assert row["single_vs_stacked"] == pytest.approx((6e-4 + 16 * (16 << 20) / 100e9)
                                                     / (16 * (6e-4 + (16 << 20) / 100e9)),
                                                     abs=1e-3)
    small = s["sizes"][str(64 << 10)]
    assert small["count"] == 1024 and small["single_vs_stacked"] < 0.02
    assert s["goals"][0]["pass"] is False  # 0.6 ms a call: 16 MiB is far from bandwidth-bound
    bound = s["smallest_bandwidth_bound_size"]
    assert bound is None or bound > 16 << 20
    assert len(bench.threshold_lines(s)) == 1 + len(bench.THRESHOLD_SIZES)
    plan = bench.threshold_plan(16 << 20, 4, 2, 2)
    assert plan.param_cost(0) == 16 << 20


def test_command_line(bench) -> None:
    p = bench.build_parser()
    moe = bench.build_case(p.parse_args([]))
    assert moe["model"] == "moe" and moe["broadcast"] is True and moe["api"] is True
    assert moe["coalesce_below"] == 16 << 20
    dense = bench.build_case(p.parse_args(["--model", "dense", "--no-api"]))
    assert dense["broadcast"] is False and dense["api"] is False
    forced = bench.build_case(p.parse_args(["--model", "large", "--broadcast",
                                            "--coalesce-below", "4M"]))
    assert forced["broadcast"] is True and forced["coalesce_below"] == 4 << 20
    th = bench.build_case(p.parse_args(["--threshold-sweep"]))
    assert th["sizes"] == list(bench.THRESHOLD_SIZES)
    assert th["sizes"][0] == 64 << 10 and th["sizes"][-1] == 64 << 20


def test_fp32_refusal_asks_the_engines_own_source_check(bench) -> None:
    from types import SimpleNamespace

    import torch

    from m2n_async._engine._engine import _source_expectations

    w = bench._world
    plan = w.make_plan(w.mixed_defs(**{**w.TINY_MIXED, "layers": 1}), (1, 2), (1, 2))
    eng = SimpleNamespace(_plan=plan, _expect=_source_expectations(plan, 0),
                          _names=[p.spec.name for p in plan.params])
    srcs = w.source_shards(plan, 0, 0, "cpu")
    assert bench.fp32_refusal(eng, srcs, 0, "cpu") is None  # the wire dtype itself
    as_int = {k: v.to(torch.int16) for k, v in srcs.items()}
    assert "PlanError" in (bench.fp32_refusal(eng, as_int, 0, "cpu") or "")
    # fp32 masters for a bf16 wire: whatever the engine says, before any round
    got = bench.fp32_refusal(eng, {k: v.float() for k, v in srcs.items()}, 0, "cpu")
    assert got is None or got.startswith("PlanError")
