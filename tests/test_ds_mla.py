"""vLLM's ``fp8_ds_mla`` cache of an MLA latent row (``kvlens.quant.ds_mla``): the stored bytes
bit for bit against an independent reference written from vLLM's kernel
(``concat_and_cache_ds_mla_kernel``: a float32 scale ``max(amax / 448, FLT_MIN)`` per tile of
128 latent channels, a saturating round-to-nearest-even e4m3 cast of ``x / s``, the RoPE
channels copied as bf16; read back as ``bf16(code * s)``), the held bytes, the refusals and the
CLI."""

from __future__ import annotations

import bisect
import json
import math

import numpy as np
import pytest
import torch
from helpers import held_bytes
from tiny_models import TINY_VOCAB, save_model_dir, tiny_config, tiny_model
from typer.testing import CliRunner

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.engine import EngineStore
from kvlens.cache.layout import config_part_bytes, engine_tensor_bytes, shape_of
from kvlens.cli import app
from kvlens.config import KVConfig, LayerKV, validate_for
from kvlens.config.engine import measured_cache_type, parse_engine_setting
from kvlens.deploy.presets import engine_config
from kvlens.errors import ConfigError
from kvlens.model.architecture import describe
from kvlens.model.header import header_from_config
from kvlens.model.hooks import cache_argument_name
from kvlens.quant.cachetypes import parse_cache_type
from kvlens.quant.ds_mla import DS_MLA, dequantize_ds_mla, quantize_ds_mla
from kvlens.quant.formats import fake_quantize_format, parse_format

runner = CliRunner()

# -- the reference: NumPy float32 arithmetic, e4m3 and bf16 rounding written out by hand -------

