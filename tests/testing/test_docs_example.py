"""docs/testing.md's examples run as written: each python block is a test module, all run by
one pytest in a subprocess (so the plugin loads from its entry point, as for a user)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def test_the_examples_pass(tmp_path: Path) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    # The worked example, then "Acting from the test": a block lost to an edit is a failure.
    assert len(blocks) == 2, f"docs/testing.md should hold two python blocks, not {len(blocks)}"
    names = [f"test_docs_block_{k}.py" for k in range(len(blocks))]
    for name, block in zip(names, blocks, strict=True):
        (tmp_path / name).write_text(block)
    tests = sum(len(re.findall(r"^def test_", b, re.M)) for b in blocks)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *names], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{tests} passed" in proc.stdout, proc.stdout[-2000:]
