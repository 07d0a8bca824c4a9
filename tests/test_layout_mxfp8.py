"""The MXFP8 layout (``kvlens.research.mxfp8``), added through the layout protocol alone: its
bytes against an independent E4M3/E8M0 reference, its store against its reference, and a
config naming it read, validated, run, priced and counted by the rest of kvlens unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.layout import config_part_bytes, shape_of
from kvlens.config import KVConfig, LayerKV, config_from_dict, load_config, save_config
from kvlens.errors import ConfigError
from kvlens.layouts import Layout, Store, kinds, layout_of
from kvlens.model.hooks import cache_argument_name
from kvlens.research.mxfp8 import MxFp8, quantize_mxfp8


def e4m3_grid() -> tuple[list[int], list[float]]:
    """Every finite ``float8_e4m3fn`` byte and its value, decoded from the bit fields (sign,
    4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is subnormal; 0x7F/0xFF NaN)."""
    codes, values = [], []
    for byte in range(256):
        s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
        if e == 0xF and m == 0x7:
            continue
        mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        codes.append(byte)
        values.append(-mag if s else mag)
    return codes, values


def reference_mxfp8(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The OCP MX v1.0 conversion, element by element in float64: the shared exponent from
    ``frexp`` of the block's largest magnitude, the nearest E4M3 value (ties to the even code),
    saturating at 448."""
    grid = [(c, v) for c, v in zip(*e4m3_grid()) if c < 0x80]  # magnitudes; the sign is v's
    out_codes, out_scales = [], []
    for block in x.double().reshape(-1, 32).tolist():
        amax = max(abs(v) for v in block)
        e = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
        out_scales.append(e + 127)
        for v in block:
            t = min(448.0, abs(v) / 2.0 ** e)
            code, _ = min(grid, key=lambda cv: (abs(cv[1] - t), cv[0] & 1))
            out_codes.append(code | (0x80 if math.copysign(1.0, v) < 0 else 0))
    return out_codes, out_scales


@pytest.mark.parametrize("shape", [(1, 1, 1, 32), (2, 3, 5, 64), (1, 2, 7, 96)])
def test_bytes_equal_an_independent_reference(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * torch.exp(4 * torch.randn(*shape, generator=gen))
    x[..., :32] *= 0  # an all-zero block
    x.view(-1)[-1] = 3e4  # a block whose largest element saturates
    x.view(-1)[-2] = 1e-6  # deep in the subnormal range of its block
    codes, scales = quantize_mxfp8(x)
    want_codes, want_scales = reference_mxfp8(x)
    assert codes.flatten().tolist() == want_codes
    assert scales.flatten().tolist() == want_scales
    assert 0x7E in want_codes  # the saturated element (448) is among them


def test_store_reads_back_the_reference_and_streams():
    layout = layout_of(MxFp8())
    assert isinstance(layout, Layout) and "mxfp8" in kinds()
    x = torch.randn(2, 3, 12, 64, generator=torch.Generator().manual_seed(1))
    want = layout.reconstruct(x, 4)
    store = layout.new_store(64, 4)
    assert isinstance(store, Store)
    store.append(x[:, :, :8])
    store.append(x[:, :, 8:])
    assert torch.equal(store.dequantize_range(0, 12), want)
    # saturation at 448 can clip a block's largest element by up to 1/8 (the floor rule)
    assert 0 < (want - x).abs().max() < 0.13 * x.abs().max()
    assert (want - x).norm() < 0.05 * x.norm()
    store.drop_front(4)
    assert torch.equal(store.dequantize_range(0, 8), want[:, :, 4:])
    held = sum(t.numel() * t.element_size() for t in store.named_tensors().values())
    assert held == 2 * 3 * sum(layout.part_bytes(8, 64, 4).values()) == 2 * 3 * 8 * (64 + 2)
    store.select_batch(torch.tensor([1]))
    assert torch.equal(store.dequantize_range(0, 8), want[1:, :, 4:])


def _config() -> KVConfig:
    return KVConfig("mxfp8", LayerKV(MxFp8(), MxFp8(), residual_tokens=8))


def test_config_json_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.json"
    save_config(_config(), path)
    assert load_config(path) == _config()
    data = _config().to_dict()
    data["default"]["key"]["bits"] = 8
    with pytest.raises(ConfigError, match="Unknown mxfp8 spec keys"):
        config_from_dict(data)
    with pytest.raises(ConfigError, match="must be a multiple of 32; got 16"):
        layout_of(MxFp8()).check(8, 16, "layer 0")


def _model():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, max_position_embeddings=256)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_a_cache_of_it_generates_and_holds_the_predicted_bytes():
    """Prefill 20 tokens, decode 12: the logits stay near the exact model's (8-bit floats) but
    differ (history is read back quantized), and the bytes held are the layout's prediction."""
    model, config = _model(), _config()
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact = model(ids).logits
        with compressed_attention(model, config) as session:
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            steps = [model(ids[:, :20], use_cache=True, **kw).logits]
            steps += [model(ids[:, t:t + 1], use_cache=True, **kw).logits for t in range(20, 32)]
    got = torch.cat(steps, dim=1)
    err = (got - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.05
    rep = memory_report(cache)
    assert rep["unaccounted"] == 0
    assert rep["breakdown"] == config_part_bytes(config, shape_of(model), 32)
    held = cache.layers[0].quantized_length  # per layer and tensor, one KV head of 32 channels
    assert held > 0
    assert (rep["breakdown"]["codes"], rep["breakdown"]["scales"]) == (4 * held * 32, 4 * held)


def test_without_the_lab_a_config_naming_it_says_what_to_import():
    """MXFP8 is research: a fresh process that has not imported kvlens.research refuses a config
    naming it, saying to import it (the CLI does)."""
    import subprocess
    import sys

    code = ("from kvlens.config import config_from_dict\n"
            "from kvlens.errors import ConfigError\n"
            f"doc = {_config().to_dict()!r}\n"
            "try:\n    config_from_dict(doc)\nexcept ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "Unknown layout 'mxfp8'" in out and "kvlens.research is imported" in out
