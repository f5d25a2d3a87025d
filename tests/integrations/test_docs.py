"""docs/api.md is generated from the public docstrings and must be current."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
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


# -- what the hand-written pages name must exist ------------------------------------------

ROOT = DOCS.parent
#: The hand-written user pages (api.md and phases.md are generated and checked above).
USER_PAGES = [ROOT / "README.md", *(DOCS / p for p in (
    "concepts.md", "troubleshooting.md", "tuning.md", "vllm.md", "security.md", "testing.md",
    "nccl-m2n.md"))]


def _prose(page: Path) -> str:
    """The page without its fenced blocks (commands, output and vLLM code live there)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def _spans(page: Path) -> list[str]:
    """Every inline code span of the page's prose, whitespace folded."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", _prose(page))]


def _resolve(dotted: str) -> bool:
    """Whether ``a.b.c`` names an importable module or an attribute of one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def _public_classes() -> dict[str, type]:
    import m2n_async.integrations.vllm as vllm
    found: dict[str, type] = {}
    for module, names in ((m2n_async, m2n_async.__all__),
                          (m2n_async.testing, m2n_async.testing.__all__),
                          (vllm, [n for n in vars(vllm) if not n.startswith("_")])):
        for name in names:
            obj = getattr(module, name)
            if isinstance(obj, type) and obj.__module__.startswith("m2n_async"):
                found.setdefault(name, obj)
    return found


def _members(cls: type) -> set[str]:
    """Attributes, dataclass/msgspec fields and annotated instance attributes of ``cls``
    and its bases."""
    names = set(dir(cls))
    for base in cls.__mro__:
        names |= set(getattr(base, "__annotations__", {}))
        names |= set(getattr(base, "__struct_fields__", ()))
        names |= set(getattr(base, "__slots__", ()))
        init = vars(base).get("__init__")
        if init is not None:  # self.x = ... in __init__
            try:
                names |= set(re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(init)))
            except (OSError, TypeError):
                pass
    return names


def test_dotted_m2n_async_names_in_the_docs_exist() -> None:
    """Every ``m2n_async.x.y`` a page names imports."""
    bad = [f"{page.name}: {name}"
           for page in USER_PAGES
           for name in sorted(set(re.findall(r"\bm2n_async(?:\.[A-Za-z_]\w*)+",
                                             _prose(page))))
           # a data-plane identity key, not a module path
           if name != "m2n_async.coalesce" and not _resolve(name)]
    assert not bad, f"names the docs use that do not exist: {bad}"


def test_public_class_members_in_the_docs_exist() -> None:
    """``Class.member`` and ``Class(keyword=...)`` of a public class name real members and
    parameters (``EngineConfig.round_timeout``, ``SyncResult.cast_bytes``,
    ``EngineConfig(coalesce=False)``)."""
    classes = _public_classes()
    bad: list[str] = []
    for page in USER_PAGES:
        for span in _spans(page):
            for cls_name, member in re.findall(r"\b([A-Z]\w+)\.([a-z_]\w*)", span):
                cls = classes.get(cls_name)
                if cls is not None and member not in _members(cls):
                    bad.append(f"{page.name}: {cls_name}.{member}")
            for cls_name, args in re.findall(r"\b([A-Z]\w+)\(([^()]*)", span):
                cls = classes.get(cls_name)
                if cls is None:
                    continue
                try:
                    params = inspect.signature(cls).parameters
                except (TypeError, ValueError):
                    continue
                if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    continue
                for keyword in re.findall(r"(?:^|,)\s*(\w+)\s*=(?!=)", args):
                    if keyword not in params:
                        bad.append(f"{page.name}: {cls_name}({keyword}=...)")
    assert not bad, f"members or parameters the docs name that do not exist: {bad}"


def test_environment_variables_in_the_docs_are_read() -> None:
    """Every ``M2N_ASYNC_*`` variable a page names is one the package reads."""
    source = "\n".join(p.read_text() for p in (ROOT / "m2n_async").rglob("*.py"))
    bad = [f"{page.name}: {var}"
           for page in USER_PAGES
           for var in sorted(set(re.findall(r"\bM2N_ASYNC_[A-Z0-9_]+", page.read_text())))
           if not re.search(rf"[\"']{var}[\"']", source)]
    assert not bad, f"environment variables the docs name that the package never reads: {bad}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``."""
    out = set()
    for line in _prose(page).splitlines():
        if heading := re.match(r"#+ (.*)", line):
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_relative_links_and_anchors_resolve() -> None:
    """Every relative link of a page (``[x](tuning.md#how-auto-chooses)``) reaches a file
    and, for a Markdown target, a heading."""
    pages = [*USER_PAGES, DOCS / "api.md", DOCS / "phases.md"]
    bad: list[str] = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path) if path else page
            if not target.exists():
                bad.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                bad.append(f"{page.name}: {link} (no such heading)")
    assert not bad, f"broken links: {bad}"


def _cli_help(command: str) -> str:
    import contextlib
    import io

    from m2n_async.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def test_cli_options_in_the_docs_exist() -> None:
    """Every ``--option`` of an ``m2n-async plan|store|demo ...`` command line a page shows
    (in prose or a fenced block) is an option of that command."""
    helps = {c: _cli_help(c) for c in ("plan", "store", "demo")}
    bad: list[str] = []
    for page in USER_PAGES:
        for command, rest in re.findall(r"m2n-async (plan|store|demo)\b([^`\n]*)",
                                        page.read_text()):
            for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest.split("#")[0]):
                if not re.search(rf"(?<![\w-]){option}(?![\w-])", helps[command]):
                    bad.append(f"{page.name}: m2n-async {command} {option}")
    assert not bad, f"options the docs show that the CLI does not have: {bad}"
