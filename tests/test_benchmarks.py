"""benchmarks/ (rerunnable benchmarks) and benchmarks/studies/ (one-off studies): every script
imports without running and has ``main(argv=None)``; no script imports another script (shared
code belongs in the library) or a private kvlens name (``from kvlens.x import _y``,
``kvlens.x._y``): a script uses the library's public API, as a user would.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py")) + sorted((BENCH / "studies").glob("*.py"))
SCRIPT_NAMES = frozenset(p.stem for p in SCRIPTS) | {"benchmarks", "studies"}
IDS = [str(p.relative_to(BENCH)) for p in SCRIPTS]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def import_problems(source: str, scripts: frozenset[str] = SCRIPT_NAMES) -> list[str]:
    """What a script's ``source`` imports that it may not: another script (a name in
    ``scripts``, or any relative import) or a private kvlens name, imported or reached as an
    attribute of an imported kvlens name. One ``"line: what"`` per problem."""
    tree = ast.parse(source)
    problems = []
    bound: set[str] = set()  # local names bound to kvlens modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in scripts:
                    problems.append(f"{node.lineno}: imports the script {a.name}")
                if top == "kvlens":
                    bound.add(a.asname or "kvlens")
                    if any(_private(p) for p in a.name.split(".")):
                        problems.append(f"{node.lineno}: imports the private {a.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.split(".")[0] in scripts:
                problems.append(f"{node.lineno}: imports the script {'.' * node.level}{module}")
            if module.split(".")[0] == "kvlens":
                for a in node.names:
                    bound.add(a.asname or a.name)
                    parts = [*module.split("."), a.name]
                    if any(_private(p) for p in parts):
                        problems.append(f"{node.lineno}: imports the private {module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                problems.append(f"{node.lineno}: reaches the private {ast.unparse(node)}")
    return problems


def has_main_guard(source: str) -> bool:
    """Whether the module's top level has ``if __name__ == "__main__":``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            parts = [node.test.left, *node.test.comparators]
            names = {p.id for p in parts if isinstance(p, ast.Name)}
            consts = {p.value for p in parts if isinstance(p, ast.Constant)}
            if names == {"__name__"} and consts == {"__main__"}:
                return True
    return False


def load_script(path: Path):
    """Import the script at ``path`` as a module (its ``__main__`` block does not run)."""
    name = f"_kvlens_bench_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the body runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_the_scripts_are_found_and_named_once():
    assert len(SCRIPTS) > 10 and any(p.parent.name == "studies" for p in SCRIPTS)
    stems = [p.stem for p in SCRIPTS]
    assert len(stems) == len(set(stems)), "a study and a benchmark share a name"


@pytest.mark.parametrize("path", SCRIPTS, ids=IDS)
def test_script_imports_nothing_it_may_not(path):
    problems = import_problems(path.read_text())
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", SCRIPTS, ids=IDS)
def test_script_imports_without_running_and_main_takes_argv(path, capsys):
    source = path.read_text()
    assert has_main_guard(source), f"{path.name}: no `if __name__ == \"__main__\":` guard"
    module = load_script(path)
    main = getattr(module, "main", None)
    assert callable(main), f"{path.name} has no main()"
    argv = inspect.signature(main).parameters.get("argv")
    assert argv is not None and argv.default is None, f"{path.name}: main(argv=None) expected"
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])  # parses the argv it is given (not pytest's): help, and nothing run
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_the_makefile_bench_target_runs_scripts_that_exist():
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "the Makefile has no bench target"
    paths = re.findall(r"benchmarks/\S+\.py", recipe.group(1))
    assert paths, "the bench target runs no benchmark"
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"the bench target runs scripts that do not exist: {missing}"


PLANTED = {
    "another script": ("from fisher_rates import compare\n", "imports the script fisher_rates"),
    "a study package": ("import studies.layout_rates\n", "imports the script studies"),
    "a relative import": ("from . import helpers\n", "imports the script ."),
    "a private name": ("from kvlens.cache.torch_read import _unpack_rows\n",
                       "imports the private kvlens.cache.torch_read._unpack_rows"),
    "a private module": ("import kvlens.cache._impl\n", "imports the private kvlens.cache._impl"),
    "a private attribute": ("import kvlens.recommend.sensitivity as s\nx = s._run\n",
                            "reaches the private s._run"),
    "a private attribute of an imported module": (
        "from kvlens.cache import torch_read\ntorch_read._unpack_rows(1, 2)\n",
        "reaches the private torch_read._unpack_rows"),
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_the_import_check_catches_a_planted_violation(planted):
    source, expected = PLANTED[planted]
    problems = import_problems(source, frozenset({"fisher_rates", "benchmarks", "studies"}))
    assert any(expected in p for p in problems), problems


def test_the_import_check_passes_public_imports_and_dunders():
    source = ("import json\nfrom kvlens.recommend import RecommendOptions, choose\n"
              "import kvlens.cache.attention as attention\nattention.triton_decode = None\n"
              "fields = RecommendOptions.__dataclass_fields__\nfrom scipy.stats import _x\n")
    assert import_problems(source, frozenset({"fisher_rates"})) == []


def test_the_main_guard_check():
    assert has_main_guard('def main(argv=None):\n    pass\n\nif __name__ == "__main__":\n'
                          "    main()\n")
    assert not has_main_guard("def main(argv=None):\n    pass\n\nmain()\n")
