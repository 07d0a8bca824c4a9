"""Attention over the compressed cache (torch path) and the backend dispatch.

``packed_attention(query, layer, mask, scaling)`` attends ``query`` ``[B, Hq, Tq, D]`` to every
token of a ``CompressedLayer`` without ever materialising the dequantized history: the packed
store is read in chunks of ``chunk_tokens`` tokens (dequantized through the reference, one chunk
at a time), then the MiKV high-precision set and the residual window are attended as further
segments; segments are merged with an online softmax (running max / sum, flash-decoding style).
GQA is handled by grouping the ``Hq = g * Hkv`` query heads per KV head (``repeat_kv`` mapping),
so packed K/V are read once per KV head. The mask is transformers' own (bool or additive
``[B, 1, Tq, N]`` over absolute cache positions, or ``None`` = causal, bottom-right aligned).

The channel balancer folds into the query (``q / b`` against the stored ``k * b``) for the packed
segment only; pre-RoPE keys are rotated after dequantization with the stored RoPE tables.

``select_backend(requested, device)`` is the one place that chooses between this path and the
Triton kernels (package ``kvlens_kernels``) and says why Triton was not used. Not done yet:
calling ``kvlens_kernels.packed_decode_attention`` from ``make_attention_fn``; until then Triton
is always reported unavailable, with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from kvlens.errors import BackendError, ConfigError, InputError

BACKENDS = ("auto", "torch", "triton")
CHUNK_TOKENS = 1024
TRITON_ENTRY = "packed_decode_attention"


def select_backend(requested: str, device) -> tuple[str, str]:
    """``(backend, reason)`` for ``requested`` in ``auto|torch|triton`` on ``device``.

    ``triton`` raises ``BackendError`` when it cannot run here; ``auto`` falls back to torch and
    the reason says why (no silent fallback: callers print it)."""
    if requested not in BACKENDS:
        raise InputError(f"Unknown backend {requested!r}; allowed: {', '.join(BACKENDS)}.")
    if requested == "torch":
        return "torch", "torch path requested"
    kind = torch.device(device).type
    reason = None
    if kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        reason = (f"Triton kernels need a CUDA device (this run is on {kind}; set "
                  "TRITON_INTERPRET=1 to run them slowly on CPU for testing)")
    else:
        try:
            import kvlens_kernels
        except ImportError as exc:
            reason = (f"the Triton kernels package kvlens_kernels is not importable ({exc}); "
                      "install it from kernels/ with `pip install -e kernels`")
        else:
            if not hasattr(kvlens_kernels, TRITON_ENTRY):
                reason = (f"kvlens_kernels has no {TRITON_ENTRY}() entry point yet (the fused "
                          "decode kernel over kvlens.cache.packed is not available)")
    if reason is None:
        # The fused kernel exists but generation does not call it yet (see the module doc).
        reason = (f"kvlens_kernels.{TRITON_ENTRY} is available but not yet wired into the "
                  "compressed cache's attention")
    if requested == "triton":
        raise BackendError(f"--backend triton is unavailable: {reason}.")
    return "torch", f"Triton not used: {reason}"


# -- masks --------------------------------------------------------------------------------------

def _bias(mask: torch.Tensor | None, pos: torch.Tensor, tq: int, n_total: int, b: int,
          hkv: int) -> torch.Tensor:
    """Additive float bias broadcastable to scores ``[B, Hkv, g, Tq, C]`` for key positions
    ``pos`` (``[C]`` shared, or ``[B, Hkv, C]`` per head)."""
    if mask is None:
        qpos = torch.arange(n_total - tq, n_total, device=pos.device)
        if pos.dim() == 1:
            allowed = pos[None, :] <= qpos[:, None]
            allowed = allowed[None, None, None]
        else:
            allowed = (pos[:, :, None, :] <= qpos[None, None, :, None]).unsqueeze(2)
        return torch.where(allowed, 0.0, float("-inf"))
    m = mask[:, 0]  # [B|1, Tq, N]
    if pos.dim() == 1:
        sel = m[..., pos][:, None, None]
    else:
        mb = m[:, None].expand(b, hkv, *m.shape[1:])
        sel = mb.gather(-1, pos[:, :, None, :].expand(b, hkv, m.shape[1], pos.shape[-1]))
        sel = sel.unsqueeze(2)
    if sel.dtype == torch.bool:
        return torch.where(sel, 0.0, float("-inf"))
    return sel.float()


# -- segments -------------------------------------------------------------------------------------

def _segments(layer, chunk_tokens: int) -> Iterator[tuple]:
    """``(k, v, positions, valid, balanced)`` pieces covering every token of ``layer``."""
    nq = layer.quantized_length
    device = layer.res_k.buf.device
    step = max(1, chunk_tokens // max(layer.flush_every, 1)) * max(layer.flush_every, 1)
    layout = None
    for t0 in range(0, nq, step):
        t1 = min(nq, t0 + step)
        k = layer.kstore.dequantize_range(t0, t1)
        v = layer.vstore.dequantize_range(t0, t1)
        if layer.setting.pre_rope_keys and layer.setting.key is not None:
            from kvlens.rope import apply_rope, detect_layout

            cos, sin = layer.rope_tables(t0, t1)
            layout = layout or detect_layout(cos)
            k = apply_rope(k, cos, sin, layout)
        valid = None if layer.is_hp is None else ~layer.is_hp[:, :, t0:t1]
        yield k, v, torch.arange(t0, t1, device=device), valid, True
    if layer.has_hp:
        yield layer.hp_k.float(), layer.hp_v.float(), layer.hp_pos, None, False
    if layer.n_res:
        yield (layer.res_k.view().float(), layer.res_v.view().float(),
               torch.arange(nq, nq + layer.n_res, device=device), None, False)


def _scores(qg, qb, seg, mask, scaling, n_total):
    k, _, pos, valid, balanced = seg
    b, hkv, _, tq, _ = qg.shape
    s = torch.einsum("bhgtd,bhcd->bhgtc", qb if balanced else qg, k) * scaling
    s = s + _bias(mask, pos, tq, n_total, b, hkv)
    if valid is not None:
        s = s.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    return s


def packed_attention(query: torch.Tensor, layer, mask: torch.Tensor | None, scaling: float,
                     chunk_tokens: int = CHUNK_TOKENS, with_probs: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention output ``[B, Tq, Hq, D]`` (transformers' attention-function layout) and, when
    ``with_probs``, the attention mass per cached position ``[B, Hkv, N]`` (summed over the
    query heads of each KV head and over the queries; used for H2O heavy hitters)."""
    b, hq, tq, d = query.shape
    hkv = layer.res_k.buf.shape[1]
    g = hq // hkv
    n_total = layer.cumulative_length
    qg = query.float().reshape(b, hkv, g, tq, d)
    qb = qg
    if layer.balancer is not None and layer.setting.key is not None:
        bal = layer.balancer.float()
        qb = qg / (bal[None, :, None, None, :] if bal.dim() == 2 else bal[:, :, None, None, :])
    m = torch.full((b, hkv, g, tq, 1), float("-inf"), device=query.device)
    s_sum = torch.zeros_like(m)
    acc = torch.zeros(b, hkv, g, tq, d, device=query.device)
    for seg in _segments(layer, chunk_tokens):
        s = _scores(qg, qb, seg, mask, scaling, n_total)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        p = torch.exp(s - m_safe)
        corr = torch.exp(m - m_safe)
        s_sum = s_sum * corr + p.sum(-1, keepdim=True)
        acc = acc * corr + torch.einsum("bhgtc,bhcd->bhgtd", p, seg[1])
        m = m_new
    out = acc / s_sum.clamp_min(torch.finfo(torch.float32).tiny)
    out = out.reshape(b, hq, tq, d).transpose(1, 2).to(query.dtype)
    if not with_probs:
        return out, None
    # Second pass: exact probabilities p = exp(s - lse), summed per key position.
    lse = torch.where(s_sum > 0, torch.where(torch.isinf(m), 0.0, m) + s_sum.log(),
                      torch.tensor(float("inf"), device=query.device))
    colsum = torch.zeros(b, hkv, n_total, device=query.device)
    for seg in _segments(layer, chunk_tokens):
        p = torch.exp(_scores(qg, qb, seg, mask, scaling, n_total) - lse).sum(dim=(2, 3))
        pos = seg[2]
        idx = pos.expand(b, hkv, pos.shape[-1]) if pos.dim() == 1 else pos
        colsum.scatter_add_(-1, idx, p)
    return out, colsum


