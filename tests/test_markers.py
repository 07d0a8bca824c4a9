"""The automatic markers (tests/conftest.py) and `make test-fast`'s selection: collected in a
subprocess with the Makefile's own expression, the fast subset keeps the tiny-model CLI tests
and drops every test of the real model, the Triton interpreter and the browser."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fast_expression() -> str:
    match = re.search(r"^FAST_TESTS\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile defines FAST_TESTS"
    return match.group(1).strip()


def _collect(expression: str, *files: str) -> tuple[set[str], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
         "-m", expression, *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    return ids, proc.stdout


def test_fast_subset_drops_slow_triton_and_browser_tests():
    expression = _fast_expression()
    assert expression == "not slow and not triton and not browser"
    ids, out = _collect(expression, "tests/test_smollm2.py", "tests/test_kernels_decode.py",
                        "tests/test_report.py", "tests/test_rotation_cache.py",
                        "tests/test_generate_cli.py")
    files = {i.split("::")[0] for i in ids}
    # slow through the smollm2 fixture; triton by file name
    assert "tests/test_smollm2.py" not in files and "tests/test_kernels_decode.py" not in files
    gone = {"tests/test_report.py::test_report_in_headless_chromium",  # chromium fixture
            "tests/test_rotation_cache.py::test_triton_generates_like_torch_with_rotation",  # by hand
            "tests/test_generate_cli.py::test_generate_json_compare"}  # smollm2 via patched_model
    assert not gone & ids
    kept = {"tests/test_report.py::test_each_command_leaves_its_artifact",
            "tests/test_rotation_cache.py::test_bad_rotation_settings_are_refused",
            "tests/test_generate_cli.py::test_generate_kld_table"}  # tiny_model_dir: not slow
    assert kept <= ids, out
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", out), out
