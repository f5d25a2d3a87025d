"""The host copy bench runs (small), checks its copies bit-exact and prints every row, so the
``_hostcopy`` thresholds in BENCHMARKS.md stay reproducible."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cpu_host_copy.py"


def test_host_copy_bench_smoke() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--segments", "200", "--reps", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"^ +([1248]) +(\d+) +(\d+) \|", out, re.M)
    # every word width (8, 4, 2, 1) at every size from 8 B to 16 KiB
    assert len(rows) == 4 * 7, out
    groups = re.findall(r"^ +(\d+) \| +[0-9.]+ +[0-9.]+ +[0-9.]+$", out, re.M)
    assert groups == ["1", "2", "4", "8", "16", "64"], out
