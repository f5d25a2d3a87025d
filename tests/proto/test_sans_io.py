"""The sans-IO core must not import I/O, clocks or torch (DESIGN §2)."""

import ast
from pathlib import Path

import m2n_async._proto as proto

FORBIDDEN = {"anyio", "asyncio", "torch", "socket", "time", "trio", "threading"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_proto_imports_no_io() -> None:
    files = sorted(Path(proto.__file__).parent.rglob("*.py"))
    assert files, "no _proto modules found"
    bad = {str(f.name): sorted(_imports(f) & FORBIDDEN) for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("import time\nfrom anyio import sleep\n")
    assert _imports(f) & FORBIDDEN == {"time", "anyio"}
