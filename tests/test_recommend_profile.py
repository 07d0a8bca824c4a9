"""recommend's stage profile: exclusive times that add up, and a no-op outside a profile."""

import time

import pytest

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


def test_extrapolation_from_the_finished_work():
    from kvlens.recommend.cost import extrapolate

    assert extrapolate(6.0, 2, 30) == pytest.approx(90.0)
    assert extrapolate(6.0, 30, 30) == 6.0  # all done: what it took
    with pytest.raises(ValueError, match="no finished work"):
        extrapolate(1.0, 0, 30)


def test_expect_predicts_the_open_stage_and_says_so(monkeypatch):
    from kvlens.recommend import profile as profile_mod

    clock = iter([100.0, 104.0, 110.0, 110.0])  # entered at 100; expect at 104
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    said = []
    profile_mod.expect(5.0, "nothing open")  # no profile: nothing recorded, nothing said
    with profiling(log=said.append) as prof:
        with stage("layout sensitivity"):
            profile_mod.expect(12.0, "its first 2 of 30 layers took 4 s")
    assert prof.predicted == {"layout sensitivity": 16.0}  # 4 s so far + 12 s left
    assert said == ["predicted: layout sensitivity about 16 s (its first 2 of 30 layers took "
                    "4 s)"]
    assert prof.stages["layout sensitivity"] == 10.0


def test_map_layers_predicts_its_stage_from_the_first_round(tmp_path, monkeypatch):
    """One layer per worker done (here: the first of two, one worker), the rest is
    extrapolated at its rate: the clock is planted, so the prediction is exact."""
    from test_recommend import _planted_capture

    from kvlens.capture.store import open_capture
    from kvlens.recommend import parallel

    path = _planted_capture(tmp_path / "p.h5")
    with open_capture(path) as cap:
        layers = list(cap.meta.layers)
    assert len(layers) == 2
    ticks = iter(range(0, 1000, 2))  # every reading of the clock 2 s after the last
    # (parallel's and profile's clock: the one time.perf_counter)
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
    with profiling() as prof, stage("candidate errors"):  # stage entered at 0
        out = parallel.map_layers(_index_of, path, layers, (), 1)
    assert out == layers
    # map_layers started at 2, its first layer finished at 4: 2 s for half the layers, so 2 s
    # left; the stage had run 6 s when expect read the clock: 8 s predicted
    assert prof.predicted == {"candidate errors": 8.0}
    with profiling() as prof, stage("retrieval probe"):  # one layer: nothing left to predict
        parallel.map_layers(_index_of, path, layers[:1], (), 1)
    assert prof.predicted == {}


def _index_of(layer, meta):
    return layer.index
