"""Cross-layer prediction of keys and values, with only the residual quantized (AQUA-KV).

AQUA-KV (Shutova et al., 2025, "Cache Me If You Must: Adaptive Key-Value Quantization for Large
Language Models", arXiv 2501.19392) predicts a layer's keys from the previous layer's and its
values from keys and values it already holds, with small fitted linear maps, and quantizes only
what the prediction misses: ``x_hat = p + Q(x - p)``. The predictors are trained on the
*reconstructed* (quantized) caches of the layers before, because that is what a decoder holds
when it reads layer ``l``; this module keeps that contract: a predictor's input is whatever the
caller passes, and the callers (``kvlens.analysis.compare.predict``) pass reconstructions.

Here a predictor is one ridge regression per layer and tensor: the input features of one token
are the concatenated ``[H, D]`` vectors of its input tensors (all KV heads, so every KV head of
layer ``l`` is predicted from every head of its inputs), the output its ``[H, D]`` target, plus
an intercept. Tensors are ``[B, H, T, D]`` (B = samples); the features of a token are
``[sum(H_i * D_i)]``.

Fitting never sees the data it is evaluated on: ``cross_fit_predict`` predicts each sample with
a predictor fitted on the other samples (leave one sample out). The weights are model-side (one
set per layer, like a fitted codebook); ``predictor_bytes`` counts them (float16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlens.errors import InputError

PREDICTOR_BYTES_PER_WEIGHT = 2  # float16 weights and intercept
# Ridge penalty relative to the mean input feature variance: lam = ridge * trace(Xc^T Xc) / F.
DEFAULT_RIDGE = 1e-2


@dataclass(frozen=True)
class LinearPredictor:
    """``y = x @ weight + bias``: ``weight`` ``[F_in, F_out]``, ``bias`` ``[F_out]``
    (float64; the caller rounds to the stored dtype if it wants to)."""

    weight: torch.Tensor
    bias: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., F_in]`` -> ``[..., F_out]`` float32."""
        if x.shape[-1] != self.weight.shape[0]:
            raise InputError(
                f"Predictor input has {x.shape[-1]} features; it was fitted on "
                f"{self.weight.shape[0]}."
            )
        return (x.double() @ self.weight + self.bias).float()


def fit_ridge(x: torch.Tensor, y: torch.Tensor, ridge: float = DEFAULT_RIDGE) -> LinearPredictor:
    """Ridge regression of ``y`` ``[N, F_out]`` on ``x`` ``[N, F_in]`` with an unpenalised
    intercept: minimises ``||y - x W - b||² + lam ||W||²`` with
    ``lam = ridge * trace(Xc^T Xc) / F_in`` (``Xc``: ``x`` centred per feature), so ``ridge`` is
    relative to the inputs' mean variance and does not depend on their scale. ``F_in = 0``
    gives the intercept-only predictor (the mean of ``y``). Solved in float64."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise InputError(
            f"Expected x [N, F_in] and y [N, F_out] with the same N, got {tuple(x.shape)} and "
            f"{tuple(y.shape)}."
        )
    if x.shape[0] < 1:
        raise InputError("Cannot fit a predictor on no rows.")
    if not (isinstance(ridge, (int, float)) and not isinstance(ridge, bool) and ridge >= 0):
        raise InputError(f"Invalid ridge {ridge!r}; allowed: a number >= 0.")
    x = x.double()
    y = y.double()
    mx = x.mean(0)
    my = y.mean(0)
    if x.shape[1] == 0:
        return LinearPredictor(torch.zeros(0, y.shape[1], dtype=torch.float64), my)
    xc = x - mx
    gram = xc.T @ xc
    lam = ridge * float(torch.diagonal(gram).sum()) / x.shape[1]
    gram += (lam + 1e-12 * max(float(gram.diagonal().max()), 1.0)) * torch.eye(
        x.shape[1], dtype=torch.float64)
    weight = torch.linalg.solve(gram, xc.T @ (y - my))
    return LinearPredictor(weight, my - mx @ weight)


def token_features(*tensors: torch.Tensor) -> torch.Tensor:
    """``[B, H_i, T, D_i]`` tensors -> ``[B, T, sum(H_i * D_i)]``: each token's vectors of every
    head of every tensor, concatenated (head-major)."""
    if not tensors:
        raise InputError("No tensors to take features from.")
    b, _, t, _ = _check(tensors[0])
    parts = []
    for x in tensors:
        xb, h, xt, d = _check(x)
        if (xb, xt) != (b, t):
            raise InputError(
                f"Predictor inputs disagree on samples/tokens: {tuple(tensors[0].shape)} vs "
                f"{tuple(x.shape)}."
            )
        parts.append(x.float().permute(0, 2, 1, 3).reshape(b, t, h * d))
    return torch.cat(parts, dim=-1)


def from_token_features(y: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[B, T, H * D]`` -> ``[B, H, T, D]`` (the inverse of ``token_features`` for one tensor)."""
    b, t, f = y.shape
    if f != heads * head_dim:
        raise InputError(f"{f} features do not make {heads} heads of {head_dim}.")
    return y.reshape(b, t, heads, head_dim).permute(0, 2, 1, 3)


