"""recommend's stage profile: exclusive times that add up, and a no-op outside a profile."""

import time

import pytest
from helpers import small_options

from kvlens.model.shape import ModelShape
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


def _shape(**kw):
    from kvlens.recommend.cost import CostShape

    base = dict(model=ModelShape(30, 9, 3, 64), layers=30, samples=4, tokens=512,
                score_from=384, candidates=60, streams=5, families=12, sensitivity_tokens=512,
                probe_tokens=960, params=134_515_008, vocab=49152)
    return CostShape(**(base | kw))


def test_cost_prediction_scales_with_the_work():
    from kvlens.recommend.cost import predict

    base = predict(_shape())
    assert base.seconds == sum(base.stages.values()) > 0
    assert set(base.stages) == {"capture read", "candidate errors", "layout sensitivity",
                                "retrieval probe"}
    twice = predict(_shape(layers=60))
    for name in ("capture read", "candidate errors"):  # linear in layers
        assert twice.stages[name] == pytest.approx(2 * base.stages[name])
    # layout sensitivity: families x layers forwards, each starting at its layer: about
    # (L + 1) / 2 whole forwards of the decoder per family, each costing what its size does
    # (no vocabulary: no LM head, no KL passes)
    bare = predict(_shape(vocab=0)).stages["layout sensitivity"]
    assert predict(_shape(vocab=0, layers=60)).stages["layout sensitivity"] == pytest.approx(
        bare * (1 + 12 * 61 / 2) / (1 + 12 * 31 / 2))
    deeper = predict(_shape(layers=60, params=2 * 134_515_008))
    assert deeper.stages["layout sensitivity"] > 3.5 * base.stages["layout sensitivity"]
    # ... and one LM head over the kept half of the tokens plus the KL's passes per run,
    # wherever the run starts: a larger vocabulary costs more at the same decoder size
    head = 49152 * 576
    big = predict(_shape(vocab=262144, params=134_515_008 - head + 262144 * 576))
    assert big.stages["layout sensitivity"] > 2 * base.stages["layout sensitivity"]
    # the head's size is vocabulary x hidden size (query heads x head_dim unless given)
    assert predict(_shape(hidden=576)).stages == base.stages
    assert predict(_shape(hidden=640)).stages["layout sensitivity"] != \
        base.stages["layout sensitivity"]
    fewer = predict(_shape(candidates=30))
    assert fewer.stages["candidate errors"] == pytest.approx(base.stages["candidate errors"] / 2)
    no_model = predict(_shape(params=0))
    assert set(no_model.stages) == {"capture read", "candidate errors"}
    assert base.peak_bytes > no_model.peak_bytes + 4 * 134_515_008 - 1
    assert base.to_dict()["seconds"] == base.seconds
    # worker processes share the per-layer stages and each holds its own runtime and layer
    two = predict(_shape(workers=2))
    assert two.stages["candidate errors"] == pytest.approx(base.stages["candidate errors"] / 2)
    # its forwards too, each at the one-core rate (slower than one on every core, so the
    # stage gains less than the worker count)
    assert base.stages["layout sensitivity"] / 2 < two.stages["layout sensitivity"] \
        < base.stages["layout sensitivity"]
    assert two.peak_bytes > base.peak_bytes
    # a spawned worker holds its own runtime; a forked one shares its parent's
    assert predict(_shape(workers=2, forked=False)).peak_bytes > two.peak_bytes
    assert predict(_shape(workers=1, forked=False)).peak_bytes == base.peak_bytes


def test_a_slower_machine_scales_every_stage_and_not_the_memory():
    from kvlens.recommend.cost import machine_factor, predict

    base = predict(_shape())
    slow = predict(_shape(), factor=2.5)
    assert base.machine_factor == 1.0 and slow.machine_factor == 2.5
    assert slow.to_dict()["machine_factor"] == 2.5
    for name, sec in base.stages.items():
        assert slow.stages[name] == pytest.approx(2.5 * sec)
    assert slow.peak_bytes == base.peak_bytes
    # timed once per process: every prediction in a run uses the same factor
    assert machine_factor() == machine_factor() > 0


def test_predict_cost_reads_the_capture_and_options(tmp_path):
    from dataclasses import replace

    from test_recommend import _planted_capture

    from kvlens.capture.store import open_capture
    from kvlens.recommend.pipeline import predict_cost

    path = _planted_capture(tmp_path / "p.h5")
    with open_capture(path) as cap:
        meta = cap.meta
    opts = small_options(budget_bits=3.0, group_sizes=(32,), bits=(2, 4))
    cost = predict_cost(meta, opts)
    assert cost.seconds > 0 and cost.peak_bytes > 0
    # this machine's factor, unless one is given
    from kvlens.recommend.cost import machine_factor

    assert cost.machine_factor == machine_factor()
    half = predict_cost(meta, opts, factor=0.5 * machine_factor())
    assert half.seconds == pytest.approx(cost.seconds / 2)
    # the planted capture names no model: no model stage is predicted with uniform weights
    plain = predict_cost(meta, replace(opts, sensitivity="uniform", retrieval="off"))
    assert set(plain.stages) == {"capture read", "candidate errors"}
    # shorter layout forwards: a cheaper layout stage, the rest as before
    layout = replace(opts, sensitivity="layout", model="some/model")
    full, short = (predict_cost(meta, replace(layout, layout_tokens=t), factor=1.0)
                   for t in (None, 200))
    assert short.stages["layout sensitivity"] < full.stages["layout sensitivity"]
    assert short.stages["candidate errors"] == full.stages["candidate errors"]
    more = predict_cost(meta, replace(opts, bits=(2, 4, 8)))
    assert more.stages["candidate errors"] > cost.stages["candidate errors"]


def test_the_cost_model_prices_the_dtype_and_projects_a_gpu():
    """Half-precision weights halve the weights' share of the peak; on a GPU the weights move
    to the device and the model forwards take the published peak's time, the candidate errors
    (measured on the CPU) do not change."""
    from kvlens.recommend.cost import GPU_EFFICIENCY, GPU_PEAK_FLOPS, CostShape, Hardware, predict

    shape = dict(model=ModelShape(16, 32, 8, 64), layers=16, samples=4, tokens=512,
                 score_from=384, candidates=40, streams=6, families=12,
                 sensitivity_tokens=512, probe_tokens=960, params=1_235_814_400,
                 vocab=128_256, hidden=2048)
    f32 = predict(CostShape(**shape, weight_bytes=4))
    bf16 = predict(CostShape(**shape, weight_bytes=2))
    assert f32.peak_bytes - bf16.peak_bytes == 2 * shape["params"]
    assert f32.stages == bf16.stages and f32.device_bytes == 0
    gpu = predict(CostShape(**shape, weight_bytes=2), factor=3.0,
                  hardware=Hardware("h100", "bfloat16"))
    assert gpu.device_bytes == 2 * shape["params"]
    assert gpu.peak_bytes == bf16.peak_bytes - 2 * shape["params"]
    assert gpu.stages["candidate errors"] == 3.0 * f32.stages["candidate errors"]
    assert gpu.stages["layout sensitivity"] < f32.stages["layout sensitivity"] / 100
    # the GPU stage is its FLOPs over the assumed rate, whatever this CPU's factor
    assert predict(CostShape(**shape, weight_bytes=2), hardware=Hardware("h100", "bfloat16")
                   ).stages["layout sensitivity"] == gpu.stages["layout sensitivity"]
    assert Hardware("h100", "float32").forward_flops == \
        GPU_PEAK_FLOPS["h100"]["float32"] * GPU_EFFICIENCY
