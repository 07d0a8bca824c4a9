"""`kvlens recommend` with the full-precision window as a per-layer choice (`--windows`):
options, refusals, a planted layer that needs the larger window, and a mixed-window config
whose held bytes are what the allocation priced."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import small_options, write_capture
from typer.testing import CliRunner

from kvlens.capture.store import CaptureMeta
from kvlens.cli import app
from kvlens.errors import InputError
from kvlens.model.shape import ModelShape
from kvlens.recommend import (
    DEFAULT_WINDOWS,
    Stream,
    choose,
    default_tokens,
    measure,
    option_bytes,
)

runner = CliRunner()


def test_window_options_and_scored_queries():
    one = small_options(budget_bits=3.0)
    assert one.window_sizes == (128,) and one.score_from == 0  # as before: every query
    many = small_options(budget_bits=3.0, windows=(128, 32, 64, 64), tokens=512)
    assert many.window_sizes == (32, 64, 128)
    # every option is scored on the same queries, each with >= 2x the largest window of
    # quantized history
    assert many.score_from == 384
    assert default_tokens(DEFAULT_WINDOWS) == 512 and default_tokens((128,)) == 256
    # per window: its own flush blocks (a per-channel group larger than the window is out)
    assert many.flush_options(32) == [0] and many.flush_options(64) == [0, 32]
    assert many.streams() == [Stream(32, 0), Stream(64, 0), Stream(64, 32), Stream(128, 0),
                              Stream(128, 32), Stream(128, 64)]
    assert many.layer_flush(residual=64) == 32 and many.layer_flush(residual=32) == 0


@pytest.mark.parametrize("windows, match", [
    ((0, 64), r"Window sizes \[0\] are not allowed; allowed: positive integers"),
    ((-32,), r"Window sizes \[-32\] are not allowed"),
    ((), "windows is empty"),
])
def test_bad_window_sizes_are_refused_naming_the_allowed_values(windows, match):
    with pytest.raises(InputError, match=match):
        small_options(budget_bits=3.0, windows=windows, tokens=512)


def test_too_few_tokens_for_several_windows_says_how_many():
    with pytest.raises(InputError, match="three times the largest window .384.*tokens 512"):
        small_options(budget_bits=3.0, windows=(32, 128), tokens=256)


def _local_capture(path, t=512, seed=0):
    """Three layers, no RoPE, 1 KV head, head_dim 32. Layer 0 attends to the recent ~100
    tokens (a smooth positional kernel: its error depends strongly on the window); layers 1
    and 2 attend to the first 4 tokens (sinks, always exact) and evenly to the rest, so a
    larger window buys them little."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 2, 1, 32
    pos = torch.arange(t, dtype=torch.float64)
    freqs = 2 * math.pi * torch.arange(1, 5, dtype=torch.float64) / (4 * t)
    feats = torch.cat([torch.cos(pos[:, None] * freqs), torch.sin(pos[:, None] * freqs)], 1)
    tensors = {}
    for layer in range(3):
        v = torch.randn(1, hkv, t, d, generator=g)
        k = 0.3 * torch.randn(1, hkv, t, d, generator=g)
        q = 0.3 * torch.randn(1, hq, t, d, generator=g)
        if layer == 0:  # q_i . k_j ~ A sum_m cos(w_m (i - j)): peaked at recent tokens
            k[0, :, :, :8] = feats.float() * 6.0
            q[0, :, :, :8] = feats.float() * 6.0
        else:  # a strong sink direction
            k[0, :, :4, 0] = 12.0
            q[0, :, :, 0] = 3.0
        tensors[layer] = {"q": q, "k": k, "v": v, "q_pre": q, "k_pre": k}
    meta = CaptureMeta(model="planted-local", shape=ModelShape(3, hq, hkv, d, has_rope=False),
                       rope_layout="none", rotary_dim=0,
                       compute_dtype="float32", storage_dtype="float32", num_samples=1,
                       num_tokens=t, layers=(0, 1, 2))
    return write_capture(path, meta, tensors)


def test_the_layer_that_needs_its_window_gets_the_larger_one(tmp_path):
    path = _local_capture(tmp_path / "local.h5")
    opts = small_options(budget_bits=16.0, context=1024, windows=(32, 128), tokens=512,
                            group_sizes=(32,), bits=(2, 4), sensitivity="uniform",
                            retrieval="off", balancer=False, rotation=False,
                            fp_dtype="float16")
    m = measure(path, opts)
    err = [{s.residual: e[0] for (c, s), e in t.items()
            if c.label == "2b per-token G32" and c.tensor == "value"} for t in m.tables]
    # planted: the window matters several times more for layer 0 than for layers 1 and 2
    assert err[0][32] > 3 * err[0][128]
    assert all(err[i][32] < 1.5 * err[i][128] for i in (1, 2))
    need = _cheapest_bits(m, opts)
    rec = choose(m, replace(opts, budget_bits=need + 1.6))
    windows = {ch.layer: ch.residual_tokens for ch in rec.choices}
    assert windows == {0: 128, 1: 32, 2: 32}, [(c.layer, c.candidate.label) for c in
                                                rec.choices]
    assert {i: rec.config.layer(i).residual_tokens for i in range(3)} == windows
    # one window offered: every layer gets it (today's behaviour)
    single = choose(m, replace(opts, windows=(128,), budget_bits=8.0))
    assert {ch.residual_tokens for ch in single.choices} == {128}


