"""Attention computed with the model's own semantics (mask, GQA, scaling, softcap, sinks),
relative errors, and the streaming view of a cache (which entries a decoding query reads exact).

Tensors are ``[B, H, T, D]``: queries ``[B, Hq, Tq, D]``, keys and values ``[B, Hkv, Tk, D]``
with ``Hq = groups * Hkv``. Semantics follow transformers' eager attention:

- GQA: query head ``h`` reads KV head ``h // groups`` (``repeat_kv``).
- logits ``= q kᵀ * scaling``, then optional softcap ``tanh(logits / c) * c``, then the mask,
  then a float32 softmax.
- Learned attention sinks (gpt-oss, ``sinks``: one logit per query head, ``None`` or empty =
  none): the softmax runs over the logits and the head's sink logit appended as one more
  column, which is then dropped (it holds no value): the sink only adds ``exp(sink)`` to the
  denominator, so a row's weights sum to less than one.
- Causal mask, bottom-right aligned: query ``t`` sits at absolute position ``Tk - Tq + t`` and
  sees keys at positions ``<=`` its own; with ``sliding_window = w > 0`` only keys at positions
  ``> qpos - w`` (the last ``w`` keys including itself), as ``sliding_window_overlay``.

Relative error (``rel_error``) is ``||X - X_hat||_F / ||X||_F`` with ``0/0 = 0``. Per-head errors
pool every sample, token (and channel or key) of one head before taking the ratio:
``sqrt(sum sq err) / sqrt(sum sq ref)``, not a mean of per-sample ratios.
"""

from __future__ import annotations

import torch

from kvlens.errors import InputError

DEFAULT_CHUNK = 256  # query rows per step: bounds memory at Hq * chunk * Tk floats


def _ratio(err_sq: torch.Tensor, ref_sq: torch.Tensor) -> torch.Tensor:
    """sqrt(err/ref) elementwise in float64 with 0/0 -> 0 (x/0 -> inf for x > 0)."""
    out = (err_sq / ref_sq).sqrt()
    return torch.where((err_sq == 0), torch.zeros_like(out), out)


def rel_error(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """``||ref - approx||_F / ||ref||_F`` over the whole tensor (0 when both norms are 0)."""
    ref64, approx64 = ref.detach().double(), approx.detach().double()
    err = (ref64 - approx64).square().sum()
    return float(_ratio(err, ref64.square().sum()))


def per_head_rel_error(ref: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Relative error per head of ``[B, H, T, D]`` tensors -> float64 ``[H]``, pooling batch,
    tokens and channels of each head."""
    ref64, approx64 = ref.detach().double(), approx.detach().double()
    dims = [i for i in range(ref64.dim()) if i != 1]
    return _ratio((ref64 - approx64).square().sum(dims), ref64.square().sum(dims))


def num_kv_groups(num_q_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise InputError(
            f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads."
        )
    return num_q_heads // num_kv_heads


def expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hq, T, D]`` so that query head ``h`` gets KV head
    ``h // groups`` (transformers' ``repeat_kv``)."""
    groups = num_kv_groups(num_q_heads, x.shape[1])
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def causal_mask(num_queries: int, num_keys: int, sliding_window: int = 0,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``[Tq, Tk]``, True where a query may attend (module docstring for alignment)."""
    if num_queries > num_keys:
        raise InputError(
            f"{num_queries} queries but only {num_keys} keys; bottom-right "
            f"aligned causal attention needs Tq <= Tk."
        )
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float = 0.0
) -> torch.Tensor:
    """Pre-softmax logits ``[B, Hq, Tq, Tk]`` float32, unmasked: ``q kᵀ * scaling``, then
    ``tanh(x / softcap) * softcap`` when ``softcap > 0`` (attention sinks add a column to the
    softmax, not to these logits: ``attention_weights``)."""
    k = expand_kv(k, q.shape[1]).float()
    return _softcap((q.float() @ k.transpose(-1, -2)) * scaling, softcap)


def _softcap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def sink_logits(sinks, num_q_heads: int, device=None) -> torch.Tensor | None:
    """The attention-sink logits as float32 ``[Hq]`` (``None`` when ``sinks`` is ``None`` or
    empty): a tensor or a sequence of floats, one per query head (``LayerAttrs.sinks``)."""
    if sinks is None or len(sinks) == 0:
        return None
    out = torch.as_tensor(sinks, dtype=torch.float32).detach().reshape(-1).to(device)
    if out.numel() != num_q_heads:
        raise InputError(f"{out.numel()} attention-sink logits for {num_q_heads} query heads; "
                         "give one per query head (or none).")
    return out


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of ``scores`` with the ``sink`` logits (broadcastable to
    ``scores[..., :1]``) as one more column, dropped after (module docstring); plain softmax
    when ``sink`` is ``None``. Masked entries are ``-inf``."""
    if sink is None:
        return scores.softmax(dim=-1)
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)
    e = torch.exp(scores - top)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sink - top))