def cross_fit_predict(inputs: Sequence[torch.Tensor], target: torch.Tensor,
                      ridge: float = DEFAULT_RIDGE) -> torch.Tensor:
    """Predict ``target`` ``[B, H, T, D]`` from ``inputs`` (``[B, H_i, T, D_i]`` each, possibly
    none), each sample by a predictor fitted on the *other* samples (leave one sample out), so
    no sample is predicted by a map fitted on it. With no inputs the prediction is the other
    samples' mean vector per head (the intercept). Returns ``[B, H, T, D]`` float32.

    Needs at least two samples (``InputError`` otherwise)."""
    b, h, t, d = _check(target)
    if b < 2:
        raise InputError(
            "Cross-layer prediction needs at least 2 captured samples: each sample is predicted "
            "by a map fitted on the others (capture with --samples 2 or more)."
        )
    x = (token_features(*inputs) if inputs
         else torch.zeros(b, t, 0, dtype=torch.float32, device=target.device))
    if x.shape[:2] != (b, t):
        raise InputError(
            f"Predictor inputs {tuple(x.shape[:2])} do not match target samples/tokens {(b, t)}."
        )
    y = token_features(target)
    out = torch.empty_like(y)
    for s in range(b):
        rest = [i for i in range(b) if i != s]
        n = len(rest) * t
        fit = fit_ridge(x[rest].reshape(n, x.shape[-1]), y[rest].reshape(n, y.shape[-1]), ridge)
        out[s] = fit(x[s])
    return from_token_features(out, h, d)


def fit_predict(train_inputs: Sequence[torch.Tensor], train_target: torch.Tensor,
                inputs: Sequence[torch.Tensor], target: torch.Tensor,
                ridge: float = DEFAULT_RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit on every sample of ``train_inputs`` -> ``train_target`` (``[B, H, T, D]``: a
    calibration capture) and predict ``target`` (another capture's tensor, any number of
    samples and tokens; only its shape is read) from ``inputs`` (its inputs, as many as
    ``train_inputs``). Returns ``(prediction of target, in-sample prediction of
    train_target)``, float32 ``[B, H, T, D]`` each (the second for a calibration chain)."""
    b, h, t, d = _check(train_target)
    eb, eh, et, ed = _check(target)
    if (eh, ed) != (h, d) or len(inputs) != len(train_inputs):
        raise InputError(
            f"Calibration ({len(train_inputs)} inputs -> {tuple(train_target.shape)}) and "
            f"evaluation ({len(inputs)} inputs -> {tuple(target.shape)}) do not match."
        )

    def feats(tensors, nb, nt, like):
        return (token_features(*tensors) if tensors
                else torch.zeros(nb, nt, 0, dtype=torch.float32, device=like.device))

    x = feats(train_inputs, b, t, train_target)
    xe = feats(inputs, eb, et, target)
    y = token_features(train_target)
    fit = fit_ridge(x.reshape(b * t, x.shape[-1]), y.reshape(b * t, y.shape[-1]), ridge)
    return from_token_features(fit(xe), h, d), from_token_features(fit(x), h, d)


def quantize_residual(x: torch.Tensor, prediction: torch.Tensor, fake_quantize) -> torch.Tensor:
    """``prediction + fake_quantize(x - prediction)``: any layout (a ``QuantSpec``, a codebook...)
    applied to what the prediction misses, ``[B, H, T, D]`` float32 in ``x``'s frame."""
    _check(x)
    if prediction.shape != x.shape:
        raise InputError(
            f"Prediction of shape {tuple(prediction.shape)} does not fit {tuple(x.shape)}."
        )
    p = prediction.float()
    return p + fake_quantize(x.float() - p)


def explained_variance(x: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
    """Share of ``x``'s variance a prediction explains, per head: ``1 - SSE_h / SST_h`` with
    ``SST_h`` the squared deviation from the head's per-channel mean over samples and tokens,
    ``[H]`` float32 (1: perfect; 0: no better than the mean; negative: worse)."""
    _check(x)
    x = x.double()
    err = ((x - prediction.double()) ** 2).sum(dim=(0, 2, 3))
    tot = ((x - x.mean(dim=(0, 2), keepdim=True)) ** 2).sum(dim=(0, 2, 3))
    return (1.0 - err / tot.clamp_min(1e-30)).float()


def predictor_shape(num_kv_heads: int, head_dim: int, inputs: int) -> tuple[int, int]:
    """``(F_in, F_out)`` of one layer's predictor of one tensor from ``inputs`` tensors of the
    layer's shape (keys: 1, the previous layer's keys; values: 2, the layer's keys and the
    previous layer's values; 0: intercept only)."""
    f = num_kv_heads * head_dim
    return inputs * f, f


def predictor_bytes(num_kv_heads: int, head_dim: int, inputs: int) -> int:
    """Bytes one layer stores for one tensor's predictor: float16 weights ``[F_in, F_out]`` and
    intercept ``[F_out]`` (``predictor_shape``)."""
    f_in, f_out = predictor_shape(num_kv_heads, head_dim, inputs)
    return PREDICTOR_BYTES_PER_WEIGHT * (f_in * f_out + f_out)


def _check(x: torch.Tensor) -> tuple[int, int, int, int]:
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise InputError(f"Expected a floating-point tensor, got {x.dtype}.")
    return tuple(x.shape)
