"""The import graph of ``flexdispatch/``: every module-level and function-level import between its
modules (``if TYPE_CHECKING:`` blocks excluded), the layer each module belongs to, the arrows that
point up a layer, and the circles.

    python scripts/import_graph.py           # layers, then any upward arrow or circle
    python scripts/import_graph.py --dot     # the graph in Graphviz dot
    python scripts/import_graph.py --units   # units (top-level modules and packages, scripts/,
                                             # benchmarks/) and the arrows between them

The layers, bottom to top: what a module may import is its own layer or below.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "flexdispatch"
REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / PACKAGE
CALLERS = ("scripts", "benchmarks")  # NOTE: units outside the package that import it

#: (layer name, module-name prefixes), bottom first. A module's layer is the first whose prefix
#: matches; prefixes are dotted names below ``flexdispatch``.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "types and configs",
        (
            "_checks",
            "_pool",
            "types",
            "backends.deepep.limits",
            "config",
            "traffic",
        ),
    ),
    (
        "routing, layout, permutation",
        ("routing", "layout", "permutation", "distributed", "kernels"),
    ),
    ("backends", ("backends",)),
    ("dispatcher", ("dispatch",)),
    ("model", ("experts", "reference", "moe", "importers")),
    (
        "tools and command line",
        (
            "planner",
            "doctor",
            "bench",
            "launch",
            "cli",
            "integrations",
            "__init__",
            "__main__",
        ),
    ),
)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def layer_of(mod: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if mod == p or mod.startswith(p + "."):
                return i
    raise KeyError(f"module {mod!r} has no layer: add it to LAYERS in scripts/import_graph.py")


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, me: str, is_pkg: bool) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == PACKAGE or a.name.startswith(PACKAGE + "."):
                        found.add(a.name[len(PACKAGE) + 1 :] or "__init__")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = me.split(".") if is_pkg else me.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)] if child.level > 1 else pkg
                    base = ".".join([*pkg, base] if base else pkg)
                    full = PACKAGE + ("." + base if base else "")
                else:
                    full = base
                if full != PACKAGE and not full.startswith(PACKAGE + "."):
                    continue
                sub = full[len(PACKAGE) + 1 :]
                for a in child.names:
                    cand = f"{sub}.{a.name}" if sub else a.name
                    # "from pkg import submodule" names the submodule; "from mod import name"
                    # names the module (resolved against the real files in graph()).
                    found.add(f"{cand}|{sub or '__init__'}")
            visit(child)

    visit(tree)
    return found


def graph() -> dict[str, set[str]]:
    """``{module: {modules it imports}}`` over the package's own modules."""
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    files.setdefault("__init__", ROOT / "__init__.py")
    out: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        raw = _imports(ast.parse(path.read_text(), str(path)), mod, is_pkg)
        deps = set()
        for d in raw:
            cand, _, base = d.partition("|")
            target = cand if cand in files else (base or cand)
            if target in files and target != mod:
                deps.add(target)
        out[mod] = deps
    return out


def unit_of(mod: str) -> str:
    """The top-level module or package ``mod`` belongs to."""
    return mod.split(".")[0]


def units() -> tuple[set[str], set[tuple[str, str]]]:
    """``(units, arrows)``: the package's top-level modules and packages plus ``scripts/`` and
    ``benchmarks/``, and the imports between different units (a package's modules importing
    each other are one unit)."""
    g = graph()
    names = {unit_of(m) for m in g}
    arrows = {(unit_of(a), unit_of(b)) for a, deps in g.items() for b in deps}
    arrows = {(a, b) for a, b in arrows if a != b}
    for folder in CALLERS:
        names.add(folder)
        for path in sorted((REPO / folder).rglob("*.py")):
            for d in _imports(ast.parse(path.read_text(), str(path)), "", False):
                cand, _, base = d.partition("|")
                for target in (cand, base):
                    if target and unit_of(target) in names and target != "__init__":
                        arrows.add((folder, unit_of(target)))
                        break
                else:
                    arrows.add((folder, "__init__"))
    return names, arrows


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return comps


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows from a module to a module of a higher layer. A package's ``__init__`` re-exporting
    its own submodules is not an arrow up."""
    bad = []
    for a, deps in sorted(g.items()):
        for b in sorted(deps):
            if b.startswith(a + ".") or (a == "__init__"):
                continue
            if layer_of(b) > layer_of(a):
                bad.append((a, b))
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dot", action="store_true", help="print the graph in Graphviz dot")
    ap.add_argument("--units", action="store_true", help="count the units and their arrows")
    args = ap.parse_args(argv)
    if args.units:
        names, arrows = units()
        print(f"{len(names)} units, {len(arrows)} arrows")
        for a, b in sorted(arrows):
            print(f"  {a} -> {b}")
        return 0
    g = graph()
    if args.dot:
        print("digraph flexdispatch {")
        for a, deps in sorted(g.items()):
            for b in sorted(deps):
                print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    for i, (name, _) in enumerate(LAYERS):
        mods = sorted(m for m in g if layer_of(m) == i)
        print(f"{i} {name}: {' '.join(mods)}")
    up, circ = upward(g), circles(g)
    for a, b in up:
        print(f"UP  {a} -> {b}")
    for c in circ:
        print(f"CIRCLE {' <-> '.join(c)}")
    return 1 if up or circ else 0


if __name__ == "__main__":
    raise SystemExit(main())