def _visible_keys(
    start: int, end: int, num_queries: int, num_keys: int, sliding_window: int
) -> tuple[int, int]:
    """Key range ``[lo, hi)`` seen by any of the queries ``start..end-1`` (bottom-right)."""
    offset = num_keys - num_queries
    lo = max(0, offset + start - sliding_window + 1) if sliding_window > 0 else 0
    return lo, offset + end


def attention_weights(
    q: torch.Tensor, k: torch.Tensor, scaling: float, sliding_window: int = 0, softcap: float = 0.0,
    sinks=None,
) -> torch.Tensor:
    """Post-softmax attention ``[B, Hq, Tq, Tk]`` float32 with the causal (sliding) mask and the
    optional attention-sink logits ``sinks`` ``[Hq]`` (rows then sum to less than one)."""
    mask = causal_mask(q.shape[2], k.shape[2], sliding_window, q.device)
    sink = sink_logits(sinks, q.shape[1], q.device)
    scores = attention_scores(q, k, scaling, softcap).masked_fill(~mask, float("-inf"))
    return sink_softmax(scores, None if sink is None else sink.view(-1, 1, 1))


def attention_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     sliding_window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """``softmax(mask(softcap(q kᵀ * scaling))) v`` -> ``[B, Hq, Tq, D]`` float32 (before the
    output projection), the softmax with the optional attention-sink logits ``sinks``
    ``[Hq]``."""
    weights = attention_weights(q, k, scaling, sliding_window, softcap, sinks)
    return weights @ expand_kv(v, q.shape[1]).float()


def streaming_exact_mask(
    num_tokens: int, residual_tokens: int, flush_tokens: int = 0, sink_tokens: int = 0
) -> torch.Tensor:
    """Bool ``[T, T]``: True where decoding query ``i`` reads key ``j`` exact from a
    ``kvlens.cache`` layer that was fed tokens one at a time: the full-precision window holds
    positions ``>= n_q(i)`` with ``n_q(i) = F * ceil((i - R + 1) / F)`` (0 when negative; ``F``
    = ``flush_tokens`` or ``R``: the whole window is flushed when it fills), and the first
    ``sink_tokens`` positions are kept at full precision. (A prefilled prompt is read exact by
    its own tokens, so this is the pessimistic, decode-time view.)"""
    i = torch.arange(num_tokens)
    n_q = streaming_quantized_length(num_tokens, residual_tokens, flush_tokens)
    j = torch.arange(num_tokens)[None, :]
    return ((j >= n_q[:, None]) | (j < sink_tokens)) & (j <= i[:, None])


def streaming_quantized_length(
    num_tokens: int, residual_tokens: int, flush_tokens: int = 0
) -> torch.Tensor:
    """Long ``[T]``: ``n_q(i)``, the tokens a ``kvlens.cache`` layer fed one token at a time
    holds quantized when query ``i`` reads it (``streaming_exact_mask``)."""
    r, f = residual_tokens, flush_tokens or residual_tokens
    i = torch.arange(num_tokens)
    if not r:  # every token is quantized right after its own step
        return i
    return (torch.div(i - r + 1 + f - 1, f, rounding_mode="floor") * f).clamp_min(0)
