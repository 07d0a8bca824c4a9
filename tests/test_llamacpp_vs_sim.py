"""benchmarks/llamacpp_vs_sim.py: the simulated-vs-real table on planted result files."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("llamacpp_vs_sim",
                                                  ROOT / "benchmarks" / "llamacpp_vs_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kld(v):
    return {"mean_kld": {"value": v, "ci95": [v * 0.9, v * 1.1]}}


def test_table_matches_pairs_ratios_and_ranks():
    mod = _module()
    real = {"results": [{"type_k": "q8_0", "type_v": "q8_0", **_kld(0.004)},
                        {"type_k": "q8_0", "type_v": "q4_0", **_kld(0.010)},
                        {"type_k": "q4_0", "type_v": "q4_0", **_kld(0.050)},
                        {"type_k": "q5_1", "type_v": "q5_1", **_kld(0.02)}]}
    sim = {"results": [{"name": "exact", "kld": _kld(0.0)},
                       {"name": "llamacpp:q8_0/q8_0", "kld": _kld(0.0002)},
                       {"name": "llamacpp:q8_0/q4_0", "kld": _kld(0.012)},
                       {"name": "llamacpp:q4_0", "kld": _kld(0.045)},
                       {"name": "llamacpp:q4_0:noarith", "kld": _kld(0.04)}]}
    lines, missing = mod.table(mod._real(json.loads(json.dumps(real))), mod._sim(sim), 1.5)
    text = "\n".join(lines)
    assert "| q8_0/q8_0 | 0.0040 [0.0036, 0.0044] | 0.0002" in text
    assert "| 0.05 | no |" in text  # 0.0002 / 0.004
    assert "| q8_0/q4_0 | 0.0100 [0.0090, 0.0110] | 0.0120 [0.0108, 0.0132] | 1.20 | yes |" \
        in text
    assert "Spearman rank correlation over 3 pairs: 1.00" in text
    assert missing == [("q5_1", "q5_1")]
    assert mod.spearman([1, 2, 3], [3, 2, 1]) == -1.0
