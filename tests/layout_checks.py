"""Shared pieces of the block-float layout tests (NVFP4, fp4_e2m1, MXFP8): test tensors with
outliers, a small model to run a cache on, and float64 references of the E4M3 and E2M1 encodings
decoded from their bit fields (independent of torch's float8 casts)."""

from __future__ import annotations

import torch


def outlier_tensor(shape: tuple[int, ...], seed: int | None = None) -> torch.Tensor:
    """Seeded ``[B, H, T, D]`` float32 with log-normal magnitudes (outliers across blocks)."""
    gen = torch.Generator().manual_seed(sum(shape) if seed is None else seed)
    return torch.randn(*shape, generator=gen) * torch.exp(2 * torch.randn(*shape, generator=gen))


def small_llama():
    """A seeded 2-layer Llama, one KV head of 32 channels, in eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, max_position_embeddings=256)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


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


def nearest_code(grid: list[tuple[int, float]], t: float) -> int:
    """The code of ``grid`` (``(code, magnitude)``, positive codes) nearest ``|t|``, ties to the
    even code."""
    code, _ = min(grid, key=lambda cv: (abs(cv[1] - abs(t)), cv[0] & 1))
    return code


E4M3_POSITIVE = [(c, v) for c, v in zip(*e4m3_grid()) if c < 0x80]
E2M1_POSITIVE = [(c, m) for c, m in enumerate((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))]


def e4m3_reference(value: float) -> tuple[int, float]:
    """``(byte, value)`` of the nearest E4M3 number to ``value`` >= 0, ties to even, saturating
    at 448."""
    byte = nearest_code(E4M3_POSITIVE, min(value, 448.0))
    return byte, dict(E4M3_POSITIVE)[byte]


def e2m1_reference_code(value: float) -> int:
    """The 4-bit E2M1 code nearest ``value``, ties to even, saturating at +-6; a negative value
    keeps its sign bit even when it rounds to zero (-0, code 8), as the engines' casts do."""
    return nearest_code(E2M1_POSITIVE, max(-6.0, min(6.0, value))) | (8 if value < 0 else 0)


def prefill_then_decode(model, config, ids: torch.Tensor, prefill: int):
    """``(logits, cache)``: ``ids[:, :prefill]`` in one forward through a compressed cache of
    ``config``, then the rest one token at a time."""
    from kvlens.cache import compressed_attention
    from kvlens.model.hooks import cache_argument_name

    with torch.no_grad(), compressed_attention(model, config) as session:
        cache = session.new_cache()
        kw = {cache_argument_name(model): cache}
        steps = [model(ids[:, :prefill], use_cache=True, **kw).logits]
        steps += [model(ids[:, t:t + 1], use_cache=True, **kw).logits
                  for t in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1), cache


def check_generating_cache(config, max_err: float, codes_per_token: int,
                           scales_per_token: int) -> None:
    """A small Llama with a cache of ``config``: prefill 20 tokens, decode 12. The logits move
    (history is read back quantized) but stay within ``max_err`` (relative) of the exact
    model's, the memory walker finds nothing unaccounted, and the bytes held are the layout's
    prediction: per layer, tensor and quantized token, ``codes_per_token`` element bytes and
    ``scales_per_token`` scale bytes of the one 32-channel KV head."""
    from kvlens.cache import memory_report
    from kvlens.cache.layout import config_part_bytes, shape_of

    model = small_llama()
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact = model(ids).logits
    got, cache = prefill_then_decode(model, config, ids, 20)
    err = (got - exact).abs().max() / exact.abs().max()
    assert 0 < err < max_err
    rep = memory_report(cache)
    assert rep["unaccounted"] == 0
    assert rep["breakdown"] == config_part_bytes(config, shape_of(model), 32)
    held = cache.layers[0].quantized_length
    assert held > 0
    assert (rep["breakdown"]["codes"], rep["breakdown"]["scales"]) == \
        (4 * held * codes_per_token, 4 * held * scales_per_token)


def check_streaming_store(layout, x: torch.Tensor, bytes_per_token: int) -> torch.Tensor:
    """``layout``'s store of ``x`` ``[2, H, 12, D]`` in blocks of 4 tokens, appended 8 then 4,
    reads back ``reconstruct(x)`` exactly; after dropping the oldest 4 it reads back the rest
    and holds ``bytes_per_token`` (and ``part_bytes``) per token and head; after keeping batch
    row 1 it reads back that row. Returns the reference."""
    from kvlens.layouts import Store

    b, h, _, d = x.shape
    want = layout.reconstruct(x, 4)
    store = layout.new_store(d, 4)
    assert isinstance(store, Store)
    store.append(x[:, :, :8])
    store.append(x[:, :, 8:])
    assert torch.equal(store.dequantize_range(0, 12), want)
    store.drop_front(4)
    assert torch.equal(store.dequantize_range(0, 8), want[:, :, 4:])
    held = sum(t.numel() * t.element_size() for t in store.named_tensors().values())
    assert held == b * h * sum(layout.part_bytes(8, d, 4).values()) == b * h * 8 * bytes_per_token
    store.select_batch(torch.tensor([1]))
    assert torch.equal(store.dequantize_range(0, 8), want[1:, :, 4:])
    return want
