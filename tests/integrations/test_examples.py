"""The worked examples run in CI, on CPU, as they are documented: each must print its
verification line and exit 0 (``fsdp2_to_tp.py`` and ``async_rl.py`` run their ranks in a
``m2n_async.testing.LocalWorld``; ``vllm_backend.py`` its workers as threads). A rank that
fails, or a run that overruns ``--timeout``, must make the example exit 1 saying why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args],
                          cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=150)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["fsdp2_to_tp.py", "async_rl.py", "vllm_backend.py"])
def test_example_runs_and_verifies(script: str) -> None:
    proc = _run(script, "--timeout", "100")
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.startswith("verified: "), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "why"), [
    # 64 embedding rows do not split over 3 TP workers: every rank raises the preflight
    # error, which reaches the parent as the ranks' exceptions.
    ("fsdp2_to_tp.py", ("--tp", "3", "--timeout", "100"), "does not divide evenly into 3"),
    # Far more steps than 5 s allow: the world gives up on every rank at --timeout.
    ("async_rl.py", ("--steps", "100000", "--timeout", "5"), "did not finish within 5.0 s"),
])
def test_example_fails_naming_why(script: str, args: tuple[str, ...], why: str) -> None:
    proc = _run(script, *args)
    assert proc.returncode == 1, f"{script}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "verified" not in proc.stdout, proc.stdout
    assert "FAILED: " in proc.stderr and why in proc.stderr, proc.stderr[-4000:]
