"""Coupled (CQ) keys and values in the compressed cache (research, issue #50 step 2): the store's
reads equal decode-then-attend on odd shapes (lookup tables and chunk decode), a cache layer
equals the reference with window and sinks, held bytes equal the layout, the config's JSON form
round-trips, `generate --config` runs it on a tiny model, and bad input is refused clearly."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import reference_attention, stored_view, stub_session
from tiny_models import tiny_model
from typer.testing import CliRunner

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.cache import held_bytes
from kvlens.cache.coupled import CoupledStore
from kvlens.cache.layer import CompressedLayer
from kvlens.cache.layout import config_bits, config_part_bytes, shape_of
from kvlens.cache.torch_read import packed_attention
from kvlens.cache.triton_glue import kernel_layout_problem
from kvlens.cli import app
from kvlens.config import (
    GearSettings,
    KVConfig,
    LayerKV,
    MikvSettings,
    config_from_dict,
    load_config,
    save_config,
    validate_for,
)
from kvlens.config.coupled import books_for
from kvlens.errors import ConfigError, InputError
from kvlens.model.hooks import cache_argument_name
from kvlens.quant import QuantSpec
from kvlens.quant.coupled import (
    CoupledSpec,
    coupled_arrays,
    coupled_codebooks,
    encode_coupled,
    fake_quantize_coupled,
    fit_coupled,
)


def _books(spec, h, d, seed=0, t=96):
    """Codebooks of ``spec`` fitted on seeded correlated data (queries for ``weighted``), as a
    config stores them (float16), for ``h`` KV heads of head_dim ``d``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, h, t, d, generator=gen) @ torch.randn(d, d, generator=gen) * 0.5
    q = torch.randn(1, 3 * h, t, d, generator=gen) * torch.rand(d, generator=gen) * 2
    books = fit_coupled(x, replace(spec, iters=4), q if spec.weighted else None)
    a = coupled_arrays(books)
    return coupled_codebooks(spec, a["centroids"], h, d, a.get("permutation"), a.get("weights"))


def _filled(books, x, chunks=(5, 1, 11)):
    store = CoupledStore(books)
    t0 = 0
    for c in (*chunks, x.shape[2]):  # appended in uneven pieces, as decoding does
        t1 = min(x.shape[2], t0 + c)
        if t1 > t0:
            store.append(x[:, :, t0:t1])
        t0 = t1
    return store


# channels, index bits, grouping, scope, weighted, head_dim, query rows, tables?
STORE_CASES = [
    (2, 4, "consecutive", "group", False, 12, 3, True),     # decode rows: lookup tables
    (2, 4, "consecutive", "group", False, 12, 40, False),   # prefill rows: chunk decode
    (4, 6, "correlation", "head", True, 12, 1, True),       # permutation, per-head, weighted
    (4, 6, "correlation", "head", True, 12, 33, False),
    (2, 5, "hadamard", "layer", False, 24, 1, True),        # Hadamard blocks of 8 (24 = 3 x 8)
    (8, 3, "hadamard", "group", True, 24, 40, False),       # 8 channels, 3-bit indices
]


