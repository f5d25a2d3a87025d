"""The GPU bench's arithmetic on CPU: per-GPU bytes, GB/s per receiving GPU, the NVLink
efficiency and the ratios (the figures BENCHMARKS.md "Multi-GPU" quotes come from it)."""

from __future__ import annotations

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
