"""The store cost bench runs (small) and prints its rows, so BENCHMARKS.md stays reproducible."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "store_cost.py"


def test_store_cost_bench_smoke() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--calls", "200", "--loop", "asyncio"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = dict(re.findall(r"^\| ([A-Za-z ()/]+) \| ([0-9.]+) \|$", out, re.M))
    assert set(rows) == {"echo (floor)", "add", "get", "server add (no I/O)"}, out
    assert all(float(us) > 0 for us in rows.values()), out
