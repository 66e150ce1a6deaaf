"""The package layering holds: imports only go down, and no module imports itself back.

Every `import` and `from ... import` of every module counts: at module level, inside functions
(lazy imports), and under `if TYPE_CHECKING:`. A cycle hidden behind a function-level import
is still a cycle. The allowed dependencies, bottom to top:

    kvmesh.api (generated)  <  kvmesh.runtime  <  kvmesh.workers, kvmesh.router, kvmesh.planner
    <  kvmesh.frontend (its process embeds the router)  <  kvmesh.sim  <  kvmesh.apps
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORTIONS = ["runtime", "frontend", "router", "workers", "planner", "sim", "apps"]

BASE = {"kvmesh.api", "kvmesh.runtime"}
ALLOWED: dict[str, set[str]] = {
    "kvmesh.runtime": {"kvmesh.api"},
    "kvmesh.workers": BASE,
    "kvmesh.router": BASE,
    "kvmesh.planner": BASE,
    "kvmesh.frontend": BASE | {"kvmesh.router"},
    "kvmesh.sim": BASE | {"kvmesh.workers", "kvmesh.router", "kvmesh.planner"},
    "kvmesh.apps": BASE
    | {"kvmesh.workers", "kvmesh.router", "kvmesh.planner", "kvmesh.frontend", "kvmesh.sim"},
    "kvmesh": {"kvmesh.apps"},  # kvmesh.__main__
}

pytestmark = pytest.mark.unit


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for portion in PORTIONS:
        base = ROOT / portion
        assert not (base / "kvmesh" / "__init__.py").exists(), f"{portion}/kvmesh is a portion"
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """kvmesh modules (or packages) `module` imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.add(target)
            # `from pkg import submodule` imports the submodule too
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return {m for m in out if m == "kvmesh" or m.startswith("kvmesh.")}


def _layer(module: str) -> str:
    """kvmesh.<portion>, or kvmesh for modules at the namespace root (kvmesh.__main__)."""
    parts = module.split(".")
    if len(parts) > 1 and (parts[1] in PORTIONS or parts[1] == "api"):
        return f"kvmesh.{parts[1]}"
    return "kvmesh"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph[name] = {m for m in _imports(name, path, known) if m in known and m != name}
    return graph


def test_imports_only_go_down() -> None:
    bad = []
    for name, path in _modules().items():
        layer = _layer(name)
        for target in _imports(name, path, set()):
            tl = _layer(target)
            if tl != layer and tl not in ALLOWED[layer]:
                bad.append(f"{name} imports {target} ({layer} may not depend on {tl})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over the module graph: all of size one."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path: Path) -> None:
    """The checker itself can fail: a function-level import is an edge."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from kvmesh.frontend.app import build_app\n")
    assert _imports("kvmesh.router.m", src, set()) == {"kvmesh.frontend.app"}
