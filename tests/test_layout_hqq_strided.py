"""The ``hqq-strided`` layout (``kvlens.layouts.hqq_strided``: transformers' HQQ cache with
``axis=0``): its store against what hqq's own ``Quantizer`` and transformers'
``HQQQuantizedLayer`` hold for the same tokens flushed the same way (batch rows, odd shapes,
several flushes), its held bytes, its JSON form, and a cache of a tiny model that generates with
it and holds exactly the predicted bytes."""

from __future__ import annotations

import pytest
import torch
from layout_checks import check_generating_cache, outlier_tensor, prefill_then_decode, small_llama
from tiny_models import tiny_model

from kvlens.cache import memory_report
from kvlens.cache.layout import config_part_bytes, shape_of
from kvlens.config import KVConfig, LayerKV, config_from_dict, load_config, save_config
from kvlens.config.engine import parse_engine_setting
from kvlens.errors import ConfigError
from kvlens.layouts import Layout, Store, kinds, layout_of
from kvlens.layouts.hqq_strided import HqqStrided
from kvlens.quant import QuantSpec
from kvlens.quant.packing import packed_length
from kvlens.quant.reference import dequantize_hqq_strided, quantize_hqq_strided

# (bits, [B, H, D], group, residual, tokens per update): the first update is a prefill
CASES = [(4, (2, 3, 24), 16, 8, [7, 1, 1, 3, 5, 1, 1, 1, 1, 1, 1, 1, 1, 9, 2, 6]),
         (2, (1, 2, 20), 8, 5, [3, 2, 3, 1, 1, 1, 1, 1, 4, 7]),
         (3, (1, 3, 40), 32, 6, [12, 4, 1, 3, 4, 8]),  # whole groups: T % 4 == 0
         (1, (2, 1, 16), 8, 4, [4, 4, 1, 1, 1, 1, 5]),
         (8, (1, 2, 12), 24, 4, [5, 3, 2, 2, 4])]


def hqqs_layer(bits: int, group: int, residual: int):
    pytest.importorskip("hqq", reason="the hf-caches extra (make install has it)")
    from transformers.cache_utils import HQQQuantizedLayer

    return HQQQuantizedLayer(nbits=bits, axis_key=0, axis_value=0, q_group_size=group,
                             residual_length=residual)


@pytest.mark.parametrize("bits,shape,group,residual,steps", CASES)
def test_the_store_holds_what_transformers_hqq_layer_holds(bits, shape, group, residual, steps):
    """transformers' layer (float32) and the store fed the tokens it quantizes (the prefill,
    then at each flush its window and the new tokens): after every flush both read back the
    same history, to float rounding, batch rows and strided groups included."""
    b, h, d = shape
    layer = hqqs_layer(bits, group, residual)
    store = layout_of(HqqStrided(bits, group)).new_store(d, residual, "float32")
    gen = torch.Generator().manual_seed(bits)
    window, flushes = [], 0
    for i, n in enumerate(steps):
        k = torch.randn(b, h, n, d, generator=gen) * torch.linspace(0.2, 3, d)
        layer.update(k, -k)
        window.append(k)
        if i and sum(w.shape[2] for w in window) < residual:
            continue  # the real layer keeps them exact
        store.append(torch.cat(window, dim=2))
        window, flushes = [], flushes + 1
        real = layer._dequantize(layer._quantized_keys)
        ours = store.dequantize_range(0, store.length)
        step = float(real.amax() - real.amin()) / ((1 << bits) - 1)
        assert ours.shape == real.shape
        assert (ours - real).abs().max() < 1e-4 * step, (i, float((ours - real).abs().max()))
    assert flushes >= 3


@pytest.mark.parametrize("bits", [2, 4])
def test_strided_groups_are_hqqs_and_not_per_channel_blocks(bits):
    """One quantization: hqq's own ``axis=0`` codes and zeros; a per-channel grid over G
    consecutive tokens of one head (kvlens's old simulation) reconstructs differently."""
    pytest.importorskip("hqq")
    from hqq.core.quantize import Quantizer

    x = outlier_tensor((1, 3, 40, 64), seed=bits)
    codes, meta = Quantizer.quantize(x, nbits=bits, axis=0, group_size=64, device="cpu",
                                     compute_dtype=torch.float32, optimize=True)
    meta["compute_dtype"] = torch.float32
    real = Quantizer.dequantize(codes, meta)
    ours = dequantize_hqq_strided(*quantize_hqq_strided(x, bits, 64))
    assert (ours - real).abs().max() <= 1e-5 * (real.amax() - real.amin())
    blocks = layout_of(QuantSpec(bits, "per-channel", 40, fit="hqq")).reconstruct(x, 40)
    assert (blocks - real).abs().max() > 0.1 * (real.amax() - real.amin()) / (1 << bits)


def test_reconstruct_flushes_block_by_block_and_compounds():
    """``reconstruct`` re-quantizes the history at each block: more blocks, more error, and
    one block is one quantization."""
    layout = layout_of(HqqStrided(2, 32))
    x = outlier_tensor((2, 2, 48, 32))
    once = layout.reconstruct(x, 48, "float32")
    assert torch.equal(once, dequantize_hqq_strided(*quantize_hqq_strided(x, 2, 32)))
    flushed = layout.reconstruct(x, 8, "float32")
    assert (flushed - x).norm() > (once - x).norm()


