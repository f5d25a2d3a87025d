"""The plan bench runs (small) and prints its tables, so BENCHMARKS.md stays reproducible."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "plan_bench.py"


def test_plan_bench_smoke() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--params", "3000", "--trainers", "16",
                          "--workers", "8", "--repeat", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "plan: 3000 params, 16+8 ranks" in out
    assert "| **total (build + validate + digests + geometry + buckets)** |" in out
    assert "| msgspec msgpack" in out and "| pickle" in out and "| json" in out
