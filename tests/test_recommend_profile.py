"""recommend's stage profile: exclusive times that add up, and a no-op outside a profile."""

import time

from kvlens.recommend.profile import Profile, profiling, stage


def test_nested_stages_are_charged_exclusively():
    with profiling() as prof:
        start = time.perf_counter()
        with stage("outer"):
            time.sleep(0.02)
            with stage("inner"):
                time.sleep(0.03)
            with stage("inner"):
                time.sleep(0.01)
        wall = time.perf_counter() - start
    assert list(prof.stages) == ["outer", "inner"]
    assert 0.035 <= prof.stages["inner"] < 0.2
    assert 0.015 <= prof.stages["outer"] < prof.stages["inner"] + 0.1
    assert abs(prof.total - wall) < 0.01  # the stages add up to the wall time
    assert prof.to_dict()["total_seconds"] == prof.total


def test_stage_outside_a_profile_records_nothing():
    prof = Profile()
    with stage("anything"):
        pass
    assert prof.stages == {}
    with profiling(prof):
        with stage("a"):
            pass
    other = Profile({"a": 1.0, "b": 2.0})
    prof.merge(other)
    assert set(prof.stages) == {"a", "b"} and prof.stages["b"] == 2.0
