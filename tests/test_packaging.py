"""What pyproject.toml says about torch matches where the pins really are: the package asks
for a floor only, and the CPU pin lives in tox.ini and DEVELOPERS.md's install line."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_torch_requirement_is_a_floor_and_its_comment_names_the_pins() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    deps = tomllib.loads(text)["project"]["dependencies"]
    torch = [d for d in deps if re.match(r"torch\b", d)]
    assert len(torch) == 1 and "==" not in torch[0], torch  # GPU hosts bring their own
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == f'"{torch[0]}",')
    comment = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        comment.insert(0, line.strip().lstrip("# "))
    said = " ".join(comment)
    pins = set(re.findall(r"torch==([\w.+]+)", (ROOT / "tox.ini").read_text()))
    assert len(pins) == 1, pins
    (pin,) = pins
    assert "tox.ini" in said and f"torch=={pin}" in said, said
    assert f"torch=={pin}" in (ROOT / "DEVELOPERS.md").read_text()
