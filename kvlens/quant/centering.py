"""Key centering: subtract one mean key vector per (layer, KV head) before quantizing keys.

Tensors are ``[B, H, T, D]``; a mean ``mu`` is ``[H, D]`` (one ``[D]`` vector per KV head),
computed from a capture (``key_mean``: the mean over samples and tokens) and stored once per
layer (``centering_bytes``: float16, ``2 * H * D`` bytes).

Why it is exact (post-RoPE keys). Every score of a query ``q`` against a centred key is
``q · (k_j - mu) = q · k_j - q · mu``: the same shift for every key ``j`` the query reads, and
softmax is invariant to a constant shift of its inputs, so the attention weights and output
are unchanged (with the model's causal mask, scaling and GQA mapping: ``mu`` is per KV head, and
every query head reading that KV head sees its own constant ``q · mu``). That holds only if
*every* key a query reads is shifted alike: the compressed cache keeps its window and sink keys
exact (uncentred), so it adds ``mu`` back to the coded ones (``kvlens.cache.layer``: the score
shift ``q · mu`` on the packed keys), as ``quantize_centered`` does.
Logit soft-capping (``tanh``, Gemma 2) breaks the invariance: the shift is applied before the
cap. Gemma 3 and Llama-style models have no cap.

Pre-RoPE keys. RoPE rotates each key by its position's angle, so a constant vector ``mu_pre``
subtracted before RoPE becomes ``RoPE_t(mu_pre)`` after it: a *different* vector at every
position ``t``, and ``q · RoPE_t(mu_pre)`` varies over the keys a query reads, which softmax
does not forgive. Exactness holds only for a constant added to the post-RoPE keys of all
positions. Centering pre-RoPE keys is still lossless if the read path adds ``mu_pre`` back
before applying RoPE (``quantize_pre_rope`` dequantizes, then rotates: one add per key read),
which is how ``quantize_centered`` is used for the pre-RoPE stage. Which one shrinks the
range more is a property of the model's keys (the post-RoPE mean of a channel pair rotating
with position averages towards zero, the pre-RoPE mean does not): ``docs/lab-notes/codebooks.md``
measures both on real captures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlens.errors import InputError

CENTERING_BYTES_PER_VALUE = 2  # float16 mean key


def _check(x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise InputError(f"Expected a floating-point tensor, got {x.dtype}.")


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """Mean key per KV head, ``[H, D]`` float32: the mean of ``k`` ``[B, H, T, D]`` over samples
    and tokens (accumulated in float64), rounded to float16 as it is stored."""
    _check(k)
    return k.detach().double().mean(dim=(0, 2)).half().float()


def center(x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """``x - mu`` for ``x`` ``[B, H, T, D]`` and ``mu`` ``[H, D]`` (broadcast over samples and
    tokens), float32."""
    _check(x)
    if tuple(mu.shape) != (x.shape[1], x.shape[3]):
        raise InputError(
            f"Mean key of shape {tuple(mu.shape)} does not fit keys {tuple(x.shape)}; "
            f"expected ({x.shape[1]}, {x.shape[3]})."
        )
    return x.float() - mu.float().to(x.device)[None, :, None, :]


def quantize_centered(x: torch.Tensor, mu: torch.Tensor,
                      fake_quantize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fake_quantize(x - mu) + mu``: any key layout (a uniform ``QuantSpec``, a codebook, a
    rotated spec...) applied to the centred keys, ``[B, H, T, D]`` float32 in ``x``'s frame."""
    return fake_quantize(center(x, mu)) + mu.float().to(x.device)[None, :, None, :]


def centering_bytes(num_kv_heads: int, head_dim: int) -> int:
    """Bytes one layer stores for its mean keys (float16 ``[H, D]``)."""
    return CENTERING_BYTES_PER_VALUE * num_kv_heads * head_dim


def token_range(x: torch.Tensor) -> torch.Tensor:
    """Per-token range ``max_c x - min_c x`` ``[B, H, T]``: what a per-token min/max group of
    the whole vector is stretched over (the quantity centering is meant to shrink)."""
    _check(x)
    return x.float().amax(dim=-1) - x.float().amin(dim=-1)
