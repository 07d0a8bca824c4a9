"""The package's layer rule (docs/internals/architecture.md), checked over the source's imports.

kvlens is a stack of layers; a module may import kvlens modules of its own layer or of a lower
one, never of a higher one, and the import graph has no cycle. Library modules import kvlens at
module top (an import hidden in a function hides a cycle); the one exception is ``kvlens.cli``,
whose commands import the library when they run so that ``kvlens --help`` does not load torch.
``kvlens_kernels`` (kernels/) takes tensors and ints and imports nothing of kvlens.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first. A module's layer is its first name under kvlens (package or top module).
LAYERS = ("errors", "text", "rope", "quant", "config", "model", "capture", "cache", "analysis",
          "evaluation", "recommend", "deploy", "plots", "report", "cli")
RANK = {name: i for i, name in enumerate(LAYERS)}
LAZY_ALLOWED = ("kvlens.cli",)  # command bodies import the library lazily (--help stays instant)


def _modules(package_dir: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules(ROOT / "kvlens", "kvlens")
KERNELS = _modules(ROOT / "kernels" / "kvlens_kernels", "kvlens_kernels")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the root package: imports nothing
    return "cli" if parts[1] == "__main__" else parts[1]


def _target(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, known: dict[str, Path]):
    """``(target module, line, at module top)`` for every import of a module in ``known``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        # TYPE_CHECKING blocks at module top count as top
        found = {_target(n, known) for n in names} - {None, module}
        # ``from pkg import submodule`` names the submodule; drop the package itself then
        for t in sorted(found):
            if not any(o != t and o.startswith(t + ".") for o in found):
                yield t, node.lineno, id(node) in top


def _edges():
    return {m: list(_imports(m, p, MODULES)) for m, p in MODULES.items()}


def test_every_module_is_in_a_layer():
    unknown = sorted(m for m in MODULES if _layer(m) is not None and _layer(m) not in RANK)
    assert not unknown, f"modules outside the layer rule (add them to LAYERS and the doc): {unknown}"


def test_imports_point_down_the_layers():
    bad = []
    for m, edges in _edges().items():
        lm = _layer(m)
        for t, line, _ in edges:
            lt = _layer(t)
            if lm is None or lt is None:
                if lt is not None:
                    bad.append(f"{m}:{line} -> {t} (the root package imports nothing)")
                continue
            if RANK[lt] > RANK[lm]:
                bad.append(f"{m}:{line} -> {t} ({lm} may not import {lt})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in edges} for m, edges in _edges().items()}
    # A package's __init__ re-exporting its submodules is not a cycle with them.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m.startswith(t + ".") and MODULES[t].name == "__init__.py")}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_library_imports_kvlens_at_module_top():
    hidden = [f"{m}:{line} -> {t}" for m, edges in _edges().items()
              if not m.startswith(LAZY_ALLOWED) for t, line, top in edges if not top]
    assert not hidden, ("kvlens imports inside functions (move them to the module top; a cycle "
                        "they hid means a module is in the wrong layer):\n" + "\n".join(hidden))


def test_kernels_import_nothing_of_kvlens():
    bad = []
    for m, path in KERNELS.items():
        for t, line, _ in _imports(m, path, MODULES):
            bad.append(f"{m}:{line} -> {t}")
    assert not bad, "kvlens_kernels must take tensors and ints only:\n" + "\n".join(bad)


@pytest.mark.parametrize("planted", ["upward", "cycle"])
def test_the_checks_catch_a_planted_violation(tmp_path, planted):
    """The rule can fail: a fake tree with an upward import / a cycle is caught."""
    pkg = tmp_path / "kvlens"
    (pkg / "quant").mkdir(parents=True)
    (pkg / "cli").mkdir()
    for p in (pkg / "__init__.py", pkg / "quant" / "__init__.py", pkg / "cli" / "__init__.py"):
        p.write_text("")
    if planted == "upward":
        (pkg / "quant" / "a.py").write_text("from kvlens.cli import main\n")
    else:
        (pkg / "quant" / "a.py").write_text("from kvlens.quant import b\n")
        (pkg / "quant" / "b.py").write_text("import kvlens.quant.a\n")
    mods = _modules(pkg, "kvlens")
    edges = {m: list(_imports(m, p, mods)) for m, p in mods.items()}
    if planted == "upward":
        assert ("kvlens.cli", 1, True) in edges["kvlens.quant.a"]
        assert RANK[_layer("kvlens.cli")] > RANK[_layer("kvlens.quant.a")]
    else:
        assert {t for t, _, _ in edges["kvlens.quant.a"]} == {"kvlens.quant.b"}
        assert {t for t, _, _ in edges["kvlens.quant.b"]} == {"kvlens.quant.a"}