@pytest.mark.parametrize("c,bits,grouping,scope,weighted,d,m,tables", STORE_CASES)
def test_store_reads_equal_decode_then_attend(c, bits, grouping, scope, weighted, d, m, tables):
    """Scores and value sums of the store (lookup tables or chunk decode, as the sizes choose)
    equal the same products over ``decode_coupled``'s keys and values; the store holds exactly
    the reference encoder's indices."""
    gen = torch.Generator().manual_seed(c * 10 + bits)
    b, h, t = 2, 3, 37
    spec = CoupledSpec(c, bits, grouping, scope, weighted)
    books = _books(spec, h, d)
    x = torch.randn(b, h, t, d, generator=gen) * 1.5
    store = _filled(books, x)
    assert store.length == t and store.packed.dtype == torch.uint8
    assert torch.equal(store.indices(0, t), encode_coupled(x, books).long())
    ref = fake_quantize_coupled(x, books=books)
    torch.testing.assert_close(store.dequantize(), ref)
    t0, t1 = 3, 34  # an inner chunk of 31 tokens
    assert store._use_tables(m, t1 - t0) == tables  # the case says which read it checks
    q = torch.randn(b, h, m, d, generator=gen)
    p = torch.rand(b, h, m, t1 - t0, generator=gen)
    chunk = ref[:, :, t0:t1]
    torch.testing.assert_close(store.key_scores(q, t0, t1), q @ chunk.transpose(-1, -2),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(store.value_out(p, t0, t1), p @ chunk, rtol=1e-5, atol=1e-5)


def test_held_bytes_equal_reported_and_stores_drop_and_select():
    spec = CoupledSpec(4, 10, "correlation", "head", weighted=True)  # 10-bit: unaligned packing
    books = _books(spec, 2, 16)
    store = CoupledStore(books, block=4)
    codebook_only = spec.codebook_bytes(2, 16)
    assert store.held_bytes() == store.reported_bytes() == codebook_only
    x = torch.randn(3, 2, 12, 16, generator=torch.Generator().manual_seed(5))
    store.append(x)
    assert store.packed.shape == (3, 2, 12, spec.index_bytes(16)) == (3, 2, 12, 5)
    assert store.held_bytes() == store.reported_bytes() == spec.held_bytes(12, 2, 16, batch=3)
    assert store.held_bytes() == 3 * 2 * 12 * 5 + codebook_only
    full = store.dequantize()
    store.drop_front(8)
    torch.testing.assert_close(store.dequantize(), full[:, :, 8:])
    with pytest.raises(ValueError, match="whole blocks"):
        store.drop_front(3)
    store.select_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(store.dequantize(), full[[2, 0], :, 8:])
    assert store.held_bytes() == spec.held_bytes(4, 2, 16, batch=2)


# -- a cache layer --------------------------------------------------------------------------------


@pytest.mark.parametrize("kspec,vspec,r,flush,total,sinks,chunk", [
    (CoupledSpec(2, 4), CoupledSpec(4, 6, "correlation", "head"), 16, 8, 70, 4, 32),
    (CoupledSpec(2, 5, "hadamard", weighted=True), QuantSpec(4, "per-token"), 0, 0, 53, 0, 16),
    (QuantSpec(2, "per-channel", 8), CoupledSpec(2, 4, scope="layer"), 16, 0, 83, 0, 64),
])
def test_cache_layer_equals_reference(kspec, vspec, r, flush, total, sinks, chunk):
    """A CompressedLayer with coupled keys and/or values, prefilled then decoded token by token,
    batch 2 with row 1 left-padded, GQA 6/2 (head_dim 16): its prefill and decode attention
    equal "code the flushed part with the reference quantizer, attend" with the fp16 window
    and the sinks exact."""
    gen = torch.Generator().manual_seed(total)
    b, hq, hkv, d = 2, 6, 2, 16
    k = torch.randn(b, hkv, total, d, generator=gen) * torch.rand(1, 1, total, 1, generator=gen)
    k[:, :, 0] *= 8  # an outlier first token, as real keys have
    v = torch.randn(b, hkv, total, d, generator=gen)
    kbooks = _books(kspec, hkv, d, 1) if isinstance(kspec, CoupledSpec) else None
    vbooks = _books(vspec, hkv, d, 2) if isinstance(vspec, CoupledSpec) else None
    mikv = MikvSettings(0.0, sinks, "off") if sinks else None
    layer = CompressedLayer(LayerKV(kspec, vspec, r, flush_tokens=flush), 0, d, mikv=mikv,
                            session=stub_session(), key_centroids=kbooks, value_centroids=vbooks)
    seen = total - 1
    layer.update(k[:, :, :30], v[:, :, :30])
    layer.commit(torch.randn(b, hq, 30, d, generator=gen), None)
    for t in range(30, seen):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, hq, 1, d, generator=gen), None)
    n_q = layer.quantized_length
    assert n_q > 0 and (layer.n_res > 0) == (r > 0)
    f = flush or r or 1

    def held(x, spec, books):  # what the layer holds of x: coded blocks, fp16 window, sinks
        x16 = x[:, :, :seen].half().float()
        if books is None:
            out = stored_view(x[:, :, :seen], spec, f, n_q)
        else:
            out = torch.cat((fake_quantize_coupled(x16[:, :, :n_q], books=books),
                             x16[:, :, n_q:]), 2)
        out[:, :, :sinks] = x16[:, :, :sinks]
        return out

    keys, values = held(k, kspec, kbooks), held(v, vspec, vbooks)
    mask = torch.ones(b, 1, 1, seen, dtype=torch.bool)
    mask[1, ..., :5] = False
    q = torch.randn(b, hq, 1, d, generator=gen)
    out, _ = packed_attention(q, layer, mask, d ** -0.5, chunk_tokens=chunk)
    torch.testing.assert_close(out, reference_attention(q, keys, values, mask),
                               rtol=1e-5, atol=1e-5)
    # a prefill-sized query block (the last 9 positions, causal): the chunk-decode read
    tq = 9
    qp = torch.randn(b, hq, tq, d, generator=gen)
    causal = torch.ones(seen, seen, dtype=torch.bool).tril()[None, None, seen - tq:]
    causal = causal.expand(b, 1, tq, seen).clone()
    causal[1, ..., :5] = False
    out, _ = packed_attention(qp, layer, causal, d ** -0.5, chunk_tokens=chunk)
    torch.testing.assert_close(out, reference_attention(qp, keys, values, causal),
                               rtol=1e-5, atol=1e-5)


