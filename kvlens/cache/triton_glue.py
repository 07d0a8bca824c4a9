"""Glue between the compressed cache and the Triton decode kernel (``kvlens_kernels``, tensors
and ints only): ``kernel_layout_problem``, the one rule for which layouts it reads;
``triton_unsupported``, the per-call reasons; ``triton_decode``, a layer and transformers' mask
as the kernel's arguments (codebook keys in the layer's rotated basis, as the query is).
"""

from __future__ import annotations

import torch

from kvlens.layouts import layout_of
from kvlens.layouts.codebook import CodebookStore
from kvlens.quant import CodebookSpec, QuantSpec, pack_unit


def triton_unsupported(layer, query: torch.Tensor, with_probs: bool, *, softcap: float = 0.0,
                       sinks: torch.Tensor | None = None) -> str | None:
    """Why ``kvlens_kernels.decode_attention`` cannot serve this call (``None``: it can).
    ``softcap`` / ``sinks``: the call's logit soft-capping and learned attention-sink logits
    (``kvlens.cache.attention``), which the kernel does not read."""
    if query.shape[2] != 1:
        return "prefill / multi-token query (the kernel takes one query token)"
    if softcap:
        return "logit soft-capping (the kernel does not apply tanh capping to its scores)"
    if sinks is not None:
        return "attention sinks (the kernel's softmax has no learned sink term)"
    if with_probs:  # the layer's set policy reads them (kvlens.cache.sets)
        policy = getattr(layer, "set_policy", None)
        return getattr(policy, "kernel_problem", None) or (
            "the layer's set needs attention probabilities, which the kernel does not return")
    return kernel_layout_problem(layer.setting, layer.head_dim)


def kernel_layout_problem(setting, head_dim: int) -> str | None:
    """Why the fused decode kernel cannot read a layer stored as ``setting`` (a
    ``kvlens.config.LayerKV``), or ``None``."""
    if setting.key is None or setting.value is None:
        return "keys or values not quantized (the kernel reads both from the packed store)"
    if setting.pre_rope_keys:
        return ("pre-RoPE keys (the kernel does not re-apply RoPE; the torch path rotates each "
                "dequantized chunk)")
    for what, spec in (("key", setting.key), ("value", setting.value)):
        if isinstance(spec, CodebookSpec):  # any bits, head_dim and block: codes per vector
            continue
        if not isinstance(spec, QuantSpec):
            return (f"{what} layout {layout_of(spec).kind} (the kernel reads packed integer "
                    "codes and codebook keys)")
        block = layout_of(spec).flush_block(setting.residual_tokens, setting.flush_tokens)
        why = _spec_kernel_problem(what, spec, block, head_dim)
        if why:
            return why
    return None


def _kernel_group(spec, block: int):
    """The kernel's ``k_group`` / ``v_group`` for a packed store of ``spec`` with flush block
    ``block``: tokens per scale row (per-channel ``G``, per-tensor ``F``) or channels per group
    (per-token)."""
    if spec.granularity == "per-token":
        return spec.group_size
    return block if spec.granularity == "per-tensor" else spec.group_size or block


def _spec_kernel_problem(what: str, spec, block: int, d: int) -> str | None:

    g = _kernel_group(spec, block)
    per, _ = pack_unit(spec.bits)
    if spec.granularity == "per-token":
        g = g or d
        if d % g or g < 16 or g % per:
            return (f"{what} group {g} per-token (the kernel needs a divisor of head_dim {d}, "
                    ">= 16)")
        return None
    if g % 16 or g % per:
        unit = "flush block" if spec.granularity == "per-tensor" else "group"
        return f"{what} {unit} {g} {spec.granularity} (the kernel needs a multiple of 16 tokens)"
    return None


