"""The worked examples run in CI, on CPU, as they are documented: each must print its
verification line and exit 0 (each spawns its own store, trainer and worker processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["fsdp2_to_tp.py", "async_rl.py", "vllm_backend.py"])
def test_example_runs_and_verifies(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--timeout", "100"],
        cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.startswith("verified: "), proc.stdout