E4M3 = [(m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        for e in range(16) for m in range(8)][:0x7F]  # codes 0..126 (0x7F is NaN), ascending
FLT_MIN = np.float32(2.0 ** -126)


def _e4m3_code(q: float) -> int:
    """The e4m3fn code of float ``q``: saturated at 448, nearest value, ties to an even code."""
    sign = 0x80 if math.copysign(1.0, q) < 0 else 0
    a = min(abs(q), E4M3[-1])
    i = bisect.bisect_left(E4M3, a)
    if E4M3[i] != a:
        lo, hi = i - 1, i
        d_lo, d_hi = a - E4M3[lo], E4M3[hi] - a
        i = lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi
    return sign | i


def _e4m3_value(code: int) -> float:
    return (-1.0 if code & 0x80 else 1.0) * E4M3[code & 0x7F]


def _bf16_bits(x) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (no NaN in these tests)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16(x) -> np.ndarray:
    return (_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def _reference_row(row: np.ndarray):
    """One token's row (float32 ``[D]``) -> (codes, scales, rope bits, read-back row), one
    element at a time as vLLM's kernel and its upconvert compute them."""
    d = row.shape[0]
    rope = d % 128
    b = _bf16(row)  # the kernel reads the bf16 activation
    codes, scales, back = [], [], [float(v) for v in b[:rope]]
    for t in range((d - rope) // 128):
        tile = b[rope + 128 * t: rope + 128 * (t + 1)]
        amax = np.float32(0)
        for v in tile:
            amax = max(amax, abs(v))
        s = max(np.float32(amax) / np.float32(448), FLT_MIN)
        scales.append(s)
        for v in tile:
            c = _e4m3_code(float(np.float32(v) / s))
            codes.append(c)
            back.append(float(_bf16(np.float32(_e4m3_value(c)) * s)))
    return (np.array(codes, np.uint8), np.array(scales, np.float32), _bf16_bits(b[:rope]),
            np.array(back, np.float32))


def _reference(x: torch.Tensor):
    """Rows ``[..., D]`` -> the reference's (codes, scales, rope bits, read-back) ``[..., *]``."""
    flat = x.detach().float().reshape(-1, x.shape[-1]).numpy()
    parts = list(zip(*(_reference_row(r) for r in flat)))
    return tuple(np.stack(p).reshape(*x.shape[:-1], -1) for p in parts)


def _planted(rope: int = 64, tiles: int = 4) -> torch.Tensor:
    """``[1, 1, 3, rope + 128 * tiles]``: token 0 plants an all-zero tile, a tile with one huge
    outlier, a tile at the fp8 maximum (values e4m3 holds exactly, amax 448: scale 1) and a tile
    of values so small that the scale floor FLT_MIN applies; tokens 1-2 are random."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1, 3, rope + 128 * tiles, generator=g) * 3
    lat = x[0, 0, 0, rope:].view(tiles, 128)
    lat[0] = 0.0
    lat[1, 5] = 1.0e4
    lat[1, 10:20] = 0.01
    exact = torch.tensor([_e4m3_value(c) for c in range(0, 0x7F, 7)])
    lat[2] = exact[torch.randint(len(exact), (128,), generator=g)] * torch.where(
        torch.rand(128, generator=g) < 0.5, -1.0, 1.0)
    lat[2, 9] = 448.0
    lat[3] = torch.randn(128, generator=g) * 1e-37
    return x


def _assert_stored_like_reference(codes, scales, rope, back, x):
    r_codes, r_scales, r_rope, r_back = _reference(x)
    assert np.array_equal(codes.numpy(), r_codes)
    assert np.array_equal(scales.numpy().view(np.uint32), r_scales.view(np.uint32))
    assert np.array_equal(rope.view(torch.int16).numpy().view(np.uint16), r_rope)
    assert np.array_equal(back.numpy().view(np.uint32), r_back.view(np.uint32))


# -- (a) the format, bit for bit --------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 37, 32 + 128), (1, 2, 5, 64 + 512), (3, 1, 1, 256),
                                   (1, 1, 11, 127 + 384)])
def test_quantize_matches_the_reference_bit_for_bit(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[2])) * 2.5
    x[..., -1] = 0.3  # a float32 value bf16 cannot hold: the row is rounded first
    codes, scales, rope_part = quantize_ds_mla(x)
    rope = shape[-1] % 128
    assert codes.dtype == torch.uint8 and codes.shape == (*shape[:-1], shape[-1] - rope)
    assert scales.dtype == torch.float32 and rope_part.dtype == torch.bfloat16
    back = dequantize_ds_mla(codes, scales, rope_part)
    _assert_stored_like_reference(codes, scales, rope_part, back, x)
    assert torch.equal(fake_quantize_format(x, parse_format("fp8_ds_mla")), back)


def test_planted_tiles():
    x = _planted()
    rows = quantize_ds_mla(x)
    back = dequantize_ds_mla(*rows)
    _assert_stored_like_reference(*rows, back, x)
    s, codes = rows[1][0, 0, 0], rows[0][0, 0, 0].view(4, 128)
    lat_in, lat_out = x[0, 0, 0, 64:].view(4, 128), back[0, 0, 0, 64:].view(4, 128)
    assert s[0] == FLT_MIN and not codes[0].any() and not lat_out[0].any()  # zero tile
    assert codes[1, 5] == 0x7E and lat_out[1, 5] == 9984.0  # bf16(1e4), saturating code 448
    # the outlier's scale flushes its tile's small values (below half e4m3's least step) to 0
    assert not lat_out[1, 10:20].any() and codes[1, 10:20].eq(0).all()
    assert s[2] == 1.0 and torch.equal(lat_out[2], lat_in[2])  # fp8-exact values at scale 1
    assert s[3] == FLT_MIN and codes[3].any()  # the kernel's floor, below amax / 448
    assert torch.equal(back[..., :64], x[..., :64].bfloat16().float())  # RoPE kept as bf16


def test_engine_store_holds_the_reference_bytes():
    """The cache's store, fed in odd chunks (prefill, then one token at a time), holds what the
    reference writes and reads back the reference's rows."""
    x = torch.cat((torch.randn(2, 3, 30, 32 + 512, generator=torch.Generator().manual_seed(3)),
                   _planted(32).expand(2, 3, 3, -1)), dim=2) * 1.5
    store = EngineStore(parse_cache_type("fp8_ds_mla"), x.shape[-1])
    for a, b in ((0, 17), (17, 18), (18, 29), (29, 33)):
        store.append(x[:, :, a:b])
    assert store.length == 33
    _assert_stored_like_reference(store.data, store.scales, store.rope, store.read(), x)
    parts = engine_tensor_bytes(store.ctype, 33, x.shape[-1], 3, batch=2)
    held = {}
    for part, t in store.named_tensors().items():
        held[part] = held.get(part, 0) + t.numel() * t.element_size()
    assert held == {k: v for k, v in parts.items() if v}
    assert sum(held.values()) == 2 * 3 * 33 * DS_MLA.row_bytes(x.shape[-1])


def test_held_bytes_per_token_are_vllms():
    assert DS_MLA.row_bytes(64 + 512) == 656  # vLLM's entry: 512 + 4 * 4 + 2 * 64
    assert DS_MLA.row_bytes(32 + 128) == 128 + 4 + 64
    assert DS_MLA.bits_per_element((1, 1, 1, 576)) == pytest.approx(8 * 656 / 576)


def test_a_row_without_a_latent_tile_is_refused():
    with pytest.raises(ConfigError, match="fewer than 128.*positive multiple of 128"):
        quantize_ds_mla(torch.zeros(1, 1, 2, 100))
    with pytest.raises(ConfigError, match="a row of 64 channels"):
        EngineStore(parse_cache_type("fp8_ds_mla"), 64)


# -- (b) the cache of a tiny DeepSeek V3 -------------------------------------------------------

ROPE, LATENT, LAYERS = 32, 128, 2


def _deepseek_config(latent: int = LATENT):
    import transformers as tf

    return tf.DeepseekV3Config(
        vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=latent, q_lora_rank=None,
        qk_nope_head_dim=24, qk_rope_head_dim=ROPE, v_head_dim=20, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        n_shared_experts=1, max_position_embeddings=1024, n_group=1, topk_group=1)


def _deepseek(latent: int = LATENT):
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(_deepseek_config(latent),
                                               attn_implementation="sdpa").eval()


def test_held_bytes_equal_the_formula_and_the_row_is_stored_once():
    model = _deepseek()
    config = engine_config("vllm:fp8_ds_mla").config
    shape = shape_of(model)
    ids = torch.randint(3, TINY_VOCAB, (1, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), compressed_attention(model, config) as session:
        cache = session.new_cache()
        kw = {cache_argument_name(model): cache}
        logits = model(ids[:, :60], use_cache=True, **kw).logits
        for t in range(60, 80):
            model(ids[:, t:t + 1], use_cache=True, **kw)
    rep = memory_report(cache)
    assert rep["unaccounted"] == 0
    per_token = LATENT + 4 * (LATENT // 128) + 2 * ROPE
    assert rep["kv_bytes"] == held_bytes(cache) == sum(config_part_bytes(config, shape,
                                                                         80).values())
    assert rep["kv_bytes"] == LAYERS * 80 * per_token
    assert rep["kv_bytes_fp16"] == LAYERS * 80 * (ROPE + LATENT) * 2  # one latent row
    layer = cache.layers[0]
    assert layer.kstore is layer.vstore and layer.kstore.rope.shape == (1, 1, 80, ROPE)
    with torch.no_grad():
        exact = model(ids[:, :60]).logits
    assert not torch.equal(logits, exact)  # attention read the quantized rows
    torch.testing.assert_close(logits, exact, atol=0.2, rtol=0)


# -- (c) refusals -------------------------------------------------------------------------------

def test_refused_on_a_model_that_is_not_mla():
    config = engine_config("vllm:fp8_ds_mla").config
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="LlamaForCausalLM is not an MLA model"):
        with compressed_attention(model, config):
            pass
    header = header_from_config(tiny_config("llama").to_dict()).shape  # before any weight loads
    with pytest.raises(ConfigError, match="is not an MLA model; use vllm:fp8"):
        validate_for(config, header)
    validate_for(config, header_from_config(_deepseek_config().to_dict()).shape)  # MLA: accepted


def test_refused_when_the_latent_is_not_whole_tiles():
    config = engine_config("vllm:fp8_ds_mla").config
    with pytest.raises(ConfigError, match="qk_rope_head_dim=32, kv_lora_rank=48"):
        validate_for(config, describe(_deepseek(48)))
    with pytest.raises(ConfigError, match="kv_lora_rank=200"):
        validate_for(config, header_from_config(_deepseek_config(200).to_dict()).shape)


def test_keys_and_values_are_one_row():
    mixed = KVConfig("mixed", LayerKV(key_format="fp8_ds_mla", value_format="f16"))
    with pytest.raises(ConfigError, match="key_format and value_format both to fp8_ds_mla"):
        validate_for(mixed, describe(_deepseek()))


@pytest.mark.parametrize("name,message", [
    ("vllm:fp8_ds_mla@head", "take no @scope, :pP or :sS"),
    ("vllm:fp8_ds_mla:s1", "take no @scope, :pP or :sS"),
    ("sglang:fp8_ds_mla", "fp8_e4m3, fp8_e5m2"),
])
def test_bad_spellings_are_refused(name, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_setting(name)


def test_the_setting_reads_back_and_compare_axes_refuses_it():
    s = parse_engine_setting("VLLM:FP8_DS_MLA:skip=1")
    assert s.name == "vllm:fp8_ds_mla:skip=1" and parse_engine_setting(s.name) == s
    layer = s.kvconfig("x").default
    assert layer.key_format == layer.value_format == "fp8_ds_mla"
    with pytest.raises(ConfigError, match="generate --compare vllm:fp8_ds_mla"):
        measured_cache_type(parse_engine_setting("vllm:fp8_ds_mla"))


# -- (d) the command line -----------------------------------------------------------------------

def test_generate_compares_it_on_an_mla_model(tmp_path, tiny_tokenizer):
    path = save_model_dir(tmp_path / "ds", _deepseek_config(), tiny_tokenizer)
    result = runner.invoke(app, ["generate", "-m", str(path), "--compare", "vllm:fp8_ds_mla",
                                 "--eval", "kld", "--eval-tokens", "96", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["results"]
    assert row["name"] == "vllm:fp8_ds_mla"
    assert row["bits_per_element"] == pytest.approx(16 * (128 + 4 + 64) / ((32 + 128) * 2))
    assert row["kld"]["quantized_share"] == 1.0 and row["kld"]["mean_kld"]["value"] > 0
    result = runner.invoke(app, ["generate", "-m", str(path), "--preset", "vllm:fp8_ds_mla",
                                 "--prompt", "The capital of France is", "--max-new-tokens",
                                 "4"])
    assert result.exit_code == 0, result.output


def test_generate_refuses_it_before_a_non_mla_model_loads(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)  # config.json only: no weights to load
    result = runner.invoke(app, ["generate", "-m", str(tmp_path), "--compare",
                                 "vllm:fp8_ds_mla", "--eval", "kld"])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert text.startswith("error:") and "is not an MLA model" in text
