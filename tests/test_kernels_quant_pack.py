"""Triton quantize-and-pack (``kvlens_kernels.quant_pack``) vs the reference library.

Runs on CPU through the Triton interpreter (TRITON_INTERPRET=1 is set in conftest). Codes and
scales must be *bit-identical* to ``kvlens.quant.quantize`` + ``pack_codes``; outputs are written
into poisoned buffers so an element the kernel never writes fails the comparison.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from kvlens_kernels import quantize_pack_keys, quantize_pack_values  # noqa: E402

from kvlens.errors import InputError  # noqa: E402
from kvlens.quant import QuantSpec, pack_codes, quantize  # noqa: E402

POISON_BYTE = 0xA5


def _poisoned(codes_shape, param_shape, scale_dtype):
    return (torch.full(codes_shape, POISON_BYTE, dtype=torch.uint8),
            torch.full(param_shape, float("nan"), dtype=scale_dtype),
            torch.full(param_shape, float("nan"), dtype=scale_dtype))


def _data(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2.0 + 0.3
    x[..., :5, 1] = 0.75  # a constant channel run -> constant key group (scale floor)
    x[..., 2, :] = -1.25  # a constant token -> constant value groups
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_keys_bit_exact(bits, group):
    # T = 67: partial last token group and (2-bit) a partial last byte.
    x = _data((1, 2, 67, 64), seed=bits * 1000 + group)
    spec = QuantSpec(bits, "per-channel", group)
    ref = quantize(x, spec)
    per = 8 // (2 if bits == 2 else 4 if bits == 4 else 8)
    out = _poisoned((1, 2, -(-67 // per), 64), tuple(ref.scale.shape), torch.float32)
    codes, scale, zero = quantize_pack_keys(x, bits, group, scale_dtype=torch.float32, out=out)
    assert torch.equal(codes, pack_codes(ref.codes, bits, dim=2))
    assert torch.equal(scale, ref.scale)
    assert torch.equal(zero, ref.zero)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_values_bit_exact(bits, group):
    x = _data((2, 1, 33, 128), seed=bits * 100 + group)
    spec = QuantSpec(bits, "per-token", group)
    ref = quantize(x, spec)
    per = 8 // (2 if bits == 2 else 4 if bits == 4 else 8)
    out = _poisoned((2, 1, 33, 128 // per), tuple(ref.scale.shape), torch.float32)
    codes, scale, zero = quantize_pack_values(x, bits, group, scale_dtype=torch.float32, out=out)
    assert torch.equal(codes, pack_codes(ref.codes, bits, dim=3))
    assert torch.equal(scale, ref.scale)
    assert torch.equal(zero, ref.zero)


def test_ties_round_half_to_even():
    # A group with min 0 and max 3 at 2 bits has scale exactly 1: x = k + 0.5 is an exact tie.
    row = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.5] * 4)  # 32 channels
    x = row.repeat(1, 1, 3, 1)
    codes, _, _ = quantize_pack_values(x, 2, 32, scale_dtype=torch.float32)
    ref = quantize(x, QuantSpec(2, "per-token", 32))
    assert torch.equal(codes, pack_codes(ref.codes, 2, dim=3))
    assert ref.codes[0, 0, 0, 2:5].tolist() == [0, 2, 2]  # half-to-even: 0.5->0, 1.5->2, 2.5->2


def test_fp16_input_fp16_scales_and_cache_slices():
    """fp16 activations, fp16 scales (the cache default) written into a slice of a larger,
    preallocated buffer -- what the cache's flush does -- leaving the rest untouched."""
    x = _data((1, 2, 64, 128), seed=7).half()
    ref_k = quantize(x, QuantSpec(2, "per-channel", 32))
    ref_v = quantize(x, QuantSpec(4, "per-token", 64))
    kbuf = _poisoned((1, 2, 48, 128), (1, 2, 6, 128), torch.float16)  # capacity 192 tokens
    kout = tuple(t[:, :, 16:32] if i == 0 else t[:, :, 2:4] for i, t in enumerate(kbuf))
    quantize_pack_keys(x, 2, 32, out=kout)
    assert torch.equal(kbuf[0][:, :, 16:32], pack_codes(ref_k.codes, 2, dim=2))
    assert torch.equal(kbuf[1][:, :, 2:4], ref_k.scale.half())
    assert torch.equal(kbuf[2][:, :, 2:4], ref_k.zero.half())
    assert (kbuf[0][:, :, :16] == POISON_BYTE).all() and kbuf[1][:, :, :2].isnan().all()
    codes, scale, zero = quantize_pack_values(x, 4, 64)
    assert scale.dtype == torch.float16
    assert torch.equal(codes, pack_codes(ref_v.codes, 4, dim=3))
    assert torch.equal(scale, ref_v.scale.half()) and torch.equal(zero, ref_v.zero.half())


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(1, 1, 8, 64)
    with pytest.raises(InputError, match="allowed bits: 1-8"):
        quantize_pack_keys(x, 9, 32)
    with pytest.raises(InputError, match="3-bit codes are packed 8 per 3 bytes"):
        quantize_pack_values(x, 3, 32)  # dense widths: pack_codes writes them, not this kernel
    with pytest.raises(InputError, match="4-D"):
        quantize_pack_keys(x[0], 2, 32)
    with pytest.raises(InputError, match="does not divide head_dim 64"):
        quantize_pack_values(x, 2, 48)
    with pytest.raises(InputError, match="multiple of 4"):
        quantize_pack_keys(x, 2, 6)
    with pytest.raises(InputError, match="asymmetric"):
        quantize_pack_keys(x, 2, 32, symmetric=True)
    with pytest.raises(InputError, match="dtype"):
        quantize_pack_keys(x.to(torch.int32), 2, 32)
    with pytest.raises(InputError, match="expected"):
        quantize_pack_values(x, 2, 32, out=_poisoned((1, 1, 8, 8), (1, 1, 8, 2), torch.float16))
