"""Evaluations: decode-mode ppl protocol, agreement bookkeeping, passkey prompts, configs."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model

import kvlens.research  # noqa: F401  (registers the mikv-* presets these tests read)
from kvlens.cache import compressed_attention
from kvlens.config import (
    PRESETS,
    KVConfig,
    LayerKV,
    config_from_dict,
    load_config,
    preset,
    save_config,
    validate_for,
)
from kvlens.errors import ConfigError, InputError
from kvlens.evaluation.options import parse_evals
from kvlens.evaluation.short import agreement, decode_ppl, passkey_prompts
from kvlens.quant import QuantSpec


def test_decode_ppl_without_compression_equals_full_forward():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with compressed_attention(model, preset("fp16")) as session:
        ppl, cache = decode_ppl(model, ids, session, prefix=8)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    nll = -logp[8:-1].gather(-1, ids[0, 9:, None]).mean().item()  # tokens 9.. scored
    assert ppl == pytest.approx(math.exp(nll), rel=1e-4)
    assert cache.get_seq_length() == 29


def test_decode_ppl_compressed_differs_but_stays_sane():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    spec = QuantSpec(2, "per-channel", 8)
    cfg = KVConfig("k2", LayerKV(spec, QuantSpec(2, "per-token", 8), 16))
    with compressed_attention(model, preset("fp16")) as session:
        ref, _ = decode_ppl(model, ids, session, prefix=4)
    with compressed_attention(model, cfg) as session:
        got, cache = decode_ppl(model, ids, session, prefix=4)
    assert got != ref and abs(got / ref - 1) < 0.5
    assert cache.layers[0].quantized_length == 48


def test_agreement_counts_and_first_divergence():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == \
        {"matching": 4, "total": 4, "first_divergence": None}
    assert agreement([1, 9, 3, 4], [1, 2, 3, 4]) == \
        {"matching": 3, "total": 4, "first_divergence": 1}
    assert agreement([1, 2], [1, 2, 3]) == {"matching": 2, "total": 3, "first_divergence": 2}


def test_passkey_prompts_hide_the_key_at_seeded_depths(tiny_tokenizer):
    tok = tiny_tokenizer
    a = passkey_prompts(tok, 3, 300, seed=7)
    assert a == passkey_prompts(tok, 3, 300, seed=7)
    for text, key in a:
        assert len(key) == 5 and text.count(key) == 2
        assert text.endswith("The pass key is")
        assert 250 < len(tok(text).input_ids) < 350
    assert len({text.index(key) for text, key in a}) > 1  # different depths


def test_parse_evals():
    assert parse_evals("ppl, agreement") == ("ppl", "agreement")
    with pytest.raises(InputError, match="allowed"):
        parse_evals("ppl,bleu")


def test_config_json_round_trip_with_overrides(tmp_path):
    data = preset("mikv-2").to_dict()
    data["layers"] = {"0": {"key": None}, "2": {"residual_tokens": 64}}
    data["protect"]["balancer"] = "fixed"
    data["balancers"] = {"1": [[1.0] * 16, [2.0] * 16]}
    cfg = config_from_dict(data)
    assert cfg.layer(0).key is None and cfg.layer(0).value == cfg.default.value
    assert cfg.layer(2).residual_tokens == 64 and cfg.layer(1) == cfg.default
    save_config(cfg, tmp_path / "c.json")
    assert load_config(tmp_path / "c.json") == cfg
    for name, p in PRESETS.items():
        assert config_from_dict(json.loads(json.dumps(p.to_dict()))) == p, name


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("default"), "missing 'default'"),
    (lambda d: d.update(version=9), "version 9"),
    (lambda d: d.update(extra=1), "Unknown KV config keys"),
    (lambda d: d["default"].update(key={"bits": 9, "granularity": "per-channel"}),
     "default.key: Invalid bits 9"),
    (lambda d: d["default"].update(key={"bits": 2, "granularity": "per-row"}),
     "allowed: per-token, per-channel, per-tensor"),
    (lambda d: d["default"].update(residual_tokens=-1), "residual_tokens"),
    (lambda d: d.update(layers={"x": {}}), "not a layer index"),
    (lambda d: d.update(protect={"balancer": "sometimes"}), "allowed: off, online, fixed"),
])
def test_malformed_configs_raise_clear_errors(mutate, message):
    data = preset("kivi-2").to_dict()
    mutate(data)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_validation_against_the_model():
    from kvlens.model.architecture import describe

    info = describe(tiny_model("llama"))  # 3 layers, head_dim 16, 2 KV heads
    with pytest.raises(ConfigError, match="group size 32 does not divide head_dim 16; allowed "
                                          "group sizes: 1, 2, 4, 8, 16"):
        validate_for(preset("kivi-2"), info)
    small = LayerKV(QuantSpec(2, "per-channel", 8), QuantSpec(2, "per-token", 8), 16)
    with pytest.raises(ConfigError, match=r"overrides layers \[5\].*allowed indices: 0-2"):
        validate_for(KVConfig("x", small, layers={5: small}), info)
    with pytest.raises(ConfigError, match="head_dim=64, but this model has head_dim=16"):
        validate_for(KVConfig("x", small, model={"head_dim": 64}), info)
    with pytest.raises(ConfigError, match="must divide the residual window 12"):
        validate_for(KVConfig("x", replace(small, residual_tokens=12)), info)
    with pytest.raises(ConfigError, match="needs a residual window"):
        validate_for(KVConfig("x", replace(small, residual_tokens=0)), info)
    validate_for(KVConfig("x", small), info)  # fits
    with pytest.raises(ConfigError, match="Unknown preset .kivi-3.; allowed: exact, fp16, kivi-2"):
        preset("kivi-3")
