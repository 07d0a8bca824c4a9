"""The quantization reference: the single definition of what a ``QuantSpec`` does to a tensor.

Plain torch, float32. Analysis and generation call these functions; Triton kernels are tested
against them. Tensors are ``[B, H, T, D]``; groups are the slices described in
``kvlens.quant.spec``.

Formulas, per group with minimum ``m``, maximum ``M`` and ``absmax = max(|m|, |M|)``:

- Asymmetric (default), ``L = 2^b - 1``::

      scale = max((M - m) / L, 1e-8 * absmax, FLOAT32_TINY)
      zero  = m
      code  = clip(round((x - zero) / scale), 0, L)

  The floor on ``scale`` keeps a constant group from dividing by zero; such a group gets
  code 0 and reconstructs exactly (``0 * scale + m == m``).
- Symmetric, ``qmax = 2^(b-1) - 1`` (restricted range, needs ``b >= 2``)::

      scale = max(absmax / qmax, 1e-8 * absmax, FLOAT32_TINY)
      code  = clip(round(x / scale), -qmax, qmax) + qmax     # stored unsigned, 0..2*qmax
      zero  = -qmax * scale

  The grid is ``{-qmax..qmax} * scale``: zero is exact and ``+absmax`` / ``-absmax`` are both
  representable; code ``2^b - 1`` is never used (one level is given up for symmetry).

Both dequantize the same way, ``x_hat = code * scale + zero``, so consumers (kernels) need no
symmetric/asymmetric switch. ``round`` is round-half-to-even (``torch.round``, IEEE ``rint``) and
the division is a true division, not a multiply by a reciprocal; a kernel that does otherwise may
differ by one code at exact ties.

Shapes of ``scale`` and ``zero`` (float32) for ``x`` of shape ``[B, H, T, D]``:
per-token ``[B, H, T, D // G]``; per-channel ``[B, H, ceil(T / G), D]``; per-tensor
``[B, H, 1, 1]``. In general ``[B, H, ceil(T / bt), D // bd]`` for block shape ``(bt, bd)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.errors import InputError
from kvlens.quant.spec import QuantSpec

SCALE_FLOOR_REL = 1e-8
FLOAT32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class QTensor:
    """A quantized ``[B, H, T, D]`` tensor.

    codes: uint8 ``[B, H, T, D]``, one unpacked code per element (see ``kvlens.quant.packing``
        for the packed form).
    scale, zero: float32, shaped per granularity (module docstring); ``x_hat = code*scale+zero``.
    spec: the ``QuantSpec`` used.
    shape: the original ``(B, H, T, D)``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    spec: QuantSpec
    shape: tuple[int, int, int, int]


def _check_input(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise InputError(f"Expected a floating-point tensor, got {x.dtype}.")
    spec.check_fits(x.shape)


def _grouped(x: torch.Tensor, bt: int, bd: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, nT, bt, nD, bd]``.

    A partial last token group is padded by repeating its last token, which leaves the group's
    min, max and absmax unchanged (the padding only copies members of the same group)."""
    b, h, t, d = x.shape
    pad = -t % bt
    if pad:
        x = torch.cat((x, x[:, :, -1:].expand(b, h, pad, d)), dim=2)
    return x.reshape(b, h, (t + pad) // bt, bt, d // bd, bd)


def expand_params(p: torch.Tensor, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Broadcast a per-group ``scale`` or ``zero`` back to the full ``[B, H, T, D]`` shape."""
    b, h, t, d = shape
    bt, bd = spec.block_shape(t, d)
    n_t, n_d = p.shape[2], p.shape[3]
    full = p[:, :, :, None, :, None].expand(b, h, n_t, bt, n_d, bd)
    return full.reshape(b, h, n_t * bt, n_d * bd)[:, :, :t]


def quantize(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """Quantize ``x`` ``[B, H, T, D]`` with ``spec`` (computed in float32).

    Raises ``ConfigError`` when the spec does not fit the shape (per-token ``G`` not dividing
    ``D``) and ``InputError`` for a tensor that is not 4-D floating point."""
    _check_input(x, spec)
    x = x.detach().float()
    shape = tuple(x.shape)
    bt, bd = spec.block_shape(shape[2], shape[3])
    groups = _grouped(x, bt, bd)
    lo = groups.amin(dim=(3, 5))
    hi = groups.amax(dim=(3, 5))
    absmax = torch.maximum(lo.abs(), hi.abs())
    if spec.symmetric:
        qmax = (1 << (spec.bits - 1)) - 1
        raw = absmax / qmax
    else:
        raw = (hi - lo) / spec.levels
    scale = torch.maximum(raw, absmax * SCALE_FLOOR_REL).clamp_min(FLOAT32_TINY)
    scale_full = expand_params(scale, spec, shape)
    if spec.symmetric:
        signed = torch.round(x / scale_full).clamp_(-qmax, qmax)
        codes = signed + qmax
        zero = -qmax * scale
    else:
        zero = lo
        codes = torch.round((x - expand_params(zero, spec, shape)) / scale_full)
        codes.clamp_(0, spec.levels)
    return QTensor(codes.to(torch.uint8), scale, zero, spec, shape)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``code * scale + zero`` -> ``[B, H, T, D]`` in ``dtype`` (computed in float32)."""
    scale = expand_params(q.scale, q.spec, q.shape)
    zero = expand_params(q.zero, q.spec, q.shape)
    return (q.codes.float() * scale + zero).to(dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``dequantize(quantize(x, spec))`` in ``x``'s dtype: what a consumer of the cache sees."""
    return dequantize(quantize(x, spec), dtype=x.dtype)
