"""`kvlens recommend`: budgeted allocation, measurement on planted captures, config round trip."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import small_options, tiny_capture, write_capture
from tiny_models import tiny_model
from typer.testing import CliRunner

from kvlens.capture.run import capture_model
from kvlens.capture.store import CaptureMeta
from kvlens.cli import app
from kvlens.config import ProtectSettings, load_config, save_config
from kvlens.errors import InputError
from kvlens.model.shape import ModelShape
from kvlens.recommend import (
    COST_RESOLUTION,
    Candidate,
    Stream,
    allocate,
    candidates,
    choose,
    measure,
    option_bytes,
    recommend,
)
from kvlens.recommend.options import option_name


def _brute_force(costs, errors, budget):
    best = None
    for combo in itertools.product(*[range(len(c)) for c in costs]):
        cost = sum(c[i] for c, i in zip(costs, combo))
        if cost <= budget + 1e-12:
            err = sum(e[i] for e, i in zip(errors, combo))
            best = err if best is None else min(best, err)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_finds_the_known_optimum(seed):
    rng = random.Random(seed)
    # costs on the DP grid (multiples of 1/COST_RESOLUTION) so rounding cannot matter
    costs = [[rng.randint(64, 8 * 64) / COST_RESOLUTION for _ in range(5)] for _ in range(4)]
    errors = [[rng.random() for _ in range(5)] for _ in range(4)]
    budget = sum(sorted(c)[2] for c in costs)
    picks = allocate(costs, errors, budget)
    assert sum(c[i] for c, i in zip(costs, picks)) <= budget
    got = sum(e[i] for e, i in zip(errors, picks))
    assert got == pytest.approx(_brute_force(costs, errors, budget))


def test_allocation_spends_budget_where_it_helps():
    # Two groups; group 0 gains a lot from more bits, group 1 almost nothing.
    costs = [[2.0, 4.0], [2.0, 4.0]]
    errors = [[0.9, 0.1], [0.30, 0.29]]
    assert allocate(costs, errors, 6.0) == [1, 0]
    assert allocate(costs, errors, 4.0) == [0, 0]


def test_allocation_refuses_impossible_budget():
    with pytest.raises(InputError, match="budget is too small"):
        allocate([[3.0, 4.0]], [[0.5, 0.1]], 2.5)


def _planted_capture(path, has_rope=True, seed=0, thetas=(10000.0, 10000.0), record=True,
                     position_scale=(1.0, 1.0), samples=1):
    """Keys with two outlier channels on every token (KIVI's observation); values flat except a
    few tokens; post-RoPE made from pre-RoPE with the Llama tables at each layer's theta
    (``record``: the capture's metadata names the first; ``position_scale`` != 1 makes a
    linearly scaled RoPE that no default table reproduces)."""
    from kvlens.quant import rope_tables_for
    from kvlens.rope import apply_rope

    g = torch.Generator().manual_seed(seed)
    s, hq, hkv, t, d = samples, 4, 2, 256, 32
    layers = (0, 1)
    tensors = {}
    for layer in layers:
        cos, sin = rope_tables_for(torch.arange(t)[None] * position_scale[layer], d,
                                   thetas[layer])
        q_pre = torch.randn(s, hq, t, d, generator=g)
        k_pre = torch.randn(s, hkv, t, d, generator=g)
        k_pre[..., 3] = 25.0 + torch.randn(s, hkv, t, generator=g)
        k_pre[..., 20] = -18.0 + torch.randn(s, hkv, t, generator=g)
        v = torch.randn(s, hkv, t, d, generator=g)
        post_q = apply_rope(q_pre, cos, sin) if has_rope else q_pre
        post_k = apply_rope(k_pre, cos, sin) if has_rope else k_pre
        tensors[layer] = {"q": post_q, "k": post_k, "v": v, "q_pre": q_pre, "k_pre": k_pre}
    rope = {"rope_theta": thetas[0]} if has_rope and record else {}
    meta = CaptureMeta(model="planted", shape=ModelShape(2, hq, hkv, d, has_rope=has_rope,
                                                         rope=rope),
                       rope_layout="half" if has_rope else "none",
                       rotary_dim=d if has_rope else 0, compute_dtype="float32",
                       storage_dtype="float32", num_samples=s, num_tokens=t, layers=layers)
    return write_capture(path, meta, tensors)


def test_recommend_on_planted_outlier_keys(tmp_path):
    path = _planted_capture(tmp_path / "p.h5")
    # min/max grids only: a least-squares fit can make per-token groups with outliers usable
    opts = small_options(budget_bits=3.5, group_sizes=(32,), bits=(2, 4),
                            value_fits=("minmax",))
    rec = recommend(path, opts)
    assert rec.mean_bits <= 3.5
    for ch in rec.choices:
        assert ch.candidate.fit == "minmax"
        if ch.tensor == "key":
            # Outlier channels: plain per-token key grouping is never the best use of bits.
            assert ch.candidate.granularity == "per-channel" or ch.candidate.balancer
    # The expected error reported is the mean of the chosen candidates' output errors.
    assert rec.expected_output_error == pytest.approx(
        sum(c.output_error for c in rec.choices) / len(rec.choices))
    # More budget never makes the expected error worse.
    richer = recommend(path, small_options(budget_bits=6.0, group_sizes=(32,),
                                              bits=(2, 4)))
    assert richer.expected_output_error <= rec.expected_output_error + 1e-12
    assert rec.config.model == {"num_layers": 2, "head_dim": 32, "num_key_value_heads": 2}
    # Where the time went: the stages that ran, each non-negative, in --json.
    stages = rec.profile.stages
    assert {"candidate errors", "capture read", "allocation"} <= set(stages)
    assert "layout sensitivity" not in stages  # the planted capture names no model
    assert all(v >= 0 for v in stages.values()) and rec.profile.total > 0
    assert rec.to_dict()["profile"]["stages"] == stages


def test_errors_are_measured_on_every_capture_sample_by_default(tmp_path):
    # One capture sample (512 tokens by default) is little text to rank layouts by (Gemma3-270M: all four capture
    # samples instead of the first took the 3.0-bit KLD from 0.097 to 0.075 out of sample), so
    # the default measures every sample; --samples N still limits it.
    from kvlens.recommend import measure

    path = _planted_capture(tmp_path / "p.h5", samples=3)
    kw = dict(budget_bits=3.0, group_sizes=(32,), bits=(2,), extensions=(),
              rotation=False, balancer=False)
    assert small_options(**kw).samples is None
    every = measure(path, small_options(**kw))
    three = measure(path, small_options(**kw, samples=3))
    first = measure(path, small_options(**kw, samples=1))
    assert every.tables == three.tables
    assert every.tables[0].keys() == first.tables[0].keys()
    assert all(every.tables[0][c] != first.tables[0][c] for c in first.tables[0])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="samples must be a positive"):
            small_options(**kw, samples=bad)


def test_mse_fit_candidates_win_on_gaussian_values(tmp_path):
    # Values are Gaussian: at 2 bits a least-squares scale/zero fit halves a group's squared
    # error, so with both fits offered every 2-bit value choice is the fitted one, at the
    # same bytes, and the expected error drops. Keys stay min/max unless asked for; choosing
    # again from the same measurements with fewer fits drops the others.
    from kvlens.recommend import choose, measure

    path = _planted_capture(tmp_path / "p.h5")
    kw = dict(budget_bits=3.6, group_sizes=(32,), bits=(2, 4), extensions=(),
              fp_dtype="float16", scale_dtype="float16")  # 8-bit metadata refines min/max too
    m = measure(path, small_options(**kw, key_fits=("minmax", "mse")))
    both = choose(m, small_options(**kw))
    minmax = choose(m, small_options(**kw, value_fits=("minmax",)))
    values = [c for c in both.choices if c.tensor == "value" and c.candidate.bits == 2]
    assert values and all(c.candidate.fit == "mse" for c in values)
    assert all(c.candidate.fit == "minmax" for c in both.choices if c.tensor == "key")
    assert all(c.candidate.fit == "minmax" for c in minmax.choices)
    assert both.expected_output_error < 0.95 * minmax.expected_output_error
    assert both.mean_bits <= 3.6 and minmax.mean_bits <= 3.6
    assert any(k[0].fit == "mse" and k[0].tensor == "key" for k in m.tables[0])
    for flag, bad in (("--set key-fits=l2", dict(key_fits=("l2",))),
                      ("--set value-fits=(empty)", dict(value_fits=()))):
        with pytest.raises(InputError) as err:  # the library names the field, the CLI the lever
            small_options(budget_bits=3.6, **bad)
        field, value = next(iter(bad)), flag.partition("=")[2]
        assert str(err.value).startswith(f"{field}={value}: give one or both")
        assert err.value.render(option_name).startswith(f"{flag}: give one or both")
    # the config carries the fit (a version-2 spec) for the cache to quantize with
    for c in values:
        assert both.config.layer(c.layer).value.fit == "mse"
    for rec in (both, minmax):  # and writes it
        assert load_config_text(rec.config) == rec.config


def test_each_layer_finds_its_own_rope_theta(tmp_path):
    # Gemma3-like: sliding layers at theta 1e4, global ones at another (here one no list
    # holds, so the search finds it), and a capture that records neither
    from kvlens.analysis.compare import layer_rope_tables
    from kvlens.capture.store import open_capture

    path = _planted_capture(tmp_path / "two.h5", thetas=(10000.0, 31415.9), record=False)
    with open_capture(path) as cap:
        found = []
        for layer in (0, 1):
            k, k_pre = cap.layer(layer).read("k"), cap.layer(layer).read("k_pre")
            tables, theta = layer_rope_tables(cap.meta, k, k_pre)
            assert tables is not None
            found.append(theta)
    assert found[0] == 10000.0 and found[1] == pytest.approx(31415.9, rel=1e-3)
    opts = small_options(budget_bits=3.5, group_sizes=(32,), bits=(2, 4), pre_rope="on",
                            value_fits=("minmax",), extensions=())
    rec = recommend(path, opts)  # "on" raises unless every layer offers pre-RoPE keys
    assert not any("pre-RoPE candidates skipped" in n for n in rec.notes)
    # linearly scaled RoPE on layer 1: no default theta rebuilds it -> refused / skipped
    scaled = _planted_capture(tmp_path / "scaled.h5", position_scale=(1.0, 0.25))
    with pytest.raises(InputError, match="cannot be rebuilt"):
        recommend(scaled, opts)
    rec = recommend(scaled, replace(opts, pre_rope="auto"))
    assert any("pre-RoPE candidates skipped where the RoPE of layer(s) 1 cannot" in n
               for n in rec.notes)
    assert not any(c.candidate.stage == "pre" for c in rec.choices if c.layer == 1)


def test_budget_below_any_candidate_and_pre_rope_without_rope(tmp_path):
    path = _planted_capture(tmp_path / "p.h5")
    with pytest.raises(InputError, match="budget is too small"):
        recommend(path, small_options(budget_bits=2.0, context=1024))
    plain = _planted_capture(tmp_path / "norope.h5", has_rope=False)
    with pytest.raises(InputError, match="no pre-RoPE data"):
        recommend(plain, small_options(budget_bits=4.0, pre_rope="on"))
    rec = recommend(plain, small_options(budget_bits=4.0))  # auto: simply no pre candidates
    assert all(c.candidate.stage == "post" for c in rec.choices)


def test_option_bytes_count_every_part():
    # keys 2-bit per-channel G32 and values 2-bit per-token G32 (3 bits each with fp16 scale
    # and zero) on the 1024 tokens quantized at 1024 tokens (flushed whole), the 128-token fp16
    # window buffer, and 4 sink tokens: fp16 K and V plus an int32 position per KV head.

    shape = ModelShape(1, 2, 2, 64)
    k, v = Candidate("key", 2, "per-channel", 32), Candidate("value", 2, "per-token", 32)
    opts = small_options(budget_bits=4.0, context=1024, fp_dtype="float16",
                            scale_dtype="float16")
    total, k_share, v_share = option_bytes(k, v, 0, opts, shape, 0)
    elems = 2 * 1024 * 64  # per KV head, K and V
    expected = (3 * elems + 16 * 2 * 128 * 64 + 4 * (16 * 2 * 64 + 32)) / 8
    assert total == 2 * expected and k_share + v_share == total
    # fp8 full-precision parts (--window-dtype float8_e4m3fn): window and sink copies at 8 bits
    fp8 = option_bytes(k, v, 0, replace(opts, fp_dtype="float8_e4m3fn"), shape, 0)[0]
    assert fp8 == 2 * (3 * elems + 8 * 2 * 128 * 64 + 4 * (8 * 2 * 64 + 32)) / 8
    # pre-RoPE keys add an int32 position per held token (shared by the KV heads)
    pre = option_bytes(replace(k, stage="pre"), v, 0, opts, shape, 0)[0]
    assert pre - total == 4 * 1024
    # 8-bit group metadata (--scale-dtype 8bit): scale and zero at 8 bits each, so both
    # tensors' G32 groups cost 0.5 bits per element instead of 1
    m8 = option_bytes(k, v, 0, replace(opts, scale_dtype="8bit"), shape, 0)
    assert m8[0] == total - 2 * 0.5 * elems / 8
    assert m8[1] == k_share - 0.5 * elems / 8 and m8[2] == v_share - 0.5 * elems / 8
    with pytest.raises(InputError, match="scale_dtype="):
        replace(opts, scale_dtype="float8")


def test_written_config_runs_in_generate(tmp_path):
    """recommend -> JSON config -> load -> compressed generation on the same (tiny) model."""
    from kvlens.cache import compressed_attention
    from kvlens.config import validate_for
    from kvlens.evaluation.decode import greedy
    from kvlens.model.architecture import describe

    model = tiny_model("llama")
    windows = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    cap = tmp_path / "tiny.h5"
    capture_model(model, windows, cap)
    rec = recommend(cap, small_options(budget_bits=5.0, context=512, group_sizes=(16,),
                                          residual_tokens=16))
    out = tmp_path / "cfg.json"
    save_config(rec.config, out)
    loaded = load_config(out)
    assert loaded.to_dict() == rec.config.to_dict()
    validate_for(loaded, describe(model))
    prompt = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with compressed_attention(model, loaded, backend="torch") as session:
        new, cache = greedy(model, prompt, session, 8)
    assert new.shape == (1, 8)


runner = CliRunner()


def test_recommend_cli(tmp_path):
    path = _planted_capture(tmp_path / "p.h5")
    out = tmp_path / "rec.json"
    # one window for every layer (--residual), as before --windows; the planted capture's
    # 256 tokens are too few for the default windows (tests/test_recommend_windows.py)
    res = runner.invoke(app, ["recommend", str(path), "--budget-bits", "3.5", "--windows",
                              "128", "--set", "group-sizes=32", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["mean_bits"] <= 3.5 and len(doc["choices"]) == 4
    assert json.loads(out.read_text())["format"] == "kvlens.kvconfig"
    # the engines' forms of the config (kvlens.deploy.plans.layer_exports): never as planned
    assert [e["engine"] for e in doc["exports"]] == ["trtllm", "vllm", "ik_llama.cpp"]
    assert all(not e["expressible"] and e["kld"]["kld"] is None for e in doc["exports"])
    # refuses to overwrite, and reports impossible budgets and bad files clearly
    res = runner.invoke(app, ["recommend", str(path), "-b", "3.5", "-o", str(out)])
    assert res.exit_code == 1 and "--overwrite" in res.output
    res = runner.invoke(app, ["recommend", str(path), "-b", "1.0", "--windows", "128"])
    assert res.exit_code == 1 and "budget is too small" in res.output
    res = runner.invoke(app, ["recommend", str(tmp_path / "none.h5"), "-b", "3"])
    assert res.exit_code == 1 and "not found" in res.output
    res = runner.invoke(app, ["recommend", str(path), "-b", "3", "--set", "group-sizes=48"])
    assert res.exit_code == 1 and "do not divide" in res.output


def test_recommend_reuses_a_kept_measurement(tmp_path, monkeypatch):
    """A second `recommend` on the same capture with the same measuring options reads the
    first run's measurement (any budget): the same config as measuring again. Another
    measuring option, a rewritten capture or an unreadable kept file measure again;
    KVLENS_MEASUREMENT_CACHE=off keeps nothing."""
    from kvlens.recommend.reuse import REUSED_STAGE

    kept = tmp_path / "kept"
    monkeypatch.setenv("KVLENS_MEASUREMENT_CACHE", str(kept))
    path = _planted_capture(tmp_path / "p.h5")
    # one worker: the second layer is predicted from the first
    base = ["recommend", str(path), "--windows", "128", "--set", "group-sizes=32", "--json",
            "--workers", "1"]

    def run(*extra):
        res = runner.invoke(app, [*base, *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout), res.output

    first, said = run("-b", "3.5")
    assert "reused" not in said and "candidate errors" in first["profile"]["stages"]
    assert set(first["profile"]["predicted"]) == {"candidate errors"}
    assert "predicted: candidate errors about" in said  # as its first layer finished
    assert re.search(r"candidate\s+errors\s+\d+\s+s\s+\(predicted\s+\d+\s+s\)", said)
    files = list(kept.glob("*.npz"))
    assert len(files) == 1 and not list(kept.glob(".*"))
    again, said = run("-b", "3.0")
    assert "measurements reused from an earlier run" in said
    assert set(again["profile"]["stages"]) == {REUSED_STAGE, "allocation"}
    assert again["profile"]["predicted"] is None
    assert any(str(files[0]) in n for n in again["notes"])
    fresh, said = run("-b", "3.0", "--remeasure")
    assert "reused" not in said and "candidate errors" in fresh["profile"]["stages"]
    assert fresh["choices"] == again["choices"] and fresh["mean_bits"] == again["mean_bits"]
    assert again["choices"] != first["choices"]  # another budget, another allocation
    # the window dtype is priced by the allocation only: the same measurement
    fp8, said = run("-b", "3.0", "--window-dtype", "float8_e4m3fn")
    assert "reused" in said
    assert fp8["choices"] == run("-b", "3.0", "--window-dtype", "float8_e4m3fn",
                                 "--remeasure")[0]["choices"]
    # another measuring option is another measurement
    _, said = run("-b", "3.0", "--set", "bits=2,4")
    assert "reused" not in said and len(list(kept.glob("*.npz"))) == 2
    # an unreadable kept file is measured again and replaced (tests/test_reuse.py: planted
    # pickles, damaged and other-version files)
    files[0].write_bytes(b"not a kept measurement")
    _, said = run("-b", "3.0")
    assert "reused" not in said
    _, said = run("-b", "3.0")
    assert "reused" in said
    # a capture rewritten at the same path is a new measurement
    path.unlink()
    _planted_capture(path, seed=1)
    _, said = run("-b", "3.0")
    assert "reused" not in said and len(list(kept.glob("*.npz"))) == 3
    monkeypatch.setenv("KVLENS_MEASUREMENT_CACHE", "off")
    _, said = run("-b", "3.0")
    assert "reused" not in said and len(list(kept.glob("*.npz"))) == 3
    # at most KEEP_AT_MOST files: the least recently used go (a read counts as a use)
    from kvlens.recommend import reuse
    from kvlens.recommend.pipeline import Measurements

    monkeypatch.setattr(reuse, "KEEP_AT_MOST", 2)
    files = sorted(kept.glob("*.npz"), key=lambda f: f.stat().st_mtime_ns)
    for i, f in enumerate(files):
        os.utime(f, ns=(10**18 + i, 10**18 + i))
    assert reuse.read_kept(files[0]) is not None  # the oldest, used now
    reuse.keep(reuse.read_kept(files[0]), kept / "new.npz")
    left = set(kept.glob("*.npz"))
    assert left == {files[0], kept / "new.npz"}
    assert isinstance(reuse.read_kept(kept / "new.npz"), Measurements)


def test_sensitivity_sees_a_layer_that_cannot_matter():
    """A layer whose attention output is multiplied by zero (o_proj = 0) cannot be hurt by
    quantizing its cache: KL exactly 0 there, positive elsewhere."""
    from kvlens.analysis.sensitivity import layer_kl, weights_from

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    kl = layer_kl(model, ids, [0, 1, 2], group_size=16)
    assert kl[1] == 0.0 and kl[0] > 0 and kl[2] > 0
    w = weights_from(kl, [0.5, 0.5, 0.25])
    assert sum(w) / 3 == pytest.approx(1.0) and w[1] == 0.0
    assert w[2] / w[0] == pytest.approx((kl[2] / 0.25) / (kl[0] / 0.5))
    assert not model.config._attn_implementation.startswith("kvlens")


def rec_meta(path):
    from kvlens.capture.store import open_capture

    with open_capture(path) as cap:
        return cap.meta


def test_config_bits_matches_the_budget_accounting(tmp_path):
    from kvlens.cache.layout import config_bits
    from kvlens.config import preset

    shape = ModelShape(30, 3, 3, 64)
    # kivi-2 at 4096 tokens, head_dim 64: 3 bits on all 4096 tokens (flushed whole at 4096)
    # plus the window's 128-token fp16 buffer.
    assert config_bits(preset("kivi-2"), shape, 4096) == pytest.approx(
        (3.0 * 4096 + 16 * 128) / 4096)
    assert config_bits(preset("fp16"), shape, 4096) == 16.0
    # sink tokens: 16-bit K and V copies plus an int32 position per token and KV head
    sinks = replace(preset("kivi-2"), protect=ProtectSettings(4, "off"))
    assert config_bits(sinks, shape, 4096) == pytest.approx(
        (3.0 * 4096 + 16 * 128) / 4096 + 4 * (16 + 32 / 128) / 4096)
    # a sliding-window layer counts only its window: fp16 is 16 bits of what it holds
    sliding = ModelShape(2, 3, 3, 64, windows=(512, None))
    assert config_bits(preset("fp16"), sliding, 32768) == 16.0
    assert sliding.fp16_bytes(32768) == 2 * 3 * 64 * 2 * (511 + 32768)
    path = _planted_capture(tmp_path / "p.h5")
    rec = recommend(path, small_options(budget_bits=4.0, group_sizes=(32,)))
    assert config_bits(rec.config, rec_meta(path).shape,
                       rec.context) == pytest.approx(rec.mean_bits)
    assert rec.mean_bits <= 4.0 and rec.config.protect.sink_tokens == 4
    # with 8-bit group metadata the written config says so and is priced so
    rec8 = recommend(path, small_options(budget_bits=4.0, group_sizes=(32,),
                                            scale_dtype="8bit"))
    assert rec8.config.scale_dtype == "8bit" and rec8.mean_bits <= 4.0
    assert config_bits(rec8.config, rec_meta(path).shape,
                       rec8.context) == pytest.approx(rec8.mean_bits)
    assert config_bits(replace(rec8.config, scale_dtype="float16"), rec_meta(path).shape,
                       rec8.context) > rec8.mean_bits


def test_sliding_window_blocks_follow_the_group_sizes(tmp_path):
    opts = small_options(budget_bits=3.0, group_sizes=(32, 64, 128))
    tok = Candidate("value", 2, "per-token", 32)
    assert opts.layer_flush(tok, tok) == 32
    assert opts.layer_flush(Candidate("key", 2, "per-channel", 64), tok) == 64
    assert opts.layer_flush(Candidate("key", 2, "per-channel", 128), tok) == 0  # = the window
    assert opts.flush_options() == [0, 32, 64]
    assert replace(opts, flush_tokens=0).flush_options() == [0]
    with pytest.raises(InputError, match="flush_tokens=30"):
        small_options(budget_bits=3.0, flush_tokens=30)
    with pytest.raises(InputError, match="must exceed the residual window"):
        small_options(budget_bits=3.0, tokens=128)
    # the written config carries each layer's block, and generate accepts it
    path = _planted_capture(tmp_path / "p.h5")
    rec = recommend(path, small_options(budget_bits=4.0, group_sizes=(32, 64),
                                           bits=(2, 4)))
    for ch in rec.choices:
        layer = rec.config.layer(ch.layer)
        assert layer.flush_tokens == ch.flush_tokens
        assert ch.flush_tokens in (0, 32, 64)
    back = load_config_text(rec.config)
    assert back.to_dict() == rec.config.to_dict()


def load_config_text(config):
    from kvlens.config import config_from_dict

    return config_from_dict(json.loads(json.dumps(config.to_dict())))


def test_recommend_validate_end_to_end(tiny_model_dir, tmp_path):
    """capture -> recommend --validate on a tiny model directory: the recommendation and the
    presets are evaluated side by side and the report renders."""
    cap = tiny_capture(tiny_model_dir, tmp_path)
    args = ["recommend", str(cap), "-b", "6", "--context", "512", "--windows", "16",
            "--set", "group-sizes=16", "--model", str(tiny_model_dir), "--validate",
            "--eval-tokens", "96"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    # the KLD table against the exact model, on the held-out text
    assert "Recommendation:" in res.stdout and "KL divergence vs the exact model" in res.stdout
    assert "heldout" in res.stdout
    # the presets use G=32/64, which cannot fit this model's head_dim of 16: skipped, said so
    assert "skipping preset kivi-2" in res.output and "skipping preset per-token-4" in res.output
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["validation_evaluation"]["kld"]["scored"] > 0
    names = [r["name"] for r in doc["validation"]]
    assert names == ["recommended"]
    assert doc["validation"][0]["kld"]["mean_kld"]["value"] > 0


def test_rotation_candidates_are_measured_priced_and_written(tmp_path):
    """Keys with two outlier channels: a per-token group holding them is coarse; the Hadamard
    rotation spreads them, so rotated per-token keys measure lower error than plain per-token
    ones at the same price, and the config `recommend` writes stores what it chose."""

    path = _planted_capture(tmp_path / "p.h5", has_rope=False)
    opts = small_options(budget_bits=4.0, group_sizes=(32,), bits=(4,), balancer=False)
    cands = candidates(32, opts, has_rope=False)
    rotated = [c for c in cands if c.rotate]
    assert rotated and all(c.granularity == "per-token" for c in rotated)
    assert not any(c.rotate for c in candidates(32, replace(opts, rotation=False), False))
    m = measure(path, replace(opts, sensitivity="uniform", retrieval="off"))
    plain_k, rot_k = Candidate("key", 4, "per-token", 32), \
        Candidate("key", 4, "per-token", 32, rotate=True)
    f = Stream(128, opts.layer_flush(plain_k))
    for table in m.tables:
        # attention output (0.09 vs 0.27 at 4 bits) and scores
        assert table[rot_k, f][0] < 0.5 * table[plain_k, f][0]
        assert table[rot_k, f][1] < 0.5 * table[plain_k, f][1]
    shape = ModelShape(2, 2, 2, 32)
    v = Candidate("value", 4, "per-token", 32)
    assert option_bytes(rot_k, v, f.flush, opts, shape, 0) == option_bytes(
        plain_k, v, f.flush, opts, shape, 0)
    rec = choose(m, replace(opts, budget_bits=6.0))
    for ch in rec.choices:
        layer = rec.config.layer(ch.layer)
        assert (layer.rotate_keys if ch.tensor == "key" else layer.rotate_values) == \
            ch.candidate.rotate


def test_rotation_matrix_cost_never_makes_a_feasible_budget_fail(tmp_path):
    """The shared [D, D] rotation matrix is a fixed cost: a budget just above the cheapest
    plain allocation (below it plus the matrix) must still be met, without rotation."""
    import re

    path = _planted_capture(tmp_path / "p.h5", has_rope=False)
    opts = small_options(budget_bits=2.0, group_sizes=(32,), bits=(2, 4), balancer=False,
                            sensitivity="uniform", retrieval="off")
    m = measure(path, opts)
    with pytest.raises(InputError, match="need") as err:
        choose(m, replace(opts, rotation=False))
    need = float(re.search(r"need ([0-9.]+) bits", str(err.value)).group(1))
    rec = choose(m, replace(opts, budget_bits=need + 0.01))
    assert rec.mean_bits <= need + 0.01
    assert not any(ch.candidate.rotate for ch in rec.choices)
    # with room for the matrix, rotated candidates compete again
    rich = choose(m, replace(opts, budget_bits=6.0))
    assert rich.expected_output_error <= rec.expected_output_error


def test_perturbed_kl_is_the_probe_kl_and_zero_without_a_change():
    """`perturbed_kl` adds a delta to one layer's keys/values: with the probe's quantization
    error as the delta over every position it is `layer_kl`'s KL; a zero delta is lossless;
    scoring the last positions only is the mean over those positions."""
    from kvlens.analysis.sensitivity import layer_kl, perturbed_kl
    from kvlens.model.hooks import attention_override
    from kvlens.quant import QuantSpec, fake_quantize

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    live = {}

    def make(orig):
        def fn(module, query, key, value, attention_mask, **kwargs):
            live[module.layer_idx] = (key.clone(), value.clone())
            return orig(module, query, key, value, attention_mask, **kwargs)
        return fn

    with torch.no_grad(), attention_override(model, make):
        model(input_ids=ids, use_cache=False)
    spec = QuantSpec(2, "per-token", 16)
    k, v = live[2]
    dk, dv = fake_quantize(k, spec) - k, fake_quantize(v, spec) - v
    (probe,) = layer_kl(model, ids, [2], group_size=16)
    with perturbed_kl(model, ids, keep=40) as kl:
        assert kl(2, key=dk, value=dv) == pytest.approx(probe, rel=1e-4)
        assert kl(2, key=torch.zeros_like(k)) == pytest.approx(0.0, abs=1e-7)
        key_only = kl(2, key=dk)
        assert 0 < key_only < probe
    with perturbed_kl(model, ids, keep=10) as kl:
        last = kl(2, key=dk)
    assert last > 0 and last != pytest.approx(key_only, rel=1e-3)


@pytest.mark.parametrize("vocab,scale,change", [(50, 1.0, 0.5), (4096, 3.0, 0.05),
                                                  (49152, 8.0, 0.02), (49152, 2.0, 1e-3)])
def test_reference_kl_is_the_float64_kl(vocab, scale, change):
    """`Reference.kl` (log E_p[exp(x)] - E_p[x] of the centred change of the logits) is the
    mean next-token KL(p || q): against float64 on random logits, peaked and flat, large
    vocabularies and small changes (KL down to 5e-7), to 1e-4 relative (the plain float32
    sum of p (log p - log q) is off by up to 0.2 there); with a shift of each position's
    logits; with a change too large for expm1 (the log-sum-exp path); no change is exactly 0;
    the changed logits are taken over."""
    from kvlens.analysis.sensitivity import Reference

    def want(changed):
        lp, lq = torch.log_softmax(z.double(), -1), torch.log_softmax(changed.double(), -1)
        return float((lp.exp() * (lp - lq)).sum(-1).mean())

    g = torch.Generator().manual_seed(vocab)
    z = scale * torch.randn(2, 7, vocab, generator=g)
    ref = Reference(z.clone())
    z2 = z + change * torch.randn(2, 7, vocab, generator=g)
    shifted = z2 + 5.0 * torch.randn(2, 7, 1, generator=g)
    big = z2.clone()
    big[..., 3] += 70.0  # one token's logit jumps: q puts almost all its mass there
    for changed in (z2, shifted, big):
        expected = want(changed)
        assert expected > 0
        assert ref.kl(changed.clone()) == pytest.approx(expected, rel=1e-4, abs=1e-10)
    assert want(big) > 10
    assert ref.kl(z.clone()) == 0.0
    taken = z2.clone()
    ref.kl(taken)
    assert not torch.equal(taken, z2)


def test_layout_sensitivity_measures_a_rate_per_family(tmp_path, tiny_tokenizer):
    """`--sensitivity layout`: one KL rate per layer and storage family. A layer whose
    attention output is multiplied by zero (o_proj = 0) gets weight 0 whatever the layout;
    every other layer has a factor for each family probed; the factors change which layouts
    are chosen only through the error they scale (the reported errors stay the proxy's)."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    from kvlens.recommend import family, family_probes

    config = tiny_config("llama")
    config.vocab_size = 49152  # SmolLM2's: the random model this test was written on
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
    mdir = tmp_path / "model"
    model.save_pretrained(mdir)
    tiny_tokenizer.save_pretrained(mdir)
    ids = torch.randint(0, 2000, (1, 64), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "c.h5"
    capture_model(model, ids, path, storage_dtype="float32")
    opts = small_options(budget_bits=5.0, context=512, residual_tokens=16,
                            group_sizes=(16,), bits=(2, 4), tokens=None,
                            extensions=(), sensitivity="layout", model=str(mdir),
                            retrieval="off")
    m = measure(path, opts)
    probes = family_probes(candidates(16, opts, has_rope=True))
    assert {family(c) for c in probes} == {family(c) for c in candidates(16, opts, True)}
    assert all(c.bits == 2 for c in probes)
    # each scale fit is a family of its own (values are offered both by default)
    assert {c.fit for c in probes if c.tensor == "value"} == {"minmax", "mse"}
    assert {c.fit for c in probes if c.tensor == "key"} == {"minmax"}
    assert m.weights[1] == 0.0 and m.weights[0] > 0 and m.weights[2] > 0
    assert len(m.factors) == 3
    for layer in (0, 2):
        fs = m.factors[layer]
        assert set(fs) == {family(c) for c in probes}
        assert sum(fs.values()) / len(fs) == pytest.approx(1.0)
    assert any("per-layout factors" in n for n in m.notes)
    rec = choose(m, opts)
    for ch in rec.choices:  # reported: the proxy's error of what was chosen
        s = Stream(ch.residual_tokens, ch.flush_tokens)
        assert ch.output_error == m.tables[ch.layer][ch.candidate, s][0]
    # the layer that cannot matter gets the cheapest codes, the budget goes to the others
    bits = {(ch.layer, ch.tensor): ch.candidate.bits for ch in rec.choices}
    assert bits[1, "key"] == bits[1, "value"] == 2
    assert max(bits[0, "key"], bits[0, "value"], bits[2, "key"], bits[2, "value"]) == 4
    with pytest.raises(InputError, match="layout"):
        small_options(budget_bits=3.0, sensitivity="per-head")
    # auto is layout when the model loads; model keeps one weight per layer
    assert measure(path, replace(opts, sensitivity="auto")).factors == m.factors
    per_layer = measure(path, replace(opts, sensitivity="model"))
    assert per_layer.factors == () and per_layer.weights[1] == 0.0
    assert any("layer weights from measured sensitivity" in n for n in per_layer.notes)
    # every family on layers 0 and 2 only: the same rates there; layer 1 measures the two
    # anchors (KL 0: its attention output is zeroed), so the normalisation is the same too
    assert m.notes[-1].count("every layer") == 1
    two = measure(path, replace(opts, layout_layers=2))
    assert "layers 0, 2 (the 2 anchor families on the others)" in two.notes[-1]
    assert two.weights == pytest.approx(m.weights)
    for got, want in zip(two.factors, m.factors):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(
            list(want.values()))
    # --layout-tokens: the sample's own length is the same measurement (its forwards'
    # reconstructions are made with one window: every token is quantized anyway); fewer tokens
    # run shorter forwards, KL on the last half of them
    whole = measure(path, replace(opts, layout_tokens=64))
    assert whole.weights == pytest.approx(m.weights)
    for got, want in zip(whole.factors, m.factors):
        assert list(got.values()) == pytest.approx(list(want.values()))
    short = measure(path, replace(opts, layout_tokens=32))
    assert "KL on the last 16 of 32 capture tokens" in short.notes[-1]
    assert short.weights[1] == 0.0 and short.weights != pytest.approx(m.weights)
    with pytest.raises(InputError, match="above the largest window"):
        replace(opts, layout_tokens=16)
    assert replace(opts, layout_tokens=17).layout_tokens == 17
    if sys.platform.startswith("linux"):  # layers measured on forked workers: the same rates
        # (to float tolerance: a worker's forwards run on one thread, this process's on more)
        spread = measure(path, replace(opts, workers=2))
        assert spread.weights == pytest.approx(m.weights, rel=1e-4)
        for got, want in zip(spread.factors, m.factors):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(
                list(want.values()), rel=1e-4)


def test_shared_layout_rates_scale_the_anchor_by_the_measured_ratio():
    from kvlens.recommend.sensitivity import _shared_rates, spread_layers

    assert spread_layers(range(30), 4) == [0, 10, 19, 29]
    assert spread_layers(range(30), 1) == [15]
    assert spread_layers([3, 5, 7], None) == spread_layers([3, 5, 7], 3) == [3, 5, 7]
    ak, av, f, g = ("key", "a"), ("value", "a"), ("key", "f"), ("value", "g")
    rates = [{ak: 1.0, f: 2.0, av: 1.0, g: 0.5},  # f/ak = 2 here
             {ak: 3.0, av: 4.0},  # anchors only
             {ak: 2.0, f: 16.0, av: 2.0, g: 1.0}]  # f/ak = 8 here
    full = _shared_rates(rates, (ak, f, av, g), (ak, av))
    assert full[0] == rates[0] and full[2] == rates[2]  # measured rates are kept
    assert full[1][f] == pytest.approx(3.0 * 18 / 3)  # sum of f over sum of the anchor
    assert full[1][g] == pytest.approx(4.0 * 1.5 / 3)  # values scale with the value anchor
    zero = _shared_rates([{ak: 1.0, f: 0.0}, {ak: 2.0}], (ak, f), (ak, av))
    assert zero[1] == {ak: 2.0, f: 0.0}  # a family measured harmless stays harmless
    assert _shared_rates([{ak: 1.0}], (ak, f), (ak, av)) == [{ak: 1.0}]  # no ratio: left out
    with pytest.raises(InputError, match="layout_layers must be a positive"):
        small_options(budget_bits=3.0, layout_layers=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_neox", "gpt2", "qwen3"])
def test_perturbed_kl_skipping_lower_layers_is_exact(arch):
    """A perturbed run reuses the reference outputs of the layers below the perturbed one: its
    KL equals a run that recomputes every layer, on every tiny architecture."""
    import torch
    from tiny_models import tiny_model

    from kvlens.analysis import sensitivity
    from kvlens.model.architecture import attention_modules, decoder_layers

    model = tiny_model(arch)
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    layers = decoder_layers(model)
    assert len(layers) == 3 and all(hasattr(m, "forward") for m in layers)
    g = torch.Generator().manual_seed(2)
    hkv = model.config.num_key_value_heads if hasattr(model.config, "num_key_value_heads") \
        else model.config.num_attention_heads
    d = getattr(model.config, "head_dim", None) or model.config.hidden_size // \
        model.config.num_attention_heads
    delta = 0.3 * torch.randn(1, hkv, 48, d, generator=g)
    runs = []  # layer 0's attention runs: the reference run and layer 0's own perturbed run
    hook = attention_modules(model)[0].register_forward_pre_hook(lambda *a: runs.append(1))
    with sensitivity.perturbed_kl(model, ids, keep=20) as kl:
        fast = [kl(i, key=delta, value=delta) for i in range(3)]
    hook.remove()
    assert len(runs) == 2
    calls = []
    orig = sensitivity._skip_below

    def no_skip(layers, layer, outputs):
        calls.append(layer)
        return orig(layers, -1, outputs)  # skips nothing: every layer recomputed

    sensitivity._skip_below = no_skip
    try:
        with sensitivity.perturbed_kl(model, ids, keep=20) as kl:
            full = [kl(i, key=delta, value=delta) for i in range(3)]
    finally:
        sensitivity._skip_below = orig
    assert calls == [0, 1, 2]
    assert all(f > 0 for f in full)
    assert fast == full
    assert all("forward" not in vars(m) for m in layers)  # the patch is undone


def test_layers_measured_on_worker_processes_give_the_same_numbers(tmp_path):
    from kvlens.recommend import measure

    path = _planted_capture(tmp_path / "p.h5", samples=2)
    kw = dict(budget_bits=3.0, group_sizes=(32,), bits=(2, 4))
    here = measure(path, small_options(**kw, workers=1))
    spread = measure(path, small_options(**kw, workers=2))
    assert here.tables == spread.tables and here.tables[0]
    assert here.balancers.keys() == spread.balancers.keys() == {0, 1}
    for i in here.balancers:
        assert torch.equal(here.balancers[i], spread.balancers[i])
    # an error a worker raises reaches the caller as itself, with its message
    with pytest.raises(InputError, match="no more than the residual window"):
        measure(path, small_options(**kw, residual_tokens=256, tokens=None, workers=2))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InputError, match="workers must be a positive"):
            small_options(**kw, workers=bad)


def test_workers_follow_the_predicted_length_unless_asked():
    from kvlens.recommend.parallel import PARALLEL_FROM_SECONDS, available_cores, resolve_workers

    assert resolve_workers(None, PARALLEL_FROM_SECONDS / 2, 30) == 1  # short: no processes
    assert resolve_workers(None, PARALLEL_FROM_SECONDS, 30) == min(available_cores(), 30)
    assert resolve_workers(None, 1e6, 1) == 1  # never more workers than layers
    assert resolve_workers(3, 0.0, 30) == 3  # asked: as asked
    assert resolve_workers(8, 0.0, 2) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork on Linux only")
def test_a_script_without_a_main_guard_can_measure_on_workers(tmp_path):
    # workers are forked: a plain script calling recommend does not re-run itself in them
    path = _planted_capture(tmp_path / "p.h5")
    script = tmp_path / "plain.py"
    script.write_text(
        "from kvlens.recommend import RecommendOptions, measure\n"
        f"m = measure({str(path)!r}, RecommendOptions(budget_bits=3.0, group_sizes=(32,), "
        "bits=(2, 4), workers=2, windows=(128,), tokens=256, sensitivity='uniform'))\n"
        "print('layers', len(m.tables))\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "kernels")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["layers", "2"]


def test_layout_anchors_are_kivi_layouts_where_offered():
    from kvlens.recommend import family_probes
    from kvlens.recommend.sensitivity import anchor_probes

    opts = small_options(budget_bits=3.0)
    got = anchor_probes(family_probes(candidates(64, opts, has_rope=True)))
    assert [(c.tensor, c.granularity, c.stage, c.rotate, c.fit) for c in got] == [
        ("key", "per-channel", "post", False, "minmax"),
        ("value", "per-token", "post", False, "minmax")]
    only_mse = replace(opts, value_fits=("mse",))
    got = anchor_probes(family_probes(candidates(64, only_mse, has_rope=True)))
    assert got[1].tensor == "value" and got[1].fit == "mse"  # no KIVI value: the first one