# -- configs, bytes and generate ------------------------------------------------------------------

KSPEC = CoupledSpec(2, 4, "correlation", weighted=True)
VSPEC = CoupledSpec(4, 6, scope="head")
HSPEC = CoupledSpec(2, 5, "hadamard", "layer")


def _config(h=2, d=16, name="tiny-coupled") -> KVConfig:
    """Coupled keys and values with a window, a sliding block and sinks (default); layer 1
    uniform keys beside Hadamard-grouped coupled values; layer 2 exact."""
    entry = {"key": coupled_arrays(_books(KSPEC, h, d, 1)),
             "value": coupled_arrays(_books(VSPEC, h, d, 2))}
    default = LayerKV(KSPEC, VSPEC, 16, flush_tokens=8)
    layers = {1: LayerKV(QuantSpec(2, "per-token", 8), HSPEC, 16), 2: LayerKV()}
    return KVConfig(name, default, layers, mikv=MikvSettings(0.0, 4, "off"),
                    coupled_codebooks={0: entry, 1: {"value": coupled_arrays(
                        _books(HSPEC, h, d, 3))}})


def test_config_round_trip(tmp_path):
    config = _config()
    assert config.format_version == 6
    path = tmp_path / "coupled.json"
    save_config(config, path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 6 and doc["default"]["key"]["channels"] == 2
    assert set(doc["coupled_codebooks"]["0"]["key"]) == {"centroids", "permutation", "weights"}
    loaded = load_config(path)
    assert loaded == config and loaded.default.coupled("key") == KSPEC
    # the cache's codebooks from the file code exactly as the fitted ones
    books = books_for(loaded, 0, "key", 2, 16)
    fitted = _books(KSPEC, 2, 16, 1)
    x = torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(9))
    assert torch.equal(encode_coupled(x, books), encode_coupled(x, fitted))
    assert books_for(loaded, 1, "key", 2, 16) is None  # uniform keys
    older = dict(doc, version=5)
    with pytest.raises(ConfigError, match="version 6"):
        config_from_dict(older)


def _check_bytes(cache, config, shape, tokens):
    rep = memory_report(cache)
    assert rep["unaccounted"] == 0 and rep["kv_bytes"] == held_bytes(cache)
    assert rep["breakdown"] == config_part_bytes(config, shape, tokens), tokens
    assert rep["bits_per_element"] == pytest.approx(config_bits(config, shape, tokens))
    return rep


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_held_bytes_equal_the_layout_while_decoding(arch):
    """Prompts of 1 and 40 tokens, then decode: the bytes the cache holds are what memory_report
    reports and what kvlens.cache.layout predicts, part by part (gemma3: sliding layers drop
    whole blocks of the coupled history)."""
    model = tiny_model(arch, max_positions=512)
    config = _config()
    shape = shape_of(model)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad(), compressed_attention(model, config) as session:
        for prompt in (1, 40):
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            ids = torch.randint(3, 128, (1, prompt + 34), generator=gen)
            model(ids[:, :prompt], use_cache=True, **kw)
            _check_bytes(cache, config, shape, prompt)
            for step in range(1, 35):
                model(ids[:, prompt + step - 1:prompt + step], use_cache=True, **kw)
                if step in (1, 17, 34):
                    rep = _check_bytes(cache, config, shape, prompt + step)
            assert rep["breakdown"]["codebooks"] > 0 and rep["breakdown"]["codes"] > 0