def _cheapest_bits(m, opts):
    with pytest.raises(InputError, match="need") as err:
        choose(m, replace(opts, budget_bits=0.5))
    import re

    return float(re.search(r"need ([0-9.]+) bits", str(err.value)).group(1))


def test_window_too_small_for_any_candidate(tmp_path):
    """head_dim 32 with groups of 64 only: no per-token group fits, and a per-channel group of
    64 needs a flush block of 64, which a 16-token window cannot give."""
    path = _local_capture(tmp_path / "local.h5")
    opts = small_options(budget_bits=8.0, windows=(16, 64), tokens=512, group_sizes=(64,),
                            sensitivity="uniform", retrieval="off")
    with pytest.raises(InputError, match=r"window of 16 tokens.*allowed window sizes .*: "
                                         r"64-128 and above"):
        measure(path, opts)


def test_cli_windows(tmp_path):
    path = _local_capture(tmp_path / "local.h5")
    common = ["recommend", str(path), "-b", "8", "--set", "group-sizes=32", "--set",
              "sensitivity=uniform", "--set", "retrieval=off", "--json"]
    res = runner.invoke(app, common)  # the default list
    assert res.exit_code == 0, res.output
    import json

    doc = json.loads(res.stdout)
    assert doc["windows"] == list(DEFAULT_WINDOWS)
    assert {c["residual_tokens"] for c in doc["choices"]} <= set(DEFAULT_WINDOWS)
    res = runner.invoke(app, [*common, "--windows", "64"])  # one window, as before
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["windows"] == [64] and {c["residual_tokens"] for c in doc["choices"]} == {64}
    res = runner.invoke(app, [*common, "--windows", "0,64"])
    assert res.exit_code == 1 and "allowed: positive integers" in res.output


@pytest.mark.parametrize("fp", ["float16", "float8_e4m3fn"])
def test_mixed_window_config_holds_the_bytes_it_was_priced_at(tmp_path, fp):
    """recommend on a tiny Gemma3 (sliding and global layers) with windows 8/16/32, at a
    budget where the layers choose different windows: the written config runs in
    `generate`, and after `context` tokens the cache holds exactly the bytes the allocation
    priced (option_bytes per layer) and `mean_bits` says, with fp16 or fp8 windows."""
    from helpers import held_bytes
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    from kvlens.cache import compressed_attention, memory_report
    from kvlens.capture.run import capture_model
    from kvlens.config import load_config, save_config
    from kvlens.model.hooks import cache_argument_name

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gemma3"), attn_implementation="sdpa")
    model.eval()
    cap = tmp_path / "tiny.h5"
    capture_model(model, torch.randint(0, 128, (1, 128),
                                       generator=torch.Generator().manual_seed(0)), cap)
    context = 160
    opts = small_options(budget_bits=16.0, context=context, windows=(8, 16, 32),
                            tokens=128, group_sizes=(8, 16), flush_tokens=8, bits=(2, 4),
                            sensitivity="uniform", retrieval="off", fp_dtype=fp)
    m = measure(cap, opts)
    rec = None
    need = _cheapest_bits(m, opts)
    for step in range(1, 60):  # the first budget above the cheapest that mixes windows
        r = choose(m, replace(opts, budget_bits=need + 0.1 * step))
        if len({ch.residual_tokens for ch in r.choices}) > 1:
            rec = r
            break
    assert rec is not None, "no budget mixed the windows"
    save_config(rec.config, tmp_path / "cfg.json")
    cfg = load_config(tmp_path / "cfg.json")
    assert cfg.fp_dtype == fp
    shape = m.meta.shape
    priced = sum(option_bytes(ch.candidate, nxt.candidate, ch.flush_tokens, opts, shape,
                              ch.layer, residual=ch.residual_tokens)[0]
                 for ch, nxt in zip(rec.choices[::2], rec.choices[1::2]))
    with torch.no_grad(), compressed_attention(model, cfg, backend="torch") as session:
        cache = session.new_cache()
        ids = torch.randint(3, 128, (1, context), generator=torch.Generator().manual_seed(1))
        kw = {cache_argument_name(model): cache}
        model(ids[:, :40], use_cache=True, **kw)
        for t in range(40, context):
            model(ids[:, t:t + 1], use_cache=True, **kw)
    for i, layer in enumerate(cache.layers):
        assert layer.setting.residual_tokens == cfg.layer(i).residual_tokens
    rep = memory_report(cache)
    rotation = shape.head_dim ** 2 * 4 if any(cfg.layer(i).rotates for i in range(3)) else 0
    assert rep["kv_bytes"] == held_bytes(cache) == priced + rotation
    assert rep["bits_per_element"] == pytest.approx(rec.mean_bits)
    assert rec.mean_bits <= rec.budget_bits


def test_report_names_per_layer_windows():
    from kvlens.report.sections import _windows_text

    same = {"residual_tokens": 128, "choices": [{"layer": 0, "residual_tokens": 128}]}
    assert _windows_text(same) == "128-token"
    mixed = {"residual_tokens": 64, "choices": [
        {"layer": i, "tensor": t, "residual_tokens": r}
        for i, r in enumerate((64, 64, 128)) for t in ("key", "value")]}
    assert _windows_text(mixed) == "per-layer (64 tokens: 2 layers, 128 tokens: 1 layers)"
    assert _windows_text({"residual_tokens": 128, "choices": []}) == "128-token"
