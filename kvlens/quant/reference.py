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

- ``fit="mse"`` (asymmetric only): start from the min/max grid above, then ``MSE_FIT_ITERS``
  times re-assign codes (``clip(round((x - zero) / scale), 0, L)``, the nearest grid point) and
  refit ``(scale, zero)`` by least squares of ``x`` on the codes, keeping the old pair where the
  codes are all equal or the fit gives ``scale <= 0``. Each step lowers (or keeps) the group's
  squared error, so the result is never worse than min/max; it clips the range where rare
  extreme values cost more error than they save (for a Gaussian group of 128 at 2 bits, about
  half the squared error). The last assignment's codes are stored.

- ``fit="hqq"`` (asymmetric only): HQQ's zero-point refinement (hqq 0.2.8,
  ``hqq.core.optimize.optimize_weights_proximal_legacy``, the solver transformers' HQQ cache
  runs). In HQQ's terms, inverse scale ``s = L / (M - m)`` (1 where ``M - m <= 1e-4``, at most
  ``2e4``) and code-unit zero ``z = -m * s``; then up to ``HQQ_ITERS`` times: codes
  ``q = clip(round(x * s + z), 0, L)``, ``r = (q - z) / s``, the error shrunk toward an
  l_0.7 norm, ``e = sign(x - r) * relu(|x - r| - |x - r|^(p - 1) / beta)`` (``p = 0.7``,
  ``beta = 10``), and ``z = mean over the group of (q - (x - e) * s)``; it stops at the first
  step whose mean absolute error over the whole tensor does not fall (keeping that step's
  ``z``, as HQQ does). The scale is never changed. Stored as ``scale = 1 / s``,
  ``zero = -z / s``.

All dequantize the same way, ``x_hat = code * scale + zero``, so consumers (kernels) need no
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
MSE_FIT_ITERS = 8
# HQQ's proximal solver (module docstring): lp norm, beta, steps, and its guards on the scale
HQQ_LP, HQQ_BETA, HQQ_ITERS = 0.7, 10.0, 20
HQQ_MIN_RANGE, HQQ_MAX_INV_SCALE = 1e-4, 2e4
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
    if spec.fit == "mse":
        scale, lo = _mse_fit(groups, scale, lo, spec.levels, shape[2])
    elif spec.fit == "hqq":
        scale, lo = _hqq_fit(groups, lo, hi, spec.levels, shape[2])
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


def member_weight(groups: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[1, 1, nT, bt, 1, 1]`` weights of ``_grouped`` groups: 1 for the ``num_tokens`` real
    tokens, 0 for the padding of a partial last token group."""
    n_t, bt = groups.shape[2], groups.shape[3]
    w = torch.ones(n_t * bt, dtype=groups.dtype, device=groups.device)
    w[num_tokens:] = 0
    return w.reshape(1, 1, n_t, bt, 1, 1)


def _mse_fit(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int,
             num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Alternate nearest-code assignment and a least-squares ``(scale, zero)`` refit per group
    (module docstring). Padding tokens of a partial last token group get weight 0."""
    w = member_weight(groups, num_tokens)
    dims = (3, 5)
    n = w.sum(dim=dims) * groups.shape[5]  # members per group (padding excluded)
    padded = num_tokens < groups.shape[2] * groups.shape[3]

    def weighted(t):  # w * t, skipped where every weight is 1 (the same numbers)
        return w * t if padded else t

    mx = weighted(groups).sum(dim=dims) / n

    def at(p):
        return p[:, :, :, None, :, None]

    centred = groups - at(mx)
    for _ in range(MSE_FIT_ITERS):
        c = torch.sub(groups, at(zero)).div_(at(scale)).round_().clamp_(0, levels)
        mc = weighted(c).sum(dim=dims) / n
        dc = c.sub_(at(mc))
        var = (weighted(dc) * dc).sum(dim=dims)
        cov = (weighted(dc) * centred).sum(dim=dims)
        s_new = cov / var.clamp_min(FLOAT32_TINY)
        ok = (var > 0) & (s_new > scale * SCALE_FLOOR_REL) & torch.isfinite(s_new)
        scale = torch.where(ok, s_new, scale)
        zero = torch.where(ok, mx - s_new * mc, zero)
    return scale, zero


def _hqq_fit(groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int,
             num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HQQ's zero-point refinement per group (module docstring) -> ``(scale, zero)`` in
    kvlens's form. Padding tokens of a partial last token group get weight 0."""
    w = member_weight(groups, num_tokens)
    dims = (3, 5)
    n = w.sum(dim=dims) * groups.shape[5]
    total = n.sum()

    def at(p):
        return p[:, :, :, None, :, None]

    span = hi - lo
    inv = torch.where(span.abs() <= HQQ_MIN_RANGE, torch.ones_like(span), levels / span)
    inv = inv.clamp(max=HQQ_MAX_INV_SCALE)
    z = -lo * inv
    best = float("inf")
    for _ in range(HQQ_ITERS):
        q = torch.round(groups * at(inv) + at(z)).clamp_(0, levels)
        err = groups - (q - at(z)) / at(inv)
        size = err.abs()
        shrunk = torch.sign(err) * (size - size.pow(HQQ_LP - 1) / HQQ_BETA).clamp_min(0.0)
        z = (w * (q - (groups - shrunk) * at(inv))).sum(dim=dims) / n
        current = float((w * size).sum() / total)
        if current < best:
            best = current
        else:
            break
    scale = 1.0 / inv
    return scale, -z * scale


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``code * scale + zero`` -> ``[B, H, T, D]`` in ``dtype`` (computed in float32)."""
    scale = expand_params(q.scale, q.spec, q.shape)
    zero = expand_params(q.zero, q.spec, q.shape)
    return (q.codes.float() * scale + zero).to(dtype)
