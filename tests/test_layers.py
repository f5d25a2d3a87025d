"""Imports point down (DEVELOPERS "Where things live", DESIGN §2): every module's imports,
read from its AST (lazy and ``TYPE_CHECKING`` ones included), stay within its layer or go to
a layer below it; nothing in the package imports the test suite."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import m2n_async

PACKAGE = Path(m2n_async.__file__).resolve().parent

#: layer -> the layers it may import (besides itself). Top-level modules not named here sit
#: on top and may import any layer (``testing``, ``cli``, ``_demo``, the package root).
BELOW: dict[str, frozenset[str]] = {
    "_proto": frozenset(),
    "_store": frozenset({"_proto"}),
    "_integrations": frozenset({"_proto"}),
    "_data": frozenset({"_proto", "_store"}),
    "_engine": frozenset({"_proto", "_store", "_data", "_integrations"}),
    "blocking": frozenset({"_proto", "_store", "_data", "_integrations", "_engine"}),
    "integrations": frozenset({"_proto", "_store", "_data", "_integrations", "_engine",
                               "blocking"}),
}
TOP = frozenset({"", "testing", "cli", "_demo"})  # "": m2n_async/__init__.py


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    """``m2n_async._store._group`` -> ``_store``; the package root -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path, root: Path = PACKAGE) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from m2n_async import _store` names a layer too
                yield node.lineno, f"{module}.{alias.name}"


def violations(root: Path = PACKAGE) -> list[str]:
    top = root.name
    out: dict[tuple[str, int, str], str] = {}  # one line per import statement and layer
    for path in sorted(root.rglob("*.py")):
        here = _layer(_module_name(path, root))
        rel = str(path.relative_to(root.parent))
        for line, module in imports(path, root):
            head = module.split(".")[0]
            if head == "tests":
                out.setdefault((rel, line, head), f"{rel}:{line} imports the test suite "
                                                  f"({module})")
                continue
            if head != top or here in TOP:
                continue
            there = _layer(module)
            if there and there != here and there not in BELOW[here]:
                out.setdefault((rel, line, there), f"{rel}:{line} ({here}) imports {module} "
                                                   f"({there}): upward or sideways")
    return sorted(out.values())


def test_every_top_level_module_has_a_layer() -> None:
    found = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").exists())}
    assert found <= set(BELOW) | TOP, sorted(found - set(BELOW) - TOP)


def test_imports_point_down() -> None:
    assert violations() == []


def test_the_store_ends_share_helpers_not_each_other() -> None:
    # the server and the client are two drivers of one wire: what they share is _sockets
    for end, other in (("_client.py", "_server"), ("_server.py", "_client")):
        mods = {m for _, m in imports(PACKAGE / "_store" / end)}
        assert not any(m.startswith(f"m2n_async._store.{other}") for m in mods), end


@pytest.mark.parametrize(("where", "text", "caught"), [
    ("_proto/x.py", "from m2n_async._store import Store\n", "(_proto) imports"),
    ("_store/x.py", "from .._engine._engine import TrainerEngine\n", "(_store) imports"),
    ("_data/x.py", "def f():\n    import m2n_async._engine._round\n", "(_data) imports"),
    ("_integrations/x.py", "from m2n_async import _data\n", "(_integrations) imports"),
    ("_engine/x.py", "from m2n_async import testing\n", "(_engine) imports"),
    ("_engine/y.py", "import tests.gpu._world\n", "imports the test suite"),
])
def test_the_checker_catches_an_upward_import(tmp_path: Path, where: str, text: str,
                                              caught: str) -> None:
    root = tmp_path / "m2n_async"
    for layer in ("_proto", "_store", "_data", "_integrations", "_engine"):
        (root / layer).mkdir(parents=True)
        (root / layer / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / where).write_text(text)
    found = violations(root)
    assert len(found) == 1 and caught in found[0], found
    (root / where).write_text("from m2n_async._proto.errors import PlanError\n")
    assert violations(root) == []
