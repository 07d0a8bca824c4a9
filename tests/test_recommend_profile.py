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
    from kvlens.recommend.profile import extrapolate

    assert extrapolate(6.0, 2, 30) == pytest.approx(90.0)
    assert extrapolate(6.0, 30, 30) == 6.0  # all done: what it took
    with pytest.raises(ValueError, match="no finished work"):
        extrapolate(1.0, 0, 30)


def test_a_perturbed_run_costs_the_layers_after_its_own_and_the_head():
    from kvlens.recommend.profile import perturbed_work

    # four decoder layers of 10 FLOPs, a head of 5; runs start at layers 0, 1 and 3
    assert perturbed_work([0, 1, 3], [2, 2, 1], 4, 10.0, 5.0) == [90.0, 70.0, 15.0]
    assert perturbed_work([], [], 4, 10.0, 5.0) == []


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
    # layers weighted 1:3 (kvlens.recommend.profile.perturbed_work): the first, 2 s, was a
    # quarter of the work, so 6 s left; read at 6 s into the stage: 12 s
    with profiling() as prof, stage("layout sensitivity"):
        parallel.map_layers(_index_of, path, layers, (), 1, work=[1.0, 3.0])
    assert prof.predicted == {"layout sensitivity": 12.0}


def _index_of(layer, meta):
    return layer.index


def test_the_layout_stage_counts_a_model_s_decoder_and_head():
    """A tiny Llama: a decoder layer's FLOPs are 2 x its parameters x tokens (the final norm
    shared among the layers; the embedding is a lookup), the head's 2 x vocabulary x hidden x
    kept."""
    from types import SimpleNamespace

    from tiny_models import tiny_model

    from kvlens.model.shape import ModelShape
    from kvlens.recommend.sensitivity import _perturbed_work

    model = tiny_model("llama")
    head = model.lm_head.weight.numel()
    # counted from the modules themselves: the decoder layers and the final norm
    body = sum(p.numel() for m in (model.model.layers, model.model.norm)
               for p in m.parameters())
    n_layers = model.config.num_hidden_layers
    meta = SimpleNamespace(layers=tuple(range(n_layers)),
                           shape=ModelShape(n_layers, 4, 2, 16))
    work = _perturbed_work(model, meta, [3] * n_layers, 64, 32)
    layer, lm = 2 * body / n_layers * 64, 2 * head * 32
    assert work == pytest.approx([3 * ((n_layers - i) * layer + lm) for i in range(n_layers)])
    assert work[0] > work[-1] > 0
