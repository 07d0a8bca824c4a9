"""Shared fixtures and the automatic test markers.

Markers (declared in pyproject.toml; `make test-fast` deselects all three):
- ``slow``: the test uses the real SmolLM2 (a fixture in ``SLOW_FIXTURES``, directly or through
  another fixture) or is marked by hand because it runs long;
- ``triton``: the test runs Triton kernels under the CPU interpreter (every test in
  ``tests/test_kernels_*.py``; elsewhere marked by hand);
- ``browser``: the test drives Chromium (it uses the ``chromium`` fixture).
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Triton kernels are tested on CPU through its interpreter; it must be set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # a parallel worker (`make test` runs two) gets COLUMNS=80 in its environment, which the
    # CLI honours (kvlens.cli.common): the tables of a serial run (LOG_WIDTH wide) instead
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)
    # one torch thread per worker: two workers share the cores instead of oversubscribing them
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# recommend's kept measurements (kvlens.recommend.reuse) go to a directory of this test run's
# own, so that no test reads what another run (or the user) measured; removed when it ends
os.environ["KVLENS_MEASUREMENT_CACHE"] = tempfile.mkdtemp(prefix="kvlens-test-measurements-")
atexit.register(shutil.rmtree, os.environ["KVLENS_MEASUREMENT_CACHE"], ignore_errors=True)
sys.path.insert(0, str(Path(__file__).parent))

SLOW_FIXTURES = frozenset({"smollm2", "smollm2_tokenizer"})
BROWSER_FIXTURES = frozenset({"chromium"})
TRITON_FILES = "test_kernels_*.py"


def auto_markers(path: Path, fixturenames) -> set[str]:
    """The markers a test gets from what it uses: its fixtures (with the fixtures they use)
    and the file it is in."""
    used = set(fixturenames)
    marks = set()
    if used & SLOW_FIXTURES:
        marks.add("slow")
    if used & BROWSER_FIXTURES:
        marks.add("browser")
    if path.match(TRITON_FILES):
        marks.add("triton")
    return marks


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in sorted(auto_markers(item.path, getattr(item, "fixturenames", ()))):
            item.add_marker(name)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (loaded once per test session)."""
    from kvlens.model.load import load_model

    model, tokenizer, source = load_model(None, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A small byte-level BPE tokenizer trained offline (tiny_models.tiny_tokenizer): for
    tests that need a real tokenizer but not SmolLM2's."""
    from tiny_models import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama saved as a local HF directory with the tiny tokenizer, so CLI tests
    exercise the directory-loading path in seconds without loading SmolLM2."""
    from tiny_models import save_model_dir, tiny_config

    config = tiny_config("llama")
    config.vocab_size = len(tiny_tokenizer)
    return save_model_dir(tmp_path_factory.mktemp("tiny-llama"), config, tiny_tokenizer)


@pytest.fixture()
def text_file(tmp_path):
    """A short English text file for `--text` (about 1.8k tokens of the tiny tokenizer)."""
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 80, encoding="utf-8")
    return path


@pytest.fixture()
def patched_model(monkeypatch, smollm2):
    """SmolLM2 loaded once, handed to every `load_model` call of the test (CLI tests): the
    function and every module's name for it (the modules that bind it are imported first, so
    none keeps the patched one after the test)."""
    import kvlens.capture.run  # noqa: F401
    import kvlens.capture.source  # noqa: F401
    import kvlens.model.load as load

    original = load.load_model
    patched = lambda *a, **k: (*smollm2, None)  # noqa: E731
    for module in list(sys.modules.values()):
        if getattr(module, "load_model", None) is original:
            monkeypatch.setattr(module, "load_model", patched)
    return smollm2


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of a Chromium binary for the report's browser test; fails saying how to install
    one, or skips when $KVLENS_SKIP_BROWSER_TESTS=1."""
    from browser import SKIP_ENV, find_chromium

    binary = find_chromium()
    if binary:
        return binary
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"Chromium not installed and {SKIP_ENV}=1")
    pytest.fail("The report's browser test needs Chromium and found none (chromium, "
                "chromium-browser or google-chrome on PATH, or an executable $KVLENS_CHROMIUM; "
                f"here KVLENS_CHROMIUM={os.environ.get('KVLENS_CHROMIUM')!r}). Install it: "
                "`apt-get install -y chromium` (`make test` does this as root on Debian); or set "
                f"{SKIP_ENV}=1 to skip this test deliberately.", pytrace=False)
