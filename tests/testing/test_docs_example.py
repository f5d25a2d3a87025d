"""docs/testing.md's worked example runs as written: its python block is a test module, run
by pytest in a subprocess (so the plugin loads from its entry point, as for a user)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def test_the_worked_example_passes(tmp_path: Path) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/testing.md should hold one python block: the example"
    (tmp_path / "test_my_integration.py").write_text(blocks[0])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_my_integration.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout, proc.stdout[-2000:]