def test_generate_runs_a_coupled_config(tiny_model_dir, tmp_path):
    """`generate --config`-style: a coupled config file runs through `generate --compare` with
    the KLD eval on a tiny random Llama (head_dim 16, 2 KV heads), on the torch path, and holds
    fewer bits than the exact cache."""
    path = tmp_path / "tiny-coupled.json"
    save_config(_config(), path)
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_model_dir), "--compare",
                                      f"exact,{path}", "--eval", "kld", "--eval-tokens", "96",
                                      "--chunk", "16", "--json"])
    assert result.exit_code == 0, result.output
    exact, ours = json.loads(result.stdout)["results"]
    assert ours["name"] == "tiny-coupled"
    assert 0 < ours["kld"]["mean_kld"]["value"] < 5
    assert ours["bits_per_element"] < exact["bits_per_element"]
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_model_dir), "--config",
                                      str(path), "--prompt", "Hello", "--max-new-tokens", "3",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["results"][0]["name"] == "tiny-coupled"


# -- bad input ----------------------------------------------------------------------------------


def _info(d=16, h=2, layers=3):
    return SimpleNamespace(num_layers=layers, head_dim=d, num_key_value_heads=h,
                           declares_rope=True, architecture="Synthetic")


@pytest.mark.parametrize("make,message", [
    (lambda: LayerKV(KSPEC, None, 16, rotate_keys=True), "rotate_keys cannot be combined"),
    (lambda: LayerKV(None, VSPEC, 16, rotate_values=True), "rotate_values cannot be combined"),
    (lambda: LayerKV(KSPEC, None, 16, pre_rope_keys=True), "pre_rope_keys"),
    (lambda: LayerKV(KSPEC, None, 16, center_keys=True), "center_keys"),
    (lambda: replace(_config(), gear=GearSettings(layers=(0,))), "gear cannot be combined"),
    (lambda: replace(_config(), coupled_codebooks={2: {"key": {"centroids": [[[0.0]]]}}}),
     "does not store its keys with a coupled spec"),
    (lambda: replace(_config(), coupled_codebooks={0: {"key": {"centroids": [[[0.0, 1.0]]]}}}),
     "centroids: allowed: a list of codebooks, each 16 centroids of 2"),
    (lambda: replace(_config(), coupled_codebooks={0: {"key": {
        "centroids": [[[0.0, 1.0]] * 16], "weights": [[1.0] * 16] * 2}}}),
     'needs "permutation"'),
    (lambda: replace(_config(), coupled_codebooks={0: {"value": {
        "centroids": [[[0.0] * 4] * 64], "permutation": [list(range(16))] * 2}}}),
     'takes no "permutation"'),
])
def test_bad_configs_are_refused(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_bad_shapes_against_the_model_are_refused():
    config = _config()
    validate_for(config, _info())  # the shape it was made for
    with pytest.raises(ConfigError, match="do not divide head_dim 10"):
        validate_for(replace(config, coupled_codebooks={}, default=LayerKV(
            CoupledSpec(4, 4), None, 16), layers={}), _info(d=10))
    with pytest.raises(ConfigError, match="layer 0 key: .*codebooks, centroids, channels"):
        validate_for(config, _info(d=32))  # 16 codebooks fitted for head_dim 16
    with pytest.raises(ConfigError, match="permutation must be 3 rows"):
        validate_for(config, _info(h=3))
    missing = replace(config, coupled_codebooks={1: config.coupled_codebooks[1]})
    with pytest.raises(ConfigError, match="gives no codebooks; add coupled_codebooks.0.key"):
        validate_for(missing, _info())
    balanced = replace(config, mikv=MikvSettings(0.0, 4, "online"))
    with pytest.raises(ConfigError, match="channel balancer"):
        validate_for(balanced, _info())


def test_store_refuses_bad_input_and_the_kernel_says_why():
    books = _books(CoupledSpec(2, 4), 2, 16)
    store = CoupledStore(books)
    with pytest.raises(InputError, match=r"Expected \[B, 2, t, 16\]"):
        store.append(torch.randn(1, 2, 3, 8))
    with pytest.raises(InputError, match="CoupledCodebooks"):
        CoupledStore(None)
    with pytest.raises(ConfigError, match="no codebooks of that spec"):
        CompressedLayer(LayerKV(CoupledSpec(2, 4), None, 16), 0, 16, session=stub_session())
    assert "coupled keys" in kernel_layout_problem(LayerKV(KSPEC, QuantSpec(4, "per-token")), 16)
    assert "coupled values" in kernel_layout_problem(
        LayerKV(QuantSpec(4, "per-token"), VSPEC), 16)


# -- configs from a capture (kvlens.recommend.coupled) and the study's choice of setting ---------


def test_configs_from_a_capture_fit_each_layer_on_its_own_tensors(tmp_path):
    """Planted: layer 1's keys and values are layer 0's times 10, so its codebooks are fitted
    on its own tensors (10x the centroids), not shared; the config runs the tiny shape."""
    from helpers import make_capture

    from kvlens.recommend.coupled import capture_shape, coupled_config, fit_codebooks

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, h, 40, 16, generator=gen) for h in (4, 2, 2))
    path = make_capture(tmp_path / "cap.h5", q, k, v, layers=2,
                        per_layer={1: {"k": 10 * k, "v": 10 * v}})
    kspec, vspec = CoupledSpec(2, 3, weighted=True, iters=3), CoupledSpec(4, 4, iters=3)
    books = fit_codebooks(str(path), kspec, vspec)
    assert set(books) == {0, 1} and set(books[0]) == {"key", "value"}
    direct = fit_coupled(k, kspec, q)
    torch.testing.assert_close(books[0]["key"].centroids, direct.centroids)
    torch.testing.assert_close(books[1]["value"].centroids, 10 * books[0]["value"].centroids,
                               rtol=2e-3, atol=1e-3)
    shape = capture_shape(str(path))
    assert (shape.num_layers, shape.kv_heads, shape.head_dim) == (2, 2, 16)
    config = coupled_config("from-capture", kspec, vspec, books, 2, residual_tokens=16,
                            flush_tokens=8)
    validate_for(config, _info(layers=2))
    assert config.default.coupled("key") == kspec and config.mikv.sink_tokens == 4
    priced = coupled_config("priced", kspec, vspec, None, 2)  # bytes only: no codebooks
    assert config_bits(priced, shape, 4096) == pytest.approx(config_bits(
        replace(config, default=replace(config.default, residual_tokens=128, flush_tokens=32)),
        shape, 4096))
    with pytest.raises(ConfigError, match="gives no codebooks"):
        validate_for(priced, _info(layers=2))
    with pytest.raises(InputError, match="No coupled codebooks for layers"):
        coupled_config("short", kspec, vspec, books, 3)


