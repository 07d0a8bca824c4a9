"""Bit packing of quantization codes into bytes (the storage form kernels read).

Layout (Triton kernels mirror it exactly):

- Codes of ``bits`` bits are stored in *containers* of ``container_bits(bits)`` bits:
  1 -> 1, 2 -> 2, 3 -> 4, 4 -> 4, 5..8 -> 8. So 3-bit codes are stored in 4-bit containers
  (two per byte, the top container bit always 0) and 5-7-bit codes in whole bytes; storage
  accounting still reports the *nominal* bits unless asked for containers
  (``kvlens.quant.accounting``).
- ``8 // container_bits`` codes share one byte along the packed dimension, **little-endian
  within the byte**: element ``j`` of a byte occupies bits ``[j*c, (j+1)*c)``, so the first
  element sits in the lowest bits. For 2 bits, codes ``(a, b, c, d)`` become the byte
  ``a | b << 2 | c << 4 | d << 6``.
- A length that is not a multiple of the codes per byte is padded with zero codes at the end;
  ``unpack_codes`` takes the original ``length`` and drops the padding.
"""

from __future__ import annotations

import torch

from kvlens.errors import ConfigError, InputError

ALLOWED_BITS = tuple(range(1, 9))


def container_bits(bits: int) -> int:
    """Bits of the container a ``bits``-bit code is stored in (a power of two)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ALLOWED_BITS:
        raise ConfigError(f"Cannot pack {bits!r}-bit codes; allowed bits: 1-8.")
    return 1 if bits == 1 else 2 if bits == 2 else 4 if bits <= 4 else 8


def codes_per_byte(bits: int) -> int:
    return 8 // container_bits(bits)


def packed_length(length: int, bits: int) -> int:
    """Bytes needed for ``length`` codes along the packed dimension."""
    per = codes_per_byte(bits)
    return -(-length // per)


def pack_codes(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack uint8 ``codes`` (each ``< 2^bits``) along ``dim``; that dimension shrinks to
    ``ceil(n / codes_per_byte(bits))`` bytes. Other dimensions are unchanged."""
    cbits = container_bits(bits)
    if codes.dtype != torch.uint8:
        raise InputError(f"Codes must be uint8, got {codes.dtype}.")
    if codes.numel() and int(codes.max()) >= (1 << bits):
        raise InputError(
            f"Code {int(codes.max())} does not fit in {bits} bits (max {(1 << bits) - 1})."
        )
    if cbits == 8:
        return codes.clone()
    per = 8 // cbits
    x = codes.movedim(dim, -1)
    n = x.shape[-1]
    pad = -n % per
    if pad:
        x = torch.cat((x, x.new_zeros(*x.shape[:-1], pad)), dim=-1)
    x = x.reshape(*x.shape[:-1], (n + pad) // per, per)
    packed = torch.zeros(x.shape[:-1], dtype=torch.uint8, device=codes.device)
    for j in range(per):
        packed |= x[..., j] << (j * cbits)
    return packed.movedim(-1, dim)


def unpack_codes(packed: torch.Tensor, bits: int, length: int, dim: int = -1) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 codes with ``length`` entries along ``dim``."""
    cbits = container_bits(bits)
    if packed.dtype != torch.uint8:
        raise InputError(f"Packed codes must be uint8, got {packed.dtype}.")
    x = packed.movedim(dim, -1)
    if x.shape[-1] != packed_length(length, bits):
        raise InputError(
            f"{x.shape[-1]} packed bytes cannot hold exactly {length} "
            f"{bits}-bit codes (expected {packed_length(length, bits)} bytes)."
        )
    if cbits == 8:
        return x.clone().movedim(-1, dim)
    per = 8 // cbits
    mask = (1 << cbits) - 1
    parts = [(x >> (j * cbits)) & mask for j in range(per)]
    out = torch.stack(parts, dim=-1).reshape(*x.shape[:-1], x.shape[-1] * per)
    return out[..., :length].movedim(-1, dim)