def _key_mask(mask: torch.Tensor | None, b: int, n: int) -> tuple[torch.Tensor | None, str | None]:
    """transformers' decode mask -> the kernel's ``key_mask [B, N]`` bool (True = attend), or a
    reason it cannot be expressed that way. ``None`` stays ``None``: a single decode query is
    the newest token, so the causal mask hides nothing."""
    if mask is None:
        return None, None
    m = mask[:, 0, -1, :n]  # the only query row
    if m.dtype != torch.bool:
        blocked = m <= torch.finfo(m.dtype).min / 2  # -inf or transformers' min-float fill
        if not bool(((m == 0) | blocked).all()):
            return None, "additive mask with finite non-zero biases"
        m = ~blocked
    return m.expand(b, n), None


def triton_decode(query: torch.Tensor, layer, mask: torch.Tensor | None, scaling: float
                  ) -> tuple[torch.Tensor | None, str | None]:
    """``kvlens_kernels.decode_attention`` over ``layer`` -> (output ``[B, 1, Hq, D]`` or
    ``None``, why not), with the layer's set (an extra segment, its packed copies hidden) and its
    balancer."""
    from kvlens_kernels import decode_attention

    b = query.shape[0]
    n = layer.cumulative_length
    a0 = layer.q_start  # the kernel's position 0 (a sliding layer may have evicted blocks)
    key_mask, why = _key_mask(mask, b, n)
    if why:
        return None, why
    if key_mask is not None:
        key_mask = key_mask[:, a0:]
    ks, vs = layer.kstore, layer.vstore
    length = layer.quantized_length
    extra, pvalid = [], None
    if layer.has_hp:
        # a coded set (rows with bits) is dequantized to a transient fp16 copy: the kernel
        # reads full-precision extra segments only
        hk, hv = layer.hp_k, layer.hp_v
        if hk.bits is not None:
            hk, hv = hk.read().to(query.dtype), hv.read().to(query.dtype)
        else:
            hk, hv = _wide(hk.parts[0], query.dtype), _wide(hv.parts[0], query.dtype)
        extra = [(hk, hv, layer.hp_pos - a0)]
        if layer.set_mask is not None:
            pvalid = ~layer.set_mask[:, :, a0:a0 + length]
        else:  # a set that is the packed prefix (the sinks): the prefix is hidden
            hidden = layer.sink_end - a0
            pvalid = (torch.arange(length, device=query.device) >= hidden).expand(
                b, layer.hp_pos.shape[1], length)
    (kc, kscale, kzero), kw_k = _store_arguments("k", ks, query.device)
    (vc, vscale, vzero), kw_v = _store_arguments("v", vs, query.device)
    out = decode_attention(
        query, kc, kscale, kzero, vc, vscale, vzero, length, **kw_k, **kw_v,
        scaling=float(scaling),
        residual_k=_wide(layer.res_k.buf, query.dtype) if layer.n_res else None,
        residual_v=_wide(layer.res_v.buf, query.dtype) if layer.n_res else None,
        residual_len=layer.n_res,
        extra=extra, packed_valid=pvalid, balancer=layer.balancer, key_mask=key_mask)
    return out.transpose(1, 2), None


def _store_arguments(which: str, store, device) -> tuple[tuple, dict]:
    """``((codes, scale, zero), keywords)`` of the kernel for one store (``which``: ``k`` or ``v``).
    A ``CodebookStore`` (keys, in the layer's rotated basis like the query) passes its packed
    codes, its norms as the scale, no zero, and its centroid table on ``device``."""
    if isinstance(store, CodebookStore):
        table = store.codebook.centroids.to(device)
        return (store.packed, store.norms, None), {
            f"{which}_bits": store.spec.bits, f"{which}_group": None,
            f"{which}_layout": "codebook", f"{which}_centroids": table,
            f"{which}_renormalize": store.spec.renormalize}
    return (store.codes, store.scale, store.zero), {
        f"{which}_bits": store.spec.bits, f"{which}_group": _kernel_group(store.spec, store.block),
        f"{which}_layout": store.spec.granularity, f"{which}_zero_unit": store.zero_unit}


def _wide(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float8 full-precision part (``fp_dtype: float8_e4m3fn``) as a transient ``dtype`` copy
    for the kernel, which reads 16/32-bit windows and sets; other dtypes as they are."""
    return t.to(dtype) if t.element_size() == 1 else t
