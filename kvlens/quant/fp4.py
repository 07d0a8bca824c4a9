"""4-bit float (E2M1) KV-cache formats as the engines define them, in plain torch: NVIDIA's
NVFP4 (vLLM / SGLang / TensorRT-LLM ``nvfp4``) and SGLang's ``fp4_e2m1``.

Both cut each token's ``[D]`` vector of one KV head into blocks of ``BLOCK = 16`` consecutive
channels and store each element as an E2M1 code (1 sign bit, 2 exponent bits with bias 1, 1
mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes per byte, the even channel in the
low nibble (``kvlens.quant.packing``'s 4-bit units). They differ in the block scale and in how a
value is rounded to a code:

- **NVFP4** (``quantize_nvfp4``): two-level. A per-tensor float32 ``global_scale`` (one per
  layer for K, one for V: the checkpoint's ``k_scale`` / ``v_scale``, 1.0 when it has none) and
  one E4M3 byte per block, ``s = e4m3(amax / 6 / global_scale)`` (nearest, ties to even,
  saturating at 448; subnormal and zero scales are kept, as the engines' ``cvt`` to
  ``__nv_fp8_e4m3`` keeps them). Each element is ``x * ((1 / global_scale) / s)`` rounded to
  the nearest E2M1 value, ties to even, saturating at +-6 (PTX ``cvt.rn.satfinite.e2m1x2``); a
  block whose scale is 0 stores zeros. Read back ``(code * s) * global_scale``.
- **fp4_e2m1** (``quantize_fp4_e2m1``, SGLang's ``FP4MXBlock16KVQuantizeUtil``): one
  power-of-two scale per block, ``2^e`` with ``e = ceil(log2(max(amax / 6, 1e-10)))``, stored
  as the byte ``e + 127``; each ``x / 2^e`` takes the code of the largest E2M1 magnitude whose
  lower midpoint (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) it reaches: ties round *up* in
  magnitude, not to even, and nothing saturates (``|x / 2^e| <= 6`` by the choice of ``e``).
  ``e`` is computed exactly here (``frexp``); the engine's float32 ``log2`` can differ for an
  ``amax / 6`` within one ulp above a power of two.

Tensors are ``[..., D]`` with ``D`` a multiple of 16; codes come back as ``[..., D / 2]`` uint8
and scales as ``[..., D / 16]`` uint8. Sources (cited with commits in docs/engine-formats.md).
"""

from __future__ import annotations

import torch

from kvlens.quant.packing import pack_codes, unpack_codes

BLOCK = 16  # channels sharing one block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: E2M1 magnitudes by the 3-bit code (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the midpoints between consecutive magnitudes
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E8M0_BIAS = 127
FP4_E2M1_MIN_SCALE = 1e-10  # SGLang's floor on amax / 6 (an all-zero block gets 2^-33)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"FP4 blocks span {BLOCK} channels; the last dimension must be a "
                         f"multiple of {BLOCK}, got {x.shape[-1]}.")
    return x.float().unflatten(-1, (-1, BLOCK))


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where(codes >= 8, -mag, mag)


def e2m1_code(x: torch.Tensor, ties_to_even: bool) -> torch.Tensor:
    """The E2M1 code of ``x`` (float32): the number of midpoints ``|x|`` passes (so beyond 6
    it saturates), a tie going to the even code (NVFP4) or up in magnitude (SGLang's
    ``fp4_e2m1``), the sign in bit 3."""
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = x.abs().unsqueeze(-1)
    if ties_to_even:
        code = (mag > mids).sum(-1)  # the code when no tie
        code = torch.where((mag == mids).any(-1) & (code % 2 == 1), code + 1, code)
    else:
        code = (mag >= mids).sum(-1)  # a tie passes its midpoint: up
    return (code | torch.where(x < 0, 8, 0)).to(torch.uint8)


def _block_values(codes: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes ``[..., D / 2]`` -> float32 values ``[..., D / 16, 16]``."""
    return e2m1_values(unpack_codes(codes, 4, 2 * codes.shape[-1])).unflatten(-1, (-1, BLOCK))


def quantize_nvfp4(x: torch.Tensor, global_scale: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x`` ``[..., D]`` in NVFP4 (module docstring): packed E2M1 bytes
    ``[..., D / 2]`` and E4M3 block-scale bytes ``[..., D / 16]``."""
    blocks = _blocks(x)
    g = torch.tensor(global_scale, dtype=torch.float32)
    amax = blocks.abs().amax(-1)
    s = (amax / E2M1_MAX / g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    s32 = s.float()
    recip = torch.where(s32 > 0, (1.0 / g) / s32, torch.zeros_like(s32))
    codes = e2m1_code(blocks * recip[..., None], ties_to_even=True).flatten(-2)
    return pack_codes(codes, 4), s.view(torch.uint8)


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor,
                     global_scale: float = 1.0) -> torch.Tensor:
    """float32 ``(code * s) * global_scale`` from ``quantize_nvfp4``'s bytes."""
    s = scales.view(torch.float8_e4m3fn).float()[..., None]
    g = torch.tensor(global_scale, dtype=torch.float32)
    return ((_block_values(codes) * s) * g).flatten(-2)


def fp4_e2m1_exponents(x: torch.Tensor) -> torch.Tensor:
    """SGLang ``fp4_e2m1``'s block exponent ``ceil(log2(max(amax / 6, 1e-10)))``, exactly:
    ``[..., D]`` -> ``[..., D / 16]`` int32."""
    y = (_blocks(x).abs().amax(-1) / E2M1_MAX).clamp(min=FP4_E2M1_MIN_SCALE)
    mantissa, exponent = torch.frexp(y)  # y = m 2^E, m in [0.5, 1): ceil(log2 y) = E unless m = .5
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def quantize_fp4_e2m1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x`` ``[..., D]`` in SGLang's ``fp4_e2m1`` (module docstring):
    packed E2M1 bytes ``[..., D / 2]`` and exponent bytes ``e + 127`` ``[..., D / 16]``."""
    e = fp4_e2m1_exponents(x)
    scaled = _blocks(x) / torch.exp2(e.float())[..., None]
    codes = e2m1_code(scaled, ties_to_even=False).flatten(-2)
    return pack_codes(codes, 4), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_fp4_e2m1(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``code * 2^(byte - 127)`` from ``quantize_fp4_e2m1``'s bytes."""
    return (_block_values(codes) * torch.exp2(scales.float() - E8M0_BIAS)[..., None]).flatten(-2)
