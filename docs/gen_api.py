"""Generate docs/api.md: the reference of every name in ``m2n_async.__all__``, from docstrings.

Theory of operation: the public API is exactly ``m2n_async.__all__`` (DESIGN §2), so the
reference is rendered from it and nothing else — a name added to ``__all__`` appears here, a
name removed disappears, and ``tests/integrations/test_docs.py`` fails while the committed
file is stale. Each name's section comes from the private module that defines it (found by
reading ``m2n_async/__init__.py``'s imports, so constants and aliases are placed too);
constants take the attribute docstring that follows their assignment in that module's
source, as Sphinx would. Output is deterministic: definition order within a class, sorted
names within a section, sets rendered sorted, no memory addresses.

Run ``python docs/gen_api.py`` to rewrite docs/api.md; ``--check`` exits 1 if it is stale.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The public surface: the package's ``__all__`` and its public subpackages' (DESIGN §2).
PUBLIC_PACKAGES = ("m2n_async", "m2n_async.testing")
OUT = ROOT / "docs" / "api.md"

# Section of each defining module, in the order the reference presents them.
SECTIONS: list[tuple[str, str]] = [
    ("m2n_async._engine", "Engine"),
    ("m2n_async._proto.layout", "Meshes and layouts"),
    ("m2n_async._proto.params", "Parameters"),
    ("m2n_async._proto.plan", "Plans"),
    ("m2n_async._proto.handshake", "Handshake"),
    ("m2n_async._proto.messages", "Wire messages"),
    ("m2n_async._store", "Store"),
    ("m2n_async._data", "Data plane"),
    ("m2n_async._integrations", "Ecosystem: torch modules and plan files"),
    ("m2n_async._proto.errors", "Errors"),
    ("m2n_async.testing", "Testing helpers (`m2n_async.testing`)"),
]
OTHER = "Other"

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _origins(package_init: Path) -> dict[str, str]:
    """Public name -> module it is imported from in ``__init__.py`` (absolute)."""
    tree = ast.parse(package_init.read_text())
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def _source_name(name: str, origin_module: str, init: Path) -> str:
    """The name as defined in its module (``summarize_plan`` may be ``summarize``)."""
    tree = ast.parse(init.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == origin_module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return alias.name
    return name


def _defining_module(obj: Any, origin: str) -> str:
    mod = getattr(obj, "__module__", None)
    if isinstance(obj, type | enum.Enum) or inspect.isfunction(obj):
        if isinstance(mod, str) and mod.startswith("m2n_async"):
            return mod
    return origin


def _attribute_doc(module_name: str, name: str) -> str | None:
    """The string literal right after ``name = ...`` at module level (attribute docstring)."""
    try:
        module = importlib.import_module(module_name)
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return None
    body = ast.parse(source).body
    for i, node in enumerate(body):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and i + 1 < len(body):
            nxt = body[i + 1]
            if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                return inspect.cleandoc(nxt.value.value)
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return _comment_above(source.splitlines(), node.lineno - 1)
    return None


def _comment_above(lines: list[str], index: int) -> str | None:
    """The ``#`` comment block directly above line ``index`` (0-based), as text."""
    block: list[str] = []
    i = index - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        # "#:" is Sphinx's marker for a documenting comment; plain "#" works too.
        block.append(lines[i].lstrip().lstrip("#").lstrip(":").strip())
        i -= 1
    return " ".join(reversed(block)) or None


def _section(module_name: str) -> str:
    best = ""
    title = OTHER
    for prefix, t in SECTIONS:
        if (module_name == prefix or module_name.startswith(prefix + ".")) \
                and len(prefix) > len(best):
            best, title = prefix, t
    return title


def _clean(text: str) -> str:
    return _ADDRESS.sub("", text)


class _Ann(str):
    """A string annotation that prints bare (``x: int``, not ``x: 'int'``)."""

    def __repr__(self) -> str:
        return str(self)


_QUALIFIED = re.compile(r"\bm2n_async(?:\.\w+)*\.(?=[A-Za-z_]\w*\b)")


def _signature(obj: Any, *, method: bool = False) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    if method:  # drop self
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    params = [p.replace(annotation=_Ann(p.annotation)) if isinstance(p.annotation, str) else p
              for p in sig.parameters.values()]
    ret = sig.return_annotation
    sig = sig.replace(parameters=params,
                      return_annotation=_Ann(ret) if isinstance(ret, str) else ret)
    # Types from our private modules print qualified; the public name is the bare one.
    return _QUALIFIED.sub("", _clean(str(sig)))


def _value_repr(value: Any) -> str:
    if isinstance(value, frozenset | set):
        inner = ", ".join(repr(v) for v in sorted(value, key=repr))
        return f"frozenset({{{inner}}})" if isinstance(value, frozenset) else f"{{{inner}}}"
    text = _clean(repr(value))
    if len(text) > 160 and hasattr(value, "__len__"):
        return f"{type(value).__name__}(...)  # {len(value)} entries"
    return text


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    return doc if doc else "*(no docstring)*"


def _own_and_private_bases(cls: type) -> list[tuple[str, Any]]:
    """Members defined on ``cls`` or on a private base of ours (``_Engine``), which users
    reach only through the public subclass; public bases document themselves."""
    seen: set[str] = set()
    out: list[tuple[str, Any]] = []
    for base in cls.__mro__:
        private_ours = (base.__name__.startswith("_")
                        and base.__module__.startswith("m2n_async"))
        if base is not cls and not private_ours:
            continue
        for name, raw in vars(base).items():
            if name not in seen:
                seen.add(name)
                out.append((name, raw))
    return out


