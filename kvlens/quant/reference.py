"""The quantization reference: the single definition of what a ``QuantSpec`` does to a tensor.

Plain torch, float32; kernels are tested against it. Tensors are ``[B, H, T, D]``; groups are
the slices of ``kvlens.quant.spec``. Per group with minimum ``m``, maximum ``M`` and ``absmax =
max(|m|, |M|)``:

- asymmetric (default), ``L = 2^b - 1``: ``scale = max((M - m) / L, 1e-8 * absmax,
  FLOAT32_TINY)``, ``zero = m``, ``code = clip(round((x - zero) / scale), 0, L)`` (the floor
  keeps a constant group from dividing by zero; it reconstructs exactly);
- symmetric, ``qmax = 2^(b-1) - 1`` (``b >= 2``): ``scale = max(absmax / qmax, ...)``, ``code =
  clip(round(x / scale), -qmax, qmax) + qmax`` stored unsigned, ``zero = -qmax * scale``;
- ``fit="mse"`` (asymmetric): from the min/max grid, ``MSE_FIT_ITERS`` times re-assign the
  nearest codes and refit ``(scale, zero)`` by least squares, keeping the old pair where the
  codes are all equal or the fit gives ``scale <= 0``; never worse than min/max.

- ``fit="hqq"`` (asymmetric): HQQ's zero-point refinement (hqq 0.2.8,
  ``hqq.core.optimize.optimize_weights_proximal_legacy``, the solver transformers' HQQ cache
  runs): inverse scale ``s = L / (M - m)`` (1 where ``M - m <= 1e-4``, at most ``2e4``), zero
  ``z = -m * s``; up to ``HQQ_ITERS`` times ``q = clip(round(x * s + z), 0, L)``, ``r = (q - z)
  / s``, the error shrunk toward an l_0.7 norm, ``e = sign(x - r) * relu(|x - r| - |x - r|^(p -
  1) / beta)`` (``p = 0.7``, ``beta = 10``), and ``z = mean over the group of (q - (x - e) *
  s)``, stopping at the first step whose mean absolute error over the tensor does not fall
  (keeping that step's ``z``, as HQQ does); the scale never changes. Stored as ``scale = 1 /
  s``, ``zero = -z / s``.
  ``quantize_hqq_strided`` runs the same grid and refinement over hqq's own ``axis=0``
  groups (the flattened tensor viewed as ``[G, numel / G]``), which are not a ``QuantSpec``'s.

Both dequantize as ``x_hat = code * scale + zero``. ``round`` is round-half-to-even and the
division a true division: a kernel that does otherwise may differ by one code at exact ties.
``scale`` and ``zero`` are float32 ``[B, H, ceil(T / bt), D // bd]`` for block shape ``(bt,
bd)``.
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
    """A quantized ``[B, H, T, D]`` tensor: ``codes`` uint8, one unpacked code per element;
    ``scale``, ``zero`` float32 per group (module docstring), ``x_hat = code * scale + zero``; the
    ``spec`` used and the original ``shape``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    spec: QuantSpec
    shape: tuple[int, int, int, int]


def check_tensor(x: torch.Tensor) -> None:
    """``InputError`` unless ``x`` is a floating-point ``[B, H, T, D]`` tensor."""
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise InputError(f"Expected a floating-point tensor, got {x.dtype}.")


def _grouped(x: torch.Tensor, bt: int, bd: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, nT, bt, nD, bd]``; a partial last token group is padded by
    repeating its last token, which leaves its min, max and absmax unchanged."""
    b, h, t, d = x.shape
    pad = -t % bt
    if pad:
        x = torch.cat((x, x[:, :, -1:].expand(b, h, pad, d)), dim=2)
    return x.reshape(b, h, (t + pad) // bt, bt, d // bd, bd)


def at_groups(p: torch.Tensor) -> torch.Tensor:
    """Per-group ``[B, H, nT, nD]`` values broadcastable to ``_grouped``'s groups."""
    return p[:, :, :, None, :, None]


