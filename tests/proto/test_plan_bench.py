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


def test_plan_bench_checks_its_flags_first() -> None:
    # The layouts need TP groups of 8 and even FSDP shards: a rank count they cannot take is
    # refused up front, as a usage error naming the flag, not as a traceback from the plan.
    for argv, message in ((["--trainers", "4"], "--trainers must be 8, 16, 32, 64 or 128"),
                          (["--trainers", "24"], "--trainers must be 8, 16, 32, 64 or 128"),
                          (["--trainers", "256"], "--trainers must be 8, 16, 32, 64 or 128"),
                          (["--workers", "0"], "--workers must be a positive multiple of 8"),
                          (["--params", "0"], "--params must be at least 1")):
        proc = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert message in proc.stderr and proc.stderr.startswith("usage: "), proc.stderr


def test_plan_bench_help_gives_every_default() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    out = " ".join(out.split())
    for default in ("(default: 100000)", "(default: 64)", "(default: 512)", "(default: 3)"):
        assert default in out, out


def test_plan_bench_names_a_limit_the_flags_only_meet_together() -> None:
    # 8 trainers each send a q_proj shard to 4096 / 8 replicas: over M2N's 2 GiB per reshard.
    proc = subprocess.run([sys.executable, str(BENCH), "--params", "300", "--trainers", "8",
                           "--workers", "4096", "--repeat", "1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("plan_bench.py: error: --trainers 8 --workers 4096 give a "
                                  "plan M2N refuses: parameter "), proc.stderr


def test_the_tuning_guide_runs_the_benches_in_the_projects_environment() -> None:
    # A bare `python bench/...` from a fresh shell has no m2n_async to import: the guide's
    # commands name the venv's interpreter (the CPU benches) or the GPU host's python3.
    import re

    tuning = (BENCH.parents[1] / "docs" / "tuning.md").read_text()
    commands = re.findall(r"`(\S*python\S* bench/[^`]*)`", tuning)  # not prose's bench/x.py
    assert len(commands) >= 7 and any("plan_bench.py" in c for c in commands), commands
    for command in commands:
        gpu = "/gpu_" in command
        assert command.startswith("python3 bench/" if gpu else ".venv/bin/python bench/"), command
