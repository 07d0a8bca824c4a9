"""The lab in its own room (issue #57): MiKV set twins are a research candidate extension
(``kvlens.research.mikv``) registered into stable recommend's extension point
(``kvlens.recommend.extension``) when ``kvlens.research`` is imported; stable recommend names no
research lever, and asking for one without the import is a clear error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import set_of, set_twin

import kvlens.research  # noqa: F401  (registers the MiKV set twins)
from kvlens.errors import InputError
from kvlens.recommend import Candidate, CandidateExtension, RecommendOptions, Twin
from kvlens.recommend.extension import fold_levers, lever_fields, registered
from kvlens.research.mikv import MikvSets

ROOT = Path(__file__).resolve().parents[1]
#: what the MiKV set experiment's code is called; none of it may appear in stable recommend
RESEARCH_WORDS = ("heavy_hitters", "mikv_set", "set_membership", "set_reconstruction",
                  "MIKV_", "set_bits", '"mikv"', "THOROUGH")


def test_mikv_sets_are_a_registered_extension():
    assert registered()["mikv"] is MikvSets and isinstance(MikvSets(), CandidateExtension)
    assert {"mikv", "mikv_set_bits", "mikv_fractions"} <= set(lever_fields())
    opts = RecommendOptions(budget_bits=3.0, extensions=("mikv",))
    assert opts == RecommendOptions(budget_bits=3.0, extensions=(MikvSets(),))
    assert [t.setting for t in opts.twin_settings()] == [(4, 0.1), (4, 0.2), (8, 0.1), (8, 0.2)]
    c = Candidate("key", 2, "per-token", 32)
    twin = set_twin(c, 8, 0.2)
    assert twin.twin == Twin("mikv", (8, 0.2)) and twin.base == c and set_of(twin) == (8, 0.2)
    assert twin.short == "2b tok G32 set8@0.2" and twin.label.endswith(" +MiKV set 0.2 INT8")
    with pytest.raises(InputError, match="given twice"):
        RecommendOptions(budget_bits=3.0, extensions=("mikv", MikvSets()))


def test_levers_fold_into_the_extension():
    """``--set mikv=on --set mikv-bits=4`` (flat lever fields) become one settings object; a
    setting given with the switch off is checked, then unused."""
    assert fold_levers({"budget_bits": 3, "mikv": True, "mikv_set_bits": (4,)}) == \
        {"budget_bits": 3, "extensions": (MikvSets(set_bits=(4,)),)}
    assert fold_levers({"budget_bits": 3, "mikv": False}) == {"budget_bits": 3}
    with pytest.raises(InputError, match="allowed: 4, 8"):
        fold_levers({"mikv": False, "mikv_set_bits": (3,)})


def test_the_experiment_without_its_import_is_a_clear_error():
    """A library user who asks for MiKV twins by name, or reads a twin (a kept measurement's),
    without importing kvlens.research is told what to import."""
    code = """
from kvlens.errors import InputError
from kvlens.recommend import Candidate, RecommendOptions
from kvlens.recommend.extension import Twin
for ask in (lambda: RecommendOptions(budget_bits=3, extensions=("mikv",)),
            lambda: Candidate("key", 2, "per-token", 32, twin=Twin("mikv", (4, 0.1))).label):
    try:
        ask()
    except InputError as e:
        print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) == 2 and all("import kvlens.research" in line for line in out), out


def test_stable_recommend_names_no_research_lever():
    for path in sorted((ROOT / "kvlens" / "recommend").glob("*.py")):
        text = path.read_text()
        found = [w for w in RESEARCH_WORDS if w in text]
        assert not found, f"{path.name} names {found}"


def test_stable_modules_name_neither_mikv_nor_thorough():
    """Issue #57: MiKV (its twins, its set, its levers) is reached through the research door
    only, and ``--thorough`` is gone; the stable packages name neither, except a lab note's
    file name and the old section name a config file is refused for (``kvlens.config.io.OLD``)."""
    for pkg in ("config", "cache", "recommend", "deploy", "cli"):
        for path in sorted((ROOT / "kvlens" / pkg).rglob("*.py")):
            lines = [re.sub(r"docs/lab-notes/[\w./#-]+", "", line)
                     for line in path.read_text().splitlines()
                     if not line.startswith(("#", 'OLD = "mikv"'))]
            found = {w for w in ("mikv", "thorough") for line in lines if w in line.lower()}
            assert not found, f"{path.relative_to(ROOT)} names {sorted(found)}"


def test_cache_and_config_name_no_heavy_hitters_and_need_the_research_import():
    """Stage 2 (issue #57): MiKV's importance set (heavy hitters, coded set rows, its layers,
    its presets) is a research set policy (``kvlens.research.sets``) plugged into the cache's
    ``kvlens.cache.sets`` and the config's ``kvlens.config.extension``; without
    ``kvlens.research`` a config or preset that asks for it is a clear ``ConfigError``, while
    the stable sinks and balancer load."""
    words = ("heavy_fraction", "heavy hitter", "set_bits", "is_hp", "H2O", "mikv-2")
    for pkg in ("cache", "config"):
        for path in sorted((ROOT / "kvlens" / pkg).glob("*.py")):
            text = path.read_text().lower()
            assert not [w for w in words if w.lower() in text], path
    code = (
        "from kvlens.config import config_from_dict, preset, KVConfig, LayerKV\n"
        "from kvlens.errors import ConfigError\n"
        "base = {'format': 'kvlens.kvconfig', 'version': 1, 'name': 'x', 'default': {}}\n"
        "sinks = config_from_dict(base | {'protect': {'sink_tokens': 4, 'balancer': 'off',"
        " 'balancer_exponent': 0.5}})\n"
        "assert sinks.protect.sink_tokens == 4 and sinks.protect.importance is None\n"
        "for bad in (lambda: config_from_dict(base | {'importance': {'heavy_fraction': 0.2}}),"
        " lambda: preset('mikv-2')):\n"
        "    try:\n"
        "        bad()\n"
        "    except ConfigError as exc:\n"
        "        assert 'kvlens.research is imported' in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
        "import sys; assert 'kvlens.research' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