def expand_params(p: torch.Tensor, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Broadcast a per-group ``scale`` or ``zero`` back to the full ``[B, H, T, D]`` shape."""
    b, h, t, d = shape
    bt, bd = spec.block_shape(t, d)
    n_t, n_d = p.shape[2], p.shape[3]
    full = at_groups(p).expand(b, h, n_t, bt, n_d, bd)
    return full.reshape(b, h, n_t * bt, n_d * bd)[:, :, :t]


def quantize(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """Quantize ``x`` ``[B, H, T, D]`` with ``spec`` (in float32); ``ConfigError`` when the
    spec does not fit the shape, ``InputError`` for a tensor that is not 4-D floating point."""
    check_tensor(x)
    spec.check_fits(x.shape)
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
    at = at_groups
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
    inv, z = hqq_grid(lo, hi, levels)
    z = hqq_refine_zero(groups, at_groups(inv), at_groups(z), levels, (3, 5),
                        member_weight(groups, num_tokens))[:, :, :, 0, :, 0]
    scale = 1.0 / inv
    return scale, -z * scale


def hqq_grid(lo: torch.Tensor, hi: torch.Tensor, levels: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """HQQ's starting grid of groups with minimum ``lo`` and maximum ``hi``: ``(inv, z)``, the
    inverse scale (guarded as the module docstring says) and the zero in codes."""
    span = hi - lo
    inv = torch.where(span.abs() <= HQQ_MIN_RANGE, torch.ones_like(span), levels / span)
    inv = inv.clamp(max=HQQ_MAX_INV_SCALE)
    return inv, -lo * inv


def hqq_refine_zero(x: torch.Tensor, inv: torch.Tensor, z: torch.Tensor, levels: int,
                    dims: tuple[int, ...], weight: torch.Tensor | None = None) -> torch.Tensor:
    """HQQ's proximal zero refinement (module docstring) of the groups of ``x`` that run along
    ``dims``; ``inv`` and ``z`` broadcast to ``x`` (``dims`` kept as size 1) and the refined
    ``z`` comes back in that shape. ``weight`` (broadcast to ``x``): 0 for padding members,
    ``None``: every member counts (plain means, as hqq takes them). The early stop reads the
    mean absolute error over all of ``x``."""
    if weight is None:
        def mean(t, dim=None):
            return t.mean() if dim is None else t.mean(dim=dim, keepdim=True)
    else:
        count = torch.broadcast_to(weight, x.shape).sum(dim=dims, keepdim=True)

        def mean(t, dim=None):
            return (weight * t).sum() / count.sum() if dim is None else \
                (weight * t).sum(dim=dim, keepdim=True) / count
    best = float("inf")
    for _ in range(HQQ_ITERS):
        q = torch.round(x * inv + z).clamp_(0, levels)
        err = x - (q - z) / inv
        size = err.abs()
        # (1 / beta) * |e|^(p - 1), multiplied as hqq does (a division rounds differently)
        shrunk = torch.sign(err) * (size - (1.0 / HQQ_BETA) * size.pow(HQQ_LP - 1)).clamp_min(0.0)
        z = mean(q - (x - shrunk) * inv, dims)
        current = float(mean(size))
        if current < best:
            best = current
        else:
            break
    return z


def quantize_hqq_strided(x: torch.Tensor, bits: int, group: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hqq's ``axis=0`` grouping (``Quantizer.quantize(x, axis=0, optimize=True)``) of ``x``
    ``[B, H, T, D]``: flattened row-major and viewed as ``[group, S]`` (``S = numel / group``),
    group ``j`` is the elements ``j, j + S, j + 2S, ...``: one channel's values strided over
    the batch rows, heads and tokens. Each group's grid is ``hqq_grid`` refined by
    ``hqq_refine_zero`` (early stop over the whole tensor); ``code = clip(round(x * inv + z),
    0, L)``. Returns ``(codes, scale, zero)``: uint8 codes ``[B, H, T, D]``, float32 ``scale =
    1 / inv`` and ``zero = z`` (in codes) ``[S]``; ``x_hat = (code - zero) * scale``
    (``dequantize_hqq_strided``). ``InputError`` when ``group`` does not divide ``numel``."""
    check_tensor(x)
    if x.numel() % group:
        raise InputError(f"hqq's axis=0 groups of {group} elements need a tensor whose size is "
                         f"a multiple of {group}; got shape {tuple(x.shape)}.")
    levels = (1 << bits) - 1
    w = x.detach().float().reshape(group, -1)
    inv, z = hqq_grid(w.amin(dim=0, keepdim=True), w.amax(dim=0, keepdim=True), levels)
    z = hqq_refine_zero(w, inv, z, levels, (0,))
    codes = torch.round(w * inv + z).clamp_(0, levels)
    return codes.to(torch.uint8).reshape(x.shape), (1.0 / inv).reshape(-1), z.reshape(-1)


def dequantize_hqq_strided(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           index: torch.Tensor | None = None) -> torch.Tensor:
    """``(code - zero) * scale`` of ``quantize_hqq_strided``'s codes, float32 in the shape of
    ``codes``; ``index``: each code's flat position in the whole tensor when ``codes`` is a
    part of it (default: all of it). Element ``f`` belongs to group ``f mod S``."""
    if index is None:
        index = torch.arange(codes.numel(), device=codes.device).reshape(codes.shape)
    j = index % scale.numel()
    return (codes.float() - zero.float()[j]) * scale.float()[j]


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``code * scale + zero`` -> ``[B, H, T, D]`` in ``dtype`` (computed in float32)."""
    scale = expand_params(q.scale, q.spec, q.shape)
    zero = expand_params(q.zero, q.spec, q.shape)
    return (q.codes.float() * scale + zero).to(dtype)