def _members(cls: type) -> list[str]:
    lines: list[str] = []
    for name, raw in _own_and_private_bases(cls):
        if name.startswith("_"):
            continue
        if isinstance(raw, property):
            lines.append(f"- **`{name}`** *(property)* — {_first_paragraph(raw.__doc__)}")
        elif isinstance(raw, classmethod | staticmethod):
            func = raw.__func__
            kind = "classmethod" if isinstance(raw, classmethod) else "staticmethod"
            sig = _signature(getattr(cls, name))
            prefix = "async " if inspect.iscoroutinefunction(func) else ""
            lines.append(f"- **`{prefix}{name}{sig}`** *({kind})* — "
                         f"{_first_paragraph(func.__doc__, full=True)}")
        elif inspect.isfunction(raw):
            sig = _signature(raw, method=True)
            prefix = "async " if inspect.iscoroutinefunction(raw) else ""
            kind = " *(async iterator)*" if inspect.isasyncgenfunction(raw) else ""
            doc = _first_paragraph(raw.__doc__, full=True)
            lines.append(f"- **`{prefix}{name}{sig}`**{kind} — {doc}")
    return lines


def _first_paragraph(doc: str | None, *, full: bool = False) -> str:
    if not doc:
        return "*(no docstring)*"
    text = inspect.cleandoc(doc)
    if not full:
        text = text.split("\n\n")[0]
    # Indent continuation lines so Markdown keeps them inside the list item.
    return text.replace("\n", "\n  ")


def _render_one(public: str, obj: Any, module_name: str, source_name: str) -> list[str]:
    out: list[str] = []
    if isinstance(obj, type):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        base = f"({', '.join(bases)})" if bases else ""
        out.append(f"### class `{public}`{base}")
        out.append("")
        out.append(f"```python\n{public}{_signature(obj)}\n```")
        out.append("")
        out.append(_doc(obj))
        members = _members(obj)
        if members:
            out.append("")
            out.extend(members)
    elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
        prefix = "async " if inspect.iscoroutinefunction(obj) else ""
        bare = public.rsplit(".", 1)[-1]
        alias = f" (alias of `{source_name}`)" if source_name != bare else ""
        out.append(f"### `{prefix}{public}()`{alias}")
        out.append("")
        out.append(f"```python\n{prefix}def {public}{_signature(obj)}\n```")
        out.append("")
        out.append(_doc(obj))
    else:
        out.append(f"### `{public}`")
        out.append("")
        out.append(f"```python\n{public} = {_value_repr(obj)}\n```")
        out.append("")
        doc = _attribute_doc(module_name, source_name)
        out.append(doc if doc else "*(no docstring)*")
    out.append("")
    return out


def render() -> str:
    """The full text of docs/api.md for the package as it is importable now."""
    import m2n_async

    grouped: dict[str, list[tuple[str, Any, str, str]]] = {}
    for package_name in PUBLIC_PACKAGES:
        package = importlib.import_module(package_name)
        init = Path(package.__file__ or "")
        origins = _origins(init)
        # Names of a public subpackage are shown qualified: `testing.MemoryStore`.
        qual = package_name.removeprefix("m2n_async").lstrip(".")
        for public in package.__all__:
            if public.startswith("__"):
                continue
            obj = getattr(package, public)
            origin = origins.get(public, package_name)
            module_name = _defining_module(obj, origin)
            source_name = _source_name(public, origin, init)
            shown = f"{qual}.{public}" if qual else public
            grouped.setdefault(_section(module_name), []).append(
                (shown, obj, module_name, source_name))
    order = [t for _, t in SECTIONS if t in grouped]
    if OTHER in grouped:
        order.append(OTHER)
    seen: list[str] = []
    for t in order:
        if t not in seen:
            seen.append(t)
    lines = [
        "# API reference",
        "",
        "<!-- Generated by `python docs/gen_api.py` from the docstrings of the names in",
        "     `m2n_async.__all__` and `m2n_async.testing.__all__`; tests/integrations/",
        "     test_docs.py fails when it is stale.",
        "     Edit the docstrings, not this file. -->",
        "",
        f"Every public name of `m2n_async` {m2n_async.__version__}, by topic. Everything "
        "else (modules",
        "starting with `_`) is private. Concepts: [concepts.md](concepts.md).",
        "",
    ]
    for t in seen:
        names = ", ".join(f"`{p}`" for p, *_ in sorted(grouped[t], key=lambda e: e[0]))
        lines.append(f"- **{t}**: {names}")
    lines.append("")
    for t in seen:
        lines.append(f"## {t}")
        lines.append("")
        for public, obj, module_name, source_name in sorted(grouped[t], key=lambda e: e[0]):
            lines.extend(_render_one(public, obj, module_name, source_name))
    return "\n".join(lines).rstrip("\n") + "\n"


def undocumented() -> list[str]:
    """Public names rendered without a docstring."""
    import m2n_async

    text = render()
    missing = []
    for block in text.split("\n### ")[1:]:
        head, _, body = block.partition("\n")
        first = body.strip().split("\n\n")
        if any(part.strip() == "*(no docstring)*" for part in first[:2]):
            missing.append(head)
    return [m for m in missing if any(n in m for n in m2n_async.__all__)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print("docs/api.md is stale: run `python docs/gen_api.py`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    for name in undocumented():
        print(f"warning: no docstring: {name}", file=sys.stderr)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
