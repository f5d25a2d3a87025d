"""docs/api.md is generated from the public docstrings and must be current."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import m2n_async
import m2n_async.testing

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _gen_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_current() -> None:
    rendered = _gen_api().render()
    committed = (DOCS / "api.md").read_text()
    assert committed == rendered, (
        "docs/api.md is stale (a public name or docstring changed): run "
        "`python docs/gen_api.py` and commit docs/api.md")


def test_every_public_name_has_a_section() -> None:
    text = _gen_api().render()
    headings = {line for line in text.splitlines() if line.startswith("### ")}
    names = [*m2n_async.__all__, *(f"testing.{n}" for n in m2n_async.testing.__all__)]
    for name in names:
        if name.startswith("__"):
            continue
        assert any(f"`{name}`" in h or f"`{name}()`" in h or f"`async {name}()`" in h
                   for h in headings), name


def test_docs_link_to_each_other_and_exist() -> None:
    for page in ("concepts.md", "api.md", "troubleshooting.md", "tuning.md"):
        assert (DOCS / page).is_file(), page
    readme = (DOCS.parent / "README.md").read_text()
    for page in ("concepts.md", "api.md", "troubleshooting.md", "tuning.md"):
        assert f"docs/{page}" in readme, f"README.md does not link docs/{page}"