def test_store_streams_drops_and_selects_rows_with_exact_bytes():
    """Appends between two reads are one re-quantization; a drop re-quantizes what stays (with
    any pending flush); keeping a batch row re-quantizes it alone; the bytes held are always
    ``part_bytes`` times the rows."""
    layout = layout_of(HqqStrided(4, 16))
    x = outlier_tensor((2, 3, 24, 32))
    store = layout.new_store(32, 8)
    assert isinstance(layout, Layout) and isinstance(store, Store) and "hqq-strided" in kinds()

    def held():
        return sum(t.numel() * t.element_size() for t in store.named_tensors().values())

    store.append(x[:, :, :8])
    store.append(x[:, :, 8:16])
    first = layout.reconstruct(x[:, :, :16], 16)  # one block: one quantization
    assert torch.equal(store.dequantize_range(0, 16), first)
    assert held() == 6 * sum(layout.part_bytes(16, 32, 8).values()) == 6 * 16 * (16 + 2 * 4)
    store.append(x[:, :, 16:])
    store.drop_front(8)  # a flush and an eviction in one step: one re-quantization
    want = layout.reconstruct(torch.cat((first[:, :, 8:], x[:, :, 16:]), dim=2), 16)
    assert store.length == 16
    assert torch.equal(store.dequantize_range(0, 16), want)
    assert torch.equal(store.dequantize_range(4, 12), want[:, :, 4:12])
    assert held() == 6 * sum(layout.part_bytes(16, 32, 8).values())
    store.select_batch(torch.tensor([1]))
    assert torch.equal(store.dequantize_range(0, 16), layout.reconstruct(want[1:], 16))
    assert held() == 3 * sum(layout.part_bytes(16, 32, 8).values())


def _config() -> KVConfig:
    return KVConfig("hqq-strided", LayerKV(HqqStrided(4, 16), HqqStrided(2, 32), 8))


def test_config_json_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.json"
    save_config(_config(), path)
    assert load_config(path) == _config()
    assert _config().to_dict()["default"]["key"] == {"layout": "hqq-strided", "bits": 4,
                                                    "group": 16}
    data = _config().to_dict()
    data["default"]["key"]["axis"] = 0
    with pytest.raises(ConfigError, match=r"Unknown hqq-strided spec keys \['axis'\]; allowed: "
                                          "layout, bits, group"):
        config_from_dict(data)
    del data["default"]["key"]["axis"], data["default"]["key"]["bits"]
    with pytest.raises(ConfigError, match=r"hqq-strided spec is missing \['bits'\]"):
        config_from_dict(data)
    with pytest.raises(ConfigError, match="bits=9"):
        HqqStrided(9)
    with pytest.raises(ConfigError, match="layer 0: hqq-strided groups of 48 elements must "
                                          "divide each flush of 1 tokens x 32 channels"):
        HqqStrided(4, 48).check(0, 32, "layer 0")
    HqqStrided(4, 48).check(3, 32)  # 3 tokens x 32 channels: whole groups
    with pytest.raises(ConfigError, match="scale_dtype '8bit' is not one of float16, float32"):
        layout_of(HqqStrided(4)).new_store(64, 8, "8bit")


def test_transformers_hqq_axis0_settings_simulate_with_it():
    """``transformers:hqq-B`` maps ``axis=0`` to ``hqq-strided`` and ``axis=1`` to per-token
    groups with HQQ's fit."""
    s = parse_engine_setting("transformers:hqq-2:axis_value=1:group=32")
    layer = s.kvconfig(s.name).default
    assert layer.key == HqqStrided(2, 32)
    assert layer.value == QuantSpec(2, "per-token", 32, fit="hqq")
    assert layer.residual_tokens == 128


def test_a_cache_of_it_generates_and_holds_the_predicted_bytes():
    """Prefill 20 tokens, decode 12 (window 8): the logits move but stay near the exact
    model's, and the bytes held are the layout's prediction: per quantized token of the one
    32-channel head, 16 code bytes and two float16 scales (G16)."""
    check_generating_cache(KVConfig("k", LayerKV(HqqStrided(4, 16), HqqStrided(4, 16), 8)),
                           0.3, packed_length(32, 4), 2 * 2)


def test_keys_and_values_of_two_widths_hold_the_predicted_bytes():
    config = _config()
    model = small_llama()
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    _, cache = prefill_then_decode(model, config, ids, 20)
    rep = memory_report(cache)
    assert rep["unaccounted"] == 0
    assert rep["breakdown"] == config_part_bytes(config, shape_of(model), 32)
    assert rep["breakdown"]["codes"] > 0


def test_a_sliding_layer_keeps_what_it_no_longer_sees_and_holds_the_predicted_bytes():
    """On a model with sliding-window layers (window 8) an hqq-strided layer keeps every token,
    as transformers' HQQ layers do, and the mask hides the old ones: the bytes held are the
    prediction; a uniform layout's sliding layers still evict."""
    model = tiny_model("gemma3")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    held = {}
    for name, spec in (("strided", HqqStrided(4, 16)), ("uniform", QuantSpec(4, "per-token"))):
        config = KVConfig(name, LayerKV(spec, spec, 4))
        logits, cache = prefill_then_decode(model, config, ids, 24)
        assert torch.isfinite(logits).all()
        rep = memory_report(cache)
        assert rep["unaccounted"] == 0
        assert rep["breakdown"] == config_part_bytes(config, shape_of(model), 40)
        sliding = [layer for layer in cache.layers if layer.is_sliding]
        held[name] = [(layer.q_start, layer.quantized_length) for layer in sliding]
    assert held["strided"] == [(0, 40), (0, 40)]  # every token, none dropped
    assert all(q_start > 0 and n < 40 for q_start, n in held["uniform"])