def make_attention_fn(backend: str = "torch", chunk_tokens: int = CHUNK_TOKENS
                      ) -> Callable[[Callable], Callable]:
    """Factory for ``kvlens.hf.attention_override``: wraps the model's own attention."""
    if backend != "torch":
        raise BackendError(f"The {backend} decode path is not wired into generation yet; use "
                           "--backend torch or auto.")

    def factory(original: Callable) -> Callable:
        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
            from kvlens.cache.layer import LAYER_ATTR

            layer = getattr(key, LAYER_ATTR, None)
            if layer is None:  # no compressed cache in this forward: the model's own path
                return original(module, query, key, value, attention_mask, scaling=scaling,
                                dropout=dropout, **kwargs)
            if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
                raise ConfigError("Attention logit soft-capping / attention sinks are not "
                                  "supported by the kvlens compressed cache.")
            scaling = module.scaling if scaling is None else scaling
            probs = layer.needs_attention_probs
            if layer.quantized_length == 0 and not layer.has_hp and not probs:
                # Nothing compressed yet: exact attention with the model's own function.
                k = layer.res_k.view().contiguous()
                v = layer.res_v.view().contiguous()
                out, _ = original(module, query, k, v, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)
                colsum = None
            else:
                out, colsum = packed_attention(query, layer, attention_mask, scaling,
                                               chunk_tokens, with_probs=probs)
            layer.commit(query, colsum)
            return out, None

        return attention

    return factory
