"""kvlens.evaluation: statistics, chunked KLD vs the exact model, retrieval grid, held-out text."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from kvlens.config import KVConfig, LayerKV, preset
from kvlens.errors import InputError
from kvlens.evaluation.kld import (
    TextScores,
    TokenScores,
    check_lengths,
    reads_quantized,
    score_text,
)
from kvlens.evaluation.kld import summarize as summarize_kld
from kvlens.evaluation.needles import GridScores, NeedlePrompt, build_grid, grid_lengths
from kvlens.evaluation.needles import summarize as summarize_grid
from kvlens.evaluation.options import EvalOptions
from kvlens.evaluation.stats import (
    bootstrap_indices,
    paired_difference,
    percentile_interval,
    wilson,
)
from kvlens.quant import QuantSpec


def _model(max_positions: int = 256, seed: int = 0):
    return tiny_model("llama", seed, max_positions)


def _kivi(window: int = 16, group: int = 8, bits: int = 2) -> KVConfig:
    return KVConfig(f"k{bits}-r{window}", LayerKV(QuantSpec(bits, "per-channel", group),
                                                  QuantSpec(bits, "per-token", group), window))


def _ids(n: int, seed: int = 0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


# -- statistics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("k,n,lo,hi", [(5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775),
                                       (10, 10, 0.7225, 1.0), (19, 20, 0.7639, 0.9911)])
def test_wilson_known_values(k, n, lo, hi):
    got = wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


def test_wilson_rejects_impossible_counts():
    with pytest.raises(ValueError):
        wilson(11, 10)
    assert wilson(0, 0) == (0.0, 1.0)


def test_bootstrap_interval_covers_a_known_mean_and_is_seeded():
    data = np.random.default_rng(3).normal(1.0, 1.0, 400)
    draws = bootstrap_indices(len(data), 1000, seed=0)
    assert (draws == bootstrap_indices(len(data), 1000, seed=0)).all()
    lo, hi = percentile_interval(data[draws].mean(axis=1))
    assert lo < 1.0 < hi
    assert 0.1 < hi - lo < 0.3  # about 2 * 1.96 / sqrt(400) = 0.196


def test_paired_difference_of_identical_inputs_is_zero_and_not_distinguishable():
    samples = np.random.default_rng(0).normal(0.3, 0.1, 1000)
    same = paired_difference(0.3, 0.3, samples, samples)
    assert same["diff"] == 0.0 and same["ci95"] == [0.0, 0.0]
    assert not same["distinguishable"] and same["verdict"] == "not distinguishable"
    shifted = paired_difference(0.35, 0.3, samples + 0.05, samples)
    assert shifted["distinguishable"] and shifted["verdict"] == "higher"
    assert shifted["ci95"] == pytest.approx([0.05, 0.05])


def _scores(kld, nll, nll_exact, chunk: int = 64) -> TextScores:
    n = len(nll_exact)
    return TextScores(tokens=n + 1, chunk=chunk, chunk_of_token=[i // chunk for i in range(n)],
                      nll_exact=list(nll_exact), chunks_done=-(-n // chunk),
                      chunks_total=-(-n // chunk),
                      configs=[TokenScores("c", kld=list(kld), top1=[True] * n, nll=list(nll),
                                           quantized=[True] * n)])


def test_excess_nll_is_the_nll_change_beyond_the_kld():
    rng = np.random.default_rng(0)
    nll_e = rng.uniform(0.5, 5.0, 1000)
    kld = rng.uniform(0.0, 0.2, 1000)
    res = summarize_kld(_scores(kld, nll_e + kld + 0.03, nll_e))["configs"][0]
    assert res["excess_nll"]["value"] == pytest.approx(0.03)
    assert res["excess_nll"]["ci95"] == pytest.approx([0.03, 0.03])
    assert res["ppl_change"]["value"] == pytest.approx(math.exp(kld.mean() + 0.03) - 1)


@pytest.mark.parametrize("drawn_from", ["exact", "config"])
def test_excess_nll_is_zero_for_text_from_the_exact_model(drawn_from):
    # Next tokens drawn from p_exact: E[NLL change] = KL(p_exact || p_config), excess 0. Drawn
    # from p_config: E[log p_exact(y) - log p_config(y)] = -KL(p_config || p_exact), so the
    # excess is -(KL(p_exact || p_config) + KL(p_config || p_exact)) on average.
    rng = np.random.default_rng(1)
    n, vocab = 4096, 12
    logits = rng.normal(0, 2.0, (n, vocab))
    logp_e = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    noisy = logits + rng.normal(0, 0.7, (n, vocab))
    logp_c = noisy - np.log(np.exp(noisy).sum(-1, keepdims=True))
    p_e, p_c = np.exp(logp_e), np.exp(logp_c)
    kl_ec = (p_e * (logp_e - logp_c)).sum(-1)
    kl_ce = (p_c * (logp_c - logp_e)).sum(-1)
    draw = p_e if drawn_from == "exact" else p_c
    y = (draw.cumsum(-1) > rng.uniform(size=(n, 1))).argmax(-1)
    rows = np.arange(n)
    res = summarize_kld(_scores(kl_ec, -logp_c[rows, y], -logp_e[rows, y]))["configs"][0]
    expected = 0.0 if drawn_from == "exact" else -(kl_ec + kl_ce).mean()
    lo, hi = res["excess_nll"]["ci95"]
    se = (hi - lo) / 3.92
    assert abs(res["excess_nll"]["value"] - expected) < 3 * se
    assert se < 0.1 * kl_ec.mean()  # tight enough that the two cases cannot both pass
    assert (lo < 0.0 < hi) == (drawn_from == "exact")


# -- chunked KLD ----------------------------------------------------------------------------------

def test_compression_off_matches_the_exact_model():
    model = _model()
    ids = _ids(100)
    scores = score_text(model, ids, [preset("exact")], chunk=16)
    res = summarize_kld(scores)
    fp16 = res["configs"][0]
    assert scores.scored == 99
    assert fp16["mean_kld"]["value"] == pytest.approx(0.0, abs=1e-12)
    assert fp16["top1_agreement"]["value"] == 1.0 and fp16["quantized_share"] == 0.0
    assert not fp16["vs_exact"]["mean_kld"]["distinguishable"]
    assert fp16["vs_first"] is None  # no compressed config to compare with
    with torch.no_grad():  # the exact reference is the plain model's full forward
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    nll = -logp[:-1].gather(-1, ids[0, 1:, None]).mean().item()
    assert res["exact"]["ppl"]["value"] == pytest.approx(math.exp(nll), rel=1e-6)
    assert model.config._attn_implementation == "sdpa"  # overrides undone


def test_chunked_and_decode_mode_scoring_agree():
    model = _model()
    ids = _ids(120, seed=1)
    cfg = _kivi()
    chunked = score_text(model, ids, [cfg], chunk=8)  # 8 divides the window: same flushes
    decode = score_text(model, ids, [cfg], chunk=1)
    a, b = chunked.configs[0], decode.configs[0]
    assert a.quantized == b.quantized
    assert np.mean(a.kld) > 1e-5  # compression really changed the predictions
    assert np.allclose(a.kld, b.kld, rtol=1e-3, atol=1e-7)
    assert np.allclose(a.nll, b.nll, rtol=1e-4)
    assert np.mean(np.asarray(a.top1) == np.asarray(b.top1)) >= 0.99
    assert np.allclose(chunked.nll_exact, decode.nll_exact, rtol=1e-4)


@pytest.mark.parametrize("chunk,unquantized", [(8, 16), (5, 20), (1, 16)])
def test_quantized_share_counts_predictions_after_the_first_flush(chunk, unquantized):
    # Window 16, whole-window flushes: the first flush follows the call that brings the cache
    # to >= 16 tokens; predictions of every later call read the packed store.
    model = _model()
    scores = score_text(model, _ids(200), [_kivi(), preset("fp16")], chunk=chunk)
    kivi, fp16 = scores.configs
    assert sum(not q for q in kivi.quantized) == unquantized
    assert summarize_kld(scores)["configs"][0]["quantized_share"] == \
        pytest.approx((199 - unquantized) / 199)
    assert not any(fp16.quantized)


def test_quantized_share_at_the_defaults_is_at_least_90_percent():
    # 4096 tokens (the default where the context allows), chunk 64, a 128-token window.
    model = _model(max_positions=4096)
    n = check_lengths(10**6, None, 64, 4096, "text")
    assert n == 4096
    scores = score_text(model, _ids(n), [_kivi(window=128, group=16)], chunk=64)
    share = summarize_kld(scores)["configs"][0]["quantized_share"]
    assert share == pytest.approx((4095 - 128) / 4095) and share >= 0.9


def test_paired_comparison_against_the_first_compressed_config():
    model = _model()
    scores = score_text(model, _ids(160), [preset("exact"), _kivi(bits=2), _kivi(bits=2),
                                          _kivi(bits=8)], chunk=16)
    res = summarize_kld(scores)
    fp16, k2, k2_again, k8 = res["configs"]
    assert k2["vs_first"] is None and k8["vs_first"]["reference"] == k2["name"]
    same = k2_again["vs_first"]["mean_kld"]
    assert same["diff"] == 0.0 and not same["distinguishable"]
    assert k8["vs_first"]["mean_kld"]["diff"] < 0  # 8 bits lose less than 2 bits
    assert k8["mean_kld"]["value"] < k2["mean_kld"]["value"]
    assert k2["vs_exact"]["mean_kld"]["distinguishable"]
    assert fp16["vs_first"]["mean_kld"]["diff"] == pytest.approx(-k2["mean_kld"]["value"])
    lo, hi = k2["mean_kld"]["ci95"]
    assert lo <= k2["mean_kld"]["value"] <= hi and res["protocol"]["bootstrap"]["units"] == 3
    assert k8["vs_first"]["excess_nll"]["diff"] == pytest.approx(
        k8["excess_nll"]["value"] - k2["excess_nll"]["value"])


def test_interrupt_keeps_the_finished_chunks():
    model = _model()

    def stop(done, total):
        if done == 3:
            raise KeyboardInterrupt

    scores = score_text(model, _ids(100), [_kivi()], chunk=10, progress=stop)
    assert scores.interrupted and scores.chunks_done == 3 and scores.scored == 30
    res = summarize_kld(scores)
    assert res["protocol"]["interrupted"] and res["configs"][0]["scored"] == 30
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("text,tokens,chunk,limit,message", [
    (5000, 9000, 64, 8192, "beyond the model's context: its max_position_embeddings is 8192"),
    (3000, 4096, 64, 8192, "longer than the text from t.txt \\(3000 tokens\\)"),
    (3000, None, 64, 8192, "longer than the text"),
    (5000, 100, 0, 8192, "chunk must be between 1"),
    (5000, 100, 101, 8192, "chunk must be between 1 \\(decode mode\\) and eval_tokens"),
])
def test_bad_lengths_are_clear_errors(text, tokens, chunk, limit, message):
    with pytest.raises(InputError, match=message):
        check_lengths(text, tokens, chunk, limit, "t.txt")


def test_eval_tokens_below_two_are_refused_with_the_options():
    with pytest.raises(InputError, match="eval_tokens}? must be at least 2"):
        EvalOptions(evals=("kld",), eval_tokens=1, chunk=1)


def test_default_eval_tokens_is_capped_by_the_context():
    assert check_lengths(10**5, None, 64, 8192, "t") == 4096
    assert check_lengths(10**5, None, 64, 256, "t") == 256


def test_reads_quantized_on_an_empty_cache():
    class Layer:
        quantized_length = 0

    class Cache:
        layers = [Layer()]

    assert not reads_quantized(Cache())
    Cache.layers[0].quantized_length = 3
    assert reads_quantized(Cache())


# -- retrieval grid -------------------------------------------------------------------------------

def test_grid_lengths_respect_the_context():
    assert grid_lengths(None, 8192) == (1024, 2048, 4096)
    assert grid_lengths(None, 2048) == (1024,)
    with pytest.raises(InputError, match="max_position_embeddings is 2048"):
        grid_lengths((1024, 4096), 2048)
    with pytest.raises(InputError, match="shorter than the smallest default"):
        grid_lengths(None, 256)


def test_grid_prompts_are_seeded_and_hide_the_answer(tiny_tokenizer):
    tok = tiny_tokenizer
    grid = build_grid(tok, (300, 600), (0.1, 0.9), per_cell=1, seed=0)
    assert grid == build_grid(tok, (300, 600), (0.1, 0.9), per_cell=1, seed=0)
    assert grid != build_grid(tok, (300, 600), (0.1, 0.9), per_cell=1, seed=1)
    assert len(grid) == 2 * 2 * 2
    for p in grid:
        n = len(tok(p.text).input_ids)
        assert 0.8 * p.length < n <= p.length + 8, (p.task, p.length, n)
        if p.task == "passkey":
            assert p.text.count(p.answer) == 2 and p.text.endswith("The pass key is")
        else:
            assert p.text.count(p.answer) == 1 and p.text.count("The code for") == 5  # 4 facts + answer
    kv = [p for p in grid if p.task == "kv" and p.length == 600]
    shallow, deep = (p.text.index(p.answer) / len(p.text) for p in kv)
    assert shallow < 0.35 < 0.65 < deep


def test_grid_summary_wilson_per_length_and_paired_differences():
    prompts = [NeedlePrompt(t, length, 0.5, i, "", "1")
               for length in (100, 200) for t in ("passkey", "kv") for i in range(5)]
    exact = [True] * 20
    good = [True] * 20
    bad = [True] * 10 + [False] * 10  # all of length 200 wrong
    scores = GridScores(prompts, tokens=[100] * 10 + [200] * 10, exact=exact,
                        configs=[("a", True, good), ("b", True, bad), ("c", True, good)])
    res = summarize_grid(scores)
    a, b, c = res["configs"]
    assert b["by_length"][0]["correct"] == 10 and b["by_length"][1]["correct"] == 0
    assert b["by_length"][1]["wilson95"] == pytest.approx(list(wilson(0, 10)))
    assert b["vs_exact"]["accuracy"]["diff"] == -0.5
    assert b["vs_exact"]["accuracy"]["distinguishable"]
    assert not a["vs_exact"]["accuracy"]["distinguishable"]
    assert c["vs_first"]["reference"] == "a" and not c["vs_first"]["accuracy"]["distinguishable"]
    assert b["vs_first"]["accuracy"]["diff"] == -0.5
    assert res["exact"]["correct"] == 20 and {x["task"] for x in a["by_task"]} == {"passkey",
                                                                                    "kv"}
    # per-prompt outcomes in prompt order, so that runs can be pooled and paired afterwards
    assert b["outcomes"] == bad and res["exact"]["outcomes"] == exact
    order = res["protocol"]["prompt_order"]
    assert len(order) == 20 and order[0] == {"task": "passkey", "length": 100, "depth": 0.5,
                                             "index": 0}
    assert [o["length"] for o in order] == [p.length for p in prompts]


# -- held-out text --------------------------------------------------------------------------------

def _spans(ids: list[int], n: int = 50) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def test_heldout_text_is_long_and_disjoint_from_calibration_texts(smollm2_tokenizer):
    from kvlens.text.corpus import load_text
    from kvlens.text.heldout import heldout_text
    from kvlens.text.prompts import retrieval_text

    tok = smollm2_tokenizer

    def ids(text):
        return tok(text, add_special_tokens=False).input_ids

    held = ids(heldout_text())
    assert len(held) >= 8192
    corpus, _ = load_text(None)
    probe, _ = retrieval_text(tok)
    spans = _spans(held)
    assert not spans & _spans(ids(corpus))
    assert not spans & _spans(ids(probe))
    # the check can fail: the held-out text shares spans with itself
    assert _spans(held[:200]) <= spans


def test_smollm2_smoke_kld_on_the_heldout_text(smollm2):
    from kvlens.text.heldout import heldout_text

    model, tok = smollm2
    ids = tok(heldout_text(), add_special_tokens=False, return_tensors="pt").input_ids[:, :256]
    res = summarize_kld(score_text(model, ids, [preset("exact"), preset("kivi-2"),
                                                preset("kivi-4")], chunk=64))
    fp16, kivi2, kivi4 = res["configs"]
    assert fp16["mean_kld"]["value"] == 0.0 and fp16["top1_agreement"]["value"] == 1.0
    assert kivi2["quantized_share"] == pytest.approx((255 - 128) / 255)
    assert kivi2["mean_kld"]["value"] > kivi4["mean_kld"]["value"] > 0
    assert kivi4["vs_first"]["mean_kld"]["diff"] < 0
    assert 2 < res["exact"]["ppl"]["value"] < 100


def test_transformers_quantized_cache_baseline_in_lockstep():
    from kvlens.errors import ConfigError
    from kvlens.evaluation.baselines import baseline

    try:
        fp8 = baseline("hf-fp8")
    except ConfigError as exc:
        pytest.skip(str(exc))
    scores = score_text(_model(), _ids(160), [fp8], chunk=16)
    res = summarize_kld(scores)["configs"][0]
    # QuantizedCache quantizes its whole history from the first call on: only the first
    # chunk's predictions read nothing quantized.
    assert res["quantized_share"] == pytest.approx((159 - 16) / 159)
    assert res["mean_kld"]["value"] > 0 and res["memory"]["bits_per_element"] < 16