def test_the_study_picks_the_largest_setting_within_the_budget():
    from pathlib import Path

    from test_benchmarks import load_script

    from kvlens.cache.layout import ModelShape
    from kvlens.quant.coupled import parse_coupled

    study = load_script(Path(__file__).parents[1] / "benchmarks/studies/coupled_kld.py")
    shape = ModelShape(30, 3, 64)  # SmolLM2
    settings = [parse_coupled(s) for s in ("c2b4", "c2b5", "c2b6")]
    # held bits at 4096 tokens: codes (4000 tokens flushed: 96 wait in the window) + the fp16
    # window buffer (128 tokens: 0.5 bit) + sinks + codebooks: c2b5 2.9989; weighted keys add
    # their float16 channel weights (3 x 64 x 2 bytes a layer) and c2b5 no longer fits 3.0
    key, value, bits = study.pick_setting(settings, 3.0, shape, 4096, weighted=False)
    assert (key.name, value.name) == ("c2b5", "c2b5") and 2.99 < bits <= 3.0
    key, value, bits = study.pick_setting(settings, 3.0, shape, 4096, weighted=True)
    assert (key.name, value.name) == ("c2b4+weighted", "c2b4") and 2.4 < bits <= 2.5
    assert study.pick_setting(settings, 2.0, shape, 4096, weighted=False) is None
