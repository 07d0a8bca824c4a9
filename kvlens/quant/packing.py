"""Bit packing of quantization codes into bytes (the storage form kernels read).

Layout (the Triton decode kernel mirrors it exactly): ``b``-bit codes take ``b`` bits each, in
*units* of ``U`` codes filling ``W`` whole bytes (``pack_unit(b) = (U, W)``, ``U * b = 8 * W``:
3-bit codes are 8 in 3 bytes). A unit's ``W`` bytes are one little-endian integer and code ``j``
occupies its bits ``[j*b, (j+1)*b)`` (2 bits: ``(a, b, c, d)`` -> ``a | b << 2 | c << 4 | d <<
6``; a 3-bit code may straddle two bytes). A length that is not a multiple of ``U`` is padded
with zero codes; ``unpack_codes`` takes the original ``length`` and drops them.
"""

from __future__ import annotations

import math

import torch

from kvlens.errors import ConfigError, InputError, is_int


def pack_unit(bits: int) -> tuple[int, int]:
    """``(U, W)``: ``U`` codes of ``bits`` bits fill exactly ``W`` bytes (the packing unit)."""
    if not is_int(bits, 1, 8):
        raise ConfigError(f"Cannot pack {bits!r}-bit codes; allowed bits: 1-8.")
    w = bits // math.gcd(bits, 8)
    return 8 * w // bits, w


def packed_length(length: int, bits: int) -> int:
    """Bytes needed for ``length`` codes along the packed dimension (whole units)."""
    u, w = pack_unit(bits)
    return -(-length // u) * w


def pack_codes(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack uint8 ``codes`` (each ``< 2^bits``) along ``dim``; that dimension shrinks to
    ``packed_length(n, bits)`` bytes. Other dimensions are unchanged."""
    u, w = pack_unit(bits)
    if codes.dtype != torch.uint8:
        raise InputError(f"Codes must be uint8, got {codes.dtype}.")
    if codes.numel() and int(codes.max()) >= (1 << bits):
        raise InputError(f"Code {int(codes.max())} does not fit in {bits} bits (max "
                         f"{(1 << bits) - 1}).")
    if u == 1:
        return codes.clone()
    x = codes.movedim(dim, -1)
    n = x.shape[-1]
    pad = -n % u
    if pad:
        x = torch.cat((x, x.new_zeros(*x.shape[:-1], pad)), dim=-1)
    x = x.reshape(*x.shape[:-1], (n + pad) // u, u)
    if w == 1:
        packed = torch.zeros(x.shape[:-1], dtype=torch.uint8, device=codes.device)
        for j in range(u):
            packed |= x[..., j] << (j * bits)
    else:  # the unit as one little-endian integer (at most 56 bits), then its bytes
        word = torch.zeros(x.shape[:-1], dtype=torch.int64, device=codes.device)
        for j in range(u):
            word |= x[..., j].long() << (j * bits)
        packed = torch.stack([(word >> (8 * k)) & 255 for k in range(w)], dim=-1)
        packed = packed.to(torch.uint8).reshape(*x.shape[:-2], -1)
    return packed.movedim(-1, dim)


def unpack_codes(packed: torch.Tensor, bits: int, length: int, dim: int = -1) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 codes with ``length`` entries along ``dim``."""
    u, w = pack_unit(bits)
    if packed.dtype != torch.uint8:
        raise InputError(f"Packed codes must be uint8, got {packed.dtype}.")
    x = packed.movedim(dim, -1)
    if x.shape[-1] != packed_length(length, bits):
        raise InputError(f"{x.shape[-1]} packed bytes cannot hold exactly {length} "
                         f"{bits}-bit codes (expected {packed_length(length, bits)} bytes).")
    if u == 1:
        return x.clone().movedim(-1, dim)
    mask = (1 << bits) - 1
    if w == 1:
        parts = [(x >> (j * bits)) & mask for j in range(u)]
    else:
        units = x.reshape(*x.shape[:-1], -1, w).long()
        word = units[..., 0].clone()
        for k in range(1, w):
            word |= units[..., k] << (8 * k)
        parts = [((word >> (j * bits)) & mask).to(torch.uint8) for j in range(u)]
    out = torch.stack(parts, dim=-1).reshape(*x.shape[:-1], -1)
    return out[..., :length].movedim(-1, dim)
