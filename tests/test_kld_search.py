"""An engine target's ``--max-kld`` choice (``kvlens.deploy.kld_search``): the chosen setting's
KLD is measured, a prediction that was wrong in the unsafe direction is caught and the choice
moves on, the number of checks is capped, and no setting is measured twice."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from kvlens.deploy.kld_search import ANCHOR, CHECK, search_kld
from kvlens.deploy.targets import TargetCandidate
from kvlens.errors import ConfigError

# a Pareto front (bits ascending, S descending) on the power law KLD = 0.01 * S; with three
# anchors they are the 4-, 8- and 16-bit settings (lowest, middle and highest log S)
FRONT = [(4.0, 2.0), (5.0, 1.0), (6.0, 0.5), (7.0, 0.25), (7.5, 0.2), (7.75, 0.15),
         (8.0, 0.12), (9.0, 0.06), (10.0, 0.03), (12.0, 0.015), (16.0, 0.0075)]


def _front() -> list[TargetCandidate]:
    return [TargetCandidate(f"{b:g}b", None, b, [(s ** 0.5, 0.0)], {}) for b, s in FRONT]


def _options(max_kld: float, budget_bits: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(target="vllm", max_kld=max_kld, budget_bits=budget_bits, anchors=3,
                           eval_tokens=256)


class Truth:
    """The measurement: KLD = 0.01 * S times ``factor`` for the settings in ``worse``; it
    records every setting it is asked to measure."""

    def __init__(self, worse: dict[str, float]):
        self.worse, self.calls = worse, []

    def __call__(self, cands: list) -> list[dict]:
        self.calls.append([c.setting for c in cands])
        return [{"setting": c.setting, "mean_kld": 0.01 * c.score * self.worse.get(c.setting, 1),
                 "ci95": [0.0, 1.0], "bits_per_element": c.bits, "top1_agreement": 1.0}
                for c in cands]

    @property
    def measured(self) -> list[str]:
        return [s for call in self.calls for s in call]


def test_a_prediction_wrong_in_the_unsafe_direction_is_measured_and_replaced():
    """The predictor (fitted on the 4-, 8- and 16-bit anchors, exact there) puts the 7-bit
    setting at 0.0025 <= 0.004; it measures 0.0075. The search measures it, refits and checks
    again, one setting at a time, until its choice is measured within the bound: 7.5 bits
    (0.002), the cheapest setting truly within it, never the 7-bit setting that prediction
    alone would have answered."""
    truth = Truth({"7b": 3.0})
    found = search_kld(_front(), _options(0.004), truth)
    assert truth.calls[:2] == [["16b", "8b", "4b"], ["7b"]]
    assert all(len(call) == 1 for call in truth.calls[1:]) and len(truth.calls) <= 5
    assert found.chosen.setting == "7.5b"
    m = found.measured
    assert m["7.5b"]["mean_kld"] == pytest.approx(0.002) and m["7.5b"]["role"] == CHECK
    bad = m["7b"]
    assert bad["role"] == CHECK and bad["predicted_kld"] == pytest.approx(0.0025)
    assert bad["mean_kld"] == pytest.approx(0.0075)
    assert [m[s]["role"] for s in ("4b", "8b", "16b")] == [ANCHOR] * 3
    assert m["4b"]["predicted_kld"] is None and m["4b"]["eval_tokens"] == 256
    # every measurement is a point of the final predictor, which passes through them
    assert len(found.model.points) == len(truth.measured)
    assert found.model.predict(0.25) == pytest.approx(0.0075)
    assert found.notes == []


def test_a_choice_already_measured_is_not_measured_again():
    """When the cheapest setting within the bound is an anchor (8 bits at 0.0012 <= 0.002),
    it is the answer with no further measurement; a budget that excludes the cheaper ones
    still answers a measured setting."""
    truth = Truth({})
    found = search_kld(_front(), _options(0.0013), truth)
    assert found.chosen.setting == "8b" and truth.calls == [["16b", "8b", "4b"]]
    truth = Truth({})
    found = search_kld(_front(), _options(0.004, budget_bits=7.2), truth)
    assert found.chosen.setting == "7b" and found.measured["7b"]["role"] == CHECK
    assert len(truth.measured) == len(set(truth.measured)) == 4


def test_the_checks_are_capped_and_then_the_cheapest_measured_setting_is_answered():
    """Every setting between the anchors measures 4x the power law: after one check (7 bits,
    over) the next choice is left unmeasured, the answer is the cheapest measured setting
    within the bound (the 8-bit anchor) and a note names the unmeasured one; with more checks
    allowed the search measures on until its choice is that anchor, with no note."""
    truth = Truth({s: 4.0 for s in ("5b", "6b", "7b", "7.5b", "7.75b", "9b", "10b", "12b")})
    found = search_kld(_front(), _options(0.004), truth, checks=1)
    assert truth.calls == [["16b", "8b", "4b"], ["7b"]]
    assert found.chosen.setting == "8b"
    assert found.measured["8b"]["mean_kld"] <= 0.004
    assert len(found.notes) == 1 and "stopped after 1 checks" in found.notes[0]
    unchecked = re.search(r"within 0.004; (\S+) \(", found.notes[0]).group(1)
    assert unchecked in ("7.5b", "7.75b") and unchecked not in found.measured
    assert "was not measured" in found.notes[0]
    more = Truth(truth.worse)
    again = search_kld(_front(), _options(0.004), more)
    assert again.chosen.setting == "8b" and again.notes == []
    assert 2 < len(more.calls) <= 5 and len(more.measured) == len(set(more.measured))


def test_the_predictor_passes_through_every_measured_setting():
    """KLD = c * S^alpha, times the measured/fitted ratio interpolated in log S between the
    measured settings: exact at each of them, log-linear between, the end's ratio beyond."""
    from kvlens.deploy.kld_model import fit_kld_model

    m = fit_kld_model([(0.01, 0.001), (0.1, 0.03), (1.0, 0.1)])  # the middle one 3x a line
    for s, k in m.points:
        assert m.predict(s) == pytest.approx(k)
    ratio = {s: k / m.fitted(s) for s, k in m.points}
    assert m.predict(10 ** -0.5) == pytest.approx(
        m.fitted(10 ** -0.5) * (ratio[0.1] * ratio[1.0]) ** 0.5)
    assert m.predict(5.0) == pytest.approx(m.fitted(5.0) * ratio[1.0])
    assert m.predict(0.001) == pytest.approx(m.fitted(0.001) * ratio[0.01])
    assert m.log_rmse > 0.3  # the fit's own residuals, not the corrected prediction's


def test_nothing_measured_within_the_bound_after_the_cap_is_an_error():
    """Within 9 bits both anchors (4 and 8 bits) measure over 0.001; the 9-bit setting is
    predicted within it, but no check is allowed: a ConfigError that names what was measured
    and how to go on, and nothing beyond the anchors measured."""
    truth = Truth({})
    with pytest.raises(ConfigError, match=r"measured under KLD 0.001 after 0 checks .*"
                                          r"8b 0.0012.*9b, is predicted at 0.0006.*"
                                          r"Raise max_kld"):
        search_kld(_front(), _options(0.001, budget_bits=9), truth, checks=0)
    assert truth.calls == [["16b", "8b", "4b"]]


def test_nothing_predicted_or_measured_within_the_bound_says_what_the_best_reaches():
    truth = Truth({})
    with pytest.raises(ConfigError, match=r"No vllm setting is predicted or measured under KLD "
                                          r"1e-05: the most accurate, 16b \(16.00 bits\), is "
                                          r"measured at 7.5e-05; raise max_kld"):
        search_kld(_front(), _options(1e-5), truth)
