"""The package's layer rule (docs/internals/architecture.md), checked over the source's imports.

kvlens is a stack of layers; a module may import kvlens modules of its own layer or of a lower
one, never of a higher one, and the import graph has no cycle. No submodule imports its own
package's ``__init__`` (or an enclosing package's): the ``__init__`` imports its submodules, so
that is a cycle through a half-initialised package. Library modules import kvlens at module top
(an import hidden in a function hides a cycle); the one exception is ``kvlens.cli``, whose
commands import the library when they run so that ``kvlens --help`` does not load torch.
``kvlens_kernels`` (kernels/) takes tensors and ints and imports nothing of kvlens. No module
of kvlens is longer than ``MAX_LINES``, and no function longer than ``MAX_FUNCTION_LINES``
(a Typer command counted from its body's first statement after the docstring, so that its
option signature does not count).

Each rule is a ``check_*`` function of a module map (``module_map``) that returns the problems it
finds; the tests run them on the real tree and on planted trees, which they must catch.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first. A module's layer is its first name under kvlens (package or top module).
LAYERS = ("errors", "units", "text", "rope", "quant", "layouts", "config", "model", "capture", "cache",
          "analysis", "evaluation", "recommend", "deploy", "research", "plots", "report", "cli")
RANK = {name: i for i, name in enumerate(LAYERS)}
LAZY_ALLOWED = ("kvlens.cli",)  # command bodies import the library lazily (--help stays instant)
MAX_LINES = 700  # a module longer than this holds more than one meaning: split it
MAX_FUNCTION_LINES = 80  # a longer function does more than one thing: split it into named steps


class Edge(NamedTuple):
    target: str  # the kvlens module imported (a package's name for its __init__.py)
    line: int
    top: bool  # at module top (runs on import), not inside a function or class body


def module_map(package_dir: Path) -> dict[str, Path]:
    """``{dotted module name: path}`` for every ``.py`` under ``package_dir`` (a package's
    ``__init__.py`` under the package's name)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_map(ROOT / "kvlens")
KERNELS = module_map(ROOT / "kernels" / "kvlens_kernels")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the root package: imports nothing
    return "cli" if parts[1] == "__main__" else parts[1]


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that defines dotted ``name`` (the longest known prefix)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(module: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    """Every import in ``path`` (module ``module``) of a module in ``known``, one edge per
    imported module: ``from pkg import sub`` imports the submodule ``pkg.sub``, ``from pkg
    import name`` (a name defined in ``pkg/__init__.py``) the package itself."""
    tree = ast.parse(path.read_text(), str(path))
    top_nodes = {id(node) for node in tree.body}
    is_pkg = path.name == "__init__.py"
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        targets = {_target(n, known) for n in names} - {None, module}
        edges += [Edge(t, node.lineno, id(node) in top_nodes) for t in sorted(targets)]
    return edges


def edges_of(modules: dict[str, Path]) -> dict[str, list[Edge]]:
    return {m: import_edges(m, p, modules) for m, p in modules.items()}


# -- the checks: each takes a module map and returns its problems, one line each ----------------

def check_layers_known(modules: dict[str, Path]) -> list[str]:
    """Modules whose layer is not in ``LAYERS``."""
    return [f"{m} (add its layer to LAYERS and the doc)" for m in sorted(modules)
            if _layer(m) is not None and _layer(m) not in RANK]


def check_upward(modules: dict[str, Path]) -> list[str]:
    """Imports of a higher layer (and any import of kvlens by the root package)."""
    bad = []
    for m, edges in edges_of(modules).items():
        lm = _layer(m)
        for t, line, _ in edges:
            lt = _layer(t)
            if lm is None and lt is not None:
                bad.append(f"{m}:{line} -> {t} (the root package imports nothing)")
            elif lm in RANK and lt in RANK and RANK[lt] > RANK[lm]:
                bad.append(f"{m}:{line} -> {t} ({lm} may not import {lt})")
    return bad


def check_cycles(modules: dict[str, Path]) -> list[str]:
    """Import cycles, every edge counted (a package's ``__init__`` importing its submodules is
    an edge like any other: a submodule importing that ``__init__`` back closes a cycle)."""
    graph = {m: sorted({e.target for e in edges}) for m, edges in edges_of(modules).items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def check_own_package_init(modules: dict[str, Path]) -> list[str]:
    """Submodules importing their own package's ``__init__`` (or an enclosing package's):
    ``kvlens/quant/a.py`` doing ``from kvlens.quant import x``, ``x`` defined in (or
    re-exported by) ``kvlens/quant/__init__.py``. Import ``x`` from the submodule that
    defines it. The root package is exempt (``from kvlens import __version__``): it imports
    nothing (``check_upward``), so importing it closes no cycle."""
    bad = []
    for m, edges in edges_of(modules).items():
        for t, line, _ in edges:
            if "." in t and m.startswith(t + ".") and _is_package(t, modules):
                bad.append(f"{m}:{line} -> {t} (its own package's __init__: import from the "
                           "submodule that defines the name)")
    return bad


def check_hidden_imports(modules: dict[str, Path]) -> list[str]:
    """kvlens imports inside functions or classes, outside ``LAZY_ALLOWED``."""
    return [f"{m}:{e.line} -> {e.target}" for m, edges in edges_of(modules).items()
            if not m.startswith(LAZY_ALLOWED) for e in edges if not e.top]


def check_module_length(modules: dict[str, Path], limit: int = MAX_LINES) -> list[str]:
    """Modules longer than ``limit`` lines."""
    out = []
    for m, path in sorted(modules.items()):
        n = len(path.read_text().splitlines())
        if n > limit:
            root = modules[m.split(".")[0]].parent.parent  # holds the top package
            out.append(f"{path.relative_to(root)}: {n} lines (at most {limit}: split it)")
    return out


def _is_typer_command(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``@<app>.command`` or ``@<app>.command(...)``."""
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "command":
            return True
    return False


def _counted_from(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The first line counted: the ``def`` line, or for a Typer command the first statement
    after its docstring (its option signature is a table of options, not logic)."""
    if not _is_typer_command(fn):
        return fn.lineno
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body[0].lineno if body else fn.end_lineno + 1


def function_lengths(tree: ast.Module) -> list[tuple[str, int, int]]:
    """``(qualified name, def line, counted lines)`` of every function and method in ``tree``,
    nested ones included (``Class.method``, ``outer.inner``)."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.lineno,
                            child.end_lineno - _counted_from(child) + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def check_function_length(modules: dict[str, Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions longer than ``limit`` lines (Typer commands: their body after the docstring)."""
    out = []
    for m, path in sorted(modules.items()):
        root = modules[m.split(".")[0]].parent.parent  # holds the top package
        for name, line, n in function_lengths(ast.parse(path.read_text(), str(path))):
            if n > limit:
                out.append(f"{path.relative_to(root)}:{line} {name}: {n} lines "
                           f"(at most {limit}: split it into named steps)")
    return out


def check_imports_nothing_of(modules: dict[str, Path], forbidden: dict[str, Path]) -> list[str]:
    """Imports, by any module of ``modules``, of a module of ``forbidden``."""
    return [f"{m}:{e.line} -> {e.target}" for m, path in modules.items()
            for e in import_edges(m, path, forbidden)]


# -- the real tree -------------------------------------------------------------------------------

def test_every_module_is_in_a_layer():
    unknown = check_layers_known(MODULES)
    assert not unknown, "modules outside the layer rule:\n" + "\n".join(unknown)


def test_imports_point_down_the_layers():
    bad = check_upward(MODULES)
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = check_cycles(MODULES)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_submodule_imports_its_own_package_init():
    bad = check_own_package_init(MODULES)
    assert not bad, "submodules importing their own package's __init__:\n" + "\n".join(bad)


def test_library_imports_kvlens_at_module_top():
    hidden = check_hidden_imports(MODULES)
    assert not hidden, ("kvlens imports inside functions (move them to the module top; a cycle "
                        "they hid means a module is in the wrong layer):\n" + "\n".join(hidden))


def test_kernels_import_nothing_of_kvlens():
    bad = check_imports_nothing_of(KERNELS, MODULES)
    assert not bad, "kvlens_kernels must take tensors and ints only:\n" + "\n".join(bad)


def test_every_module_is_at_most_max_lines():
    long = check_module_length(MODULES)
    assert not long, "modules too long:\n" + "\n".join(long)


def test_the_recommend_command_stays_thin():
    # issue #57: the CLI parses, calls kvlens.deploy.answer.recommend_run and renders
    module = {"kvlens.cli.recommend": MODULES["kvlens.cli.recommend"]}
    long = check_module_length(module, 350)
    assert not long, "the command holds more than parsing and rendering:\n" + "\n".join(long)


def test_every_function_is_at_most_max_function_lines():
    long = check_function_length(MODULES)
    assert not long, "functions too long:\n" + "\n".join(long)


# -- planted trees: the same checks must catch a planted violation -------------------------------

BASE = {"__init__.py": "", "quant/__init__.py": "", "cli/__init__.py": "",
        "quant/a.py": "import torch\n", "quant/b.py": "X = 1\n"}

PLANTED = {
    "upward import": (check_upward, {"quant/a.py": "from kvlens.cli import main\n"},
                      "kvlens.quant.a:1 -> kvlens.cli (quant may not import cli)"),
    "root package imports": (check_upward, {"__init__.py": "from kvlens.quant import b\n"},
                             "kvlens:1 -> kvlens.quant.b (the root package imports nothing)"),
    "cycle": (check_cycles, {"quant/a.py": "from kvlens.quant import b\n",
                             "quant/b.py": "import kvlens.quant.a\n"},
              "kvlens.quant.a -> kvlens.quant.b -> kvlens.quant.a"),
    # the cycle through a package's __init__: it re-exports a, a imports a name from it
    "cycle through the package init": (
        check_cycles, {"quant/__init__.py": "from kvlens.quant.a import f\nX = 1\n",
                       "quant/a.py": "from kvlens.quant import X\n\n\ndef f():\n    pass\n"},
        "kvlens.quant -> kvlens.quant.a -> kvlens.quant"),
    "own package init": (
        check_own_package_init, {"quant/__init__.py": "from kvlens.quant.a import f\nX = 1\n",
                                 "quant/a.py": "from kvlens.quant import X\n"},
        "kvlens.quant.a:1 -> kvlens.quant (its own package's __init__"),
    # a submodule and a name of the init in one statement: the init is still imported
    "own package init beside a submodule": (
        check_own_package_init, {"quant/__init__.py": "X = 1\n",
                                 "quant/a.py": "from kvlens.quant import b, X\n"},
        "kvlens.quant.a:1 -> kvlens.quant (its own package's __init__"),
    "own package init, relative": (
        check_own_package_init, {"quant/__init__.py": "X = 1\n", "quant/a.py": "from . import X\n"},
        "kvlens.quant.a:1 -> kvlens.quant (its own package's __init__"),
    "enclosing package init": (
        check_own_package_init, {"quant/sub/__init__.py": "", "quant/sub/c.py":
                                 "from kvlens.quant import X\n", "quant/__init__.py": "X = 1\n"},
        "kvlens.quant.sub.c:1 -> kvlens.quant (its own package's __init__"),
    "hidden import": (check_hidden_imports,
                      {"quant/a.py": "def f():\n    from kvlens.quant import b\n"},
                      "kvlens.quant.a:2 -> kvlens.quant.b"),
    "module too long": (check_module_length, {"quant/a.py": "x = 1\n" * (MAX_LINES + 1)},
                        f"kvlens/quant/a.py: {MAX_LINES + 1} lines"),
    "unknown layer": (check_layers_known, {"foo.py": ""}, "kvlens.foo (add its layer"),
    "function too long": (check_function_length,
                          {"quant/a.py": "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES},
                          f"kvlens/quant/a.py:1 f: {MAX_FUNCTION_LINES + 1} lines"),
    "Typer command body too long": (
        check_function_length,
        {"cli/cmd.py": "@app.command()\ndef run(\n    x: int = 1,\n):\n    \"\"\"Doc.\"\"\"\n"
                       + "    x += 1\n" * (MAX_FUNCTION_LINES + 1)},
        f"kvlens/cli/cmd.py:2 run: {MAX_FUNCTION_LINES + 1} lines"),
}


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    pkg = tmp_path / "kvlens"
    for rel, text in {**BASE, **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return module_map(pkg)


CHECKS = (check_layers_known, check_upward, check_cycles, check_own_package_init,
          check_hidden_imports, check_module_length, check_function_length)


def test_the_checks_pass_a_clean_planted_tree(tmp_path):
    """Submodules importing their siblings (``from kvlens.quant import b``: the submodule, not
    the init) and a package init re-exporting them are within the rules."""
    modules = _plant(tmp_path, {"quant/__init__.py": "from kvlens.quant.b import X\n",
                                "quant/a.py": "from kvlens.quant import b\nfrom . import b\n"
                                              "from kvlens.quant.b import X\n",
                                "cli/main.py": "def main():\n    from kvlens.quant import X\n",
                                "quant/c.py": "from kvlens import __version__\n",
                                "quant/d.py": "def f():\n" + "    x = 1\n" * 79})
    for check in CHECKS:
        assert check(modules) == [], check.__name__


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_the_checks_catch_a_planted_violation(tmp_path, planted):
    check, files, expected = PLANTED[planted]
    problems = check(_plant(tmp_path, files))
    assert any(p.startswith(expected) for p in problems), problems


def _source(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


def test_function_lengths_count_a_typer_command_from_its_body():
    """A plain function counts from ``def`` (docstring included); a Typer command from the
    first statement after its docstring, however long its signature; methods and nested
    functions are measured on their own under their qualified names."""
    body = ["    x = 1"] * MAX_FUNCTION_LINES
    source = _source(
        "def plain():", '    """Doc."""', *body[2:],                                 # 1..80
        "@app.command(name='c')", "def command(", *["    x: int = 1,"] * 200, "):",  # 81..283
        '    """Doc."""', *body,                                                       # 284..364
        "class Layer:", "    def method(self):", *["    " + line for line in body],   # 365..446
        "def outer():", "    def inner():", "        pass", "    return inner",          # 447..450
    )
    lengths = {name: (line, n) for name, line, n in function_lengths(ast.parse(source))}
    assert lengths == {"plain": (1, MAX_FUNCTION_LINES), "command": (82, MAX_FUNCTION_LINES),
                       "Layer.method": (366, MAX_FUNCTION_LINES + 1), "outer": (447, 4),
                       "outer.inner": (448, 2)}
    long = [name for name, _, n in function_lengths(ast.parse(source)) if n > MAX_FUNCTION_LINES]
    assert long == ["Layer.method"]


def test_kernels_check_catches_a_planted_import(tmp_path):
    kernels = tmp_path / "kvlens_kernels"
    kernels.mkdir()
    (kernels / "__init__.py").write_text("")
    (kernels / "decode.py").write_text("import torch\nfrom kvlens.quant import b\n")
    problems = check_imports_nothing_of(module_map(kernels), _plant(tmp_path, {}))
    assert problems == ["kvlens_kernels.decode:2 -> kvlens.quant.b"]
