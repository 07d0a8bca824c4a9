"""The torch read path: attention over a ``CompressedLayer`` read chunk by chunk from its store,
with scales folded instead of dequantizing (the reference backend; runs on any device).

``packed_attention`` attends ``query`` ``[B, Hq, Tq, D]`` to every token of the layer: the store
in chunks of ``chunk_tokens`` tokens, then the set (``kvlens.cache.sets``) and the residual
window, merged with an online softmax (running max / sum, flash-decoding style). The ``Hq = g *
Hkv`` query heads are grouped per KV head (``repeat_kv``), so K/V are read once per KV head. The
mask is transformers' own (bool or additive ``[B, 1, Tq, N]`` over absolute positions, or
``None`` = causal, bottom-right aligned).

Folded reads: eager torch has no integer x float matmul, so one chunk's codes are unpacked to
float32 into a reusable workspace (``_scratch``), the only chunk-sized float tensor; scales and
zeros fold into the query (keys), the softmax weights or the output (values; each formula
beside its code). Another layout gives its store's ``key_scores`` (codebook keys) or
``dequantize_range`` of the chunk. The balancer (``q / b``) and ``scaling`` fold into ``q``
first; pre-RoPE keys are dequantized in place, rotated with (cos, sin) from the stored positions
and dotted.

Same math as "dequantize with the reference, then attend", different float rounding (tested to
1e-5 for every layout, ``tests/test_cache.py``). Soft-capping and learned attention sinks as
transformers' eager attention of Gemma 2 and gpt-oss: scores become ``c * tanh(s / c)`` before
the mask; ``sinks`` (one logit per query head) is a softmax column with no value, which the
online softmax starts from (``tests/test_sinks_softcap.py``). The store holds absolute positions
``[q_start, q_end)``, the window ``[res_start, N)``; masks are indexed by absolute position.
"""

from __future__ import annotations

import torch

from kvlens.layouts.packed import PackedTensor
from kvlens.quant import pack_unit
from kvlens.rope import rotate

CHUNK_TOKENS = 4096


# -- masks --------------------------------------------------------------------------------------

def _range_bias(s: torch.Tensor, mask: torch.Tensor | None, t0: int, t1: int, tq: int,
                n_total: int) -> torch.Tensor:
    """Scores ``s`` ``[B, Hkv, g, Tq, t1-t0]`` of the contiguous key positions ``[t0, t1)`` with
    the mask's additive bias (``s`` itself when every position is visible to every query)."""
    device = s.device
    if mask is None:
        if t1 - 1 <= n_total - tq:  # causal: all before the first query
            return s
        pos = torch.arange(t0, t1, device=device)
        qpos = torch.arange(n_total - tq, n_total, device=device)
        allowed = pos[None, :] <= qpos[:, None]
        return s + torch.where(allowed, 0.0, float("-inf"))[None, None, None]
    m = mask[:, 0, :, t0:t1]  # [B|1, Tq, n]
    if m.dtype == torch.bool:
        m = torch.where(m, 0.0, float("-inf"))
    return s + m.float()[:, None, None]


def _bias(mask: torch.Tensor | None, pos: torch.Tensor, tq: int, n_total: int, b: int,
          hkv: int) -> torch.Tensor:
    """Additive float bias broadcastable to scores ``[B, Hkv, g, Tq, C]`` for key positions
    ``pos`` ``[B, Hkv, C]`` (per head: the layer's set)."""
    if mask is None:
        qpos = torch.arange(n_total - tq, n_total, device=pos.device)
        allowed = (pos[:, :, None, :] <= qpos[None, None, :, None]).unsqueeze(2)
        return torch.where(allowed, 0.0, float("-inf"))
    m = mask[:, 0]  # [B|1, Tq, N]
    mb = m[:, None].expand(b, hkv, *m.shape[1:])
    sel = mb.gather(-1, pos[:, :, None, :].expand(b, hkv, m.shape[1], pos.shape[-1]))
    sel = sel.unsqueeze(2)
    if sel.dtype == torch.bool:
        return torch.where(sel, 0.0, float("-inf"))
    return sel.float()


# -- unpacking (fast path) ------------------------------------------------------------------------

_SHIFTS: dict = {}


def _shifts(bits: int, device) -> torch.Tensor:
    """``[P, 1]`` uint8 shifts of the ``P = 8 / bits`` code slots of a byte (1, 2, 4 bits; cached
    per device)."""
    key = (bits, str(device))
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(0, 8, bits, dtype=torch.uint8, device=device).unsqueeze(-1)
    return _SHIFTS[key]


_WORKSPACE: dict = {}


def _scratch(slot: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A reusable CPU buffer of ``shape`` for one chunk's unpacked codes (one per slot, grown to
    the largest chunk: a fresh one would be allocated and faulted in at every step; other devices
    get ``torch.empty``). Not thread-safe: the caller consumes it before the next unpack."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    n = 1
    for s in shape:
        n *= s
    key = (slot, dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < n:
        buf = _WORKSPACE[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def unpack_rows(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``[..., R, C]`` (each ``W`` byte rows one packing unit of ``U`` codes of consecutive
    rows, ``kvlens.quant.packing``) -> float32 ``[..., R / W * U, C]`` in the chunk workspace
    (valid until the next unpack): one broadcast shift, or for units of several bytes one or two
    uint8 shifts per slot over the whole chunk."""
    u, w = pack_unit(bits)
    lead, r, c = raw.shape[:-2], raw.shape[-2], raw.shape[-1]
    out = _scratch("f32", (*lead, r // w * u, c), torch.float32, raw.device)
    if u == 1:
        return out.copy_(raw)
    codes = _scratch("u8", (*lead, r // w, u, c), torch.uint8, raw.device)
    if w == 1:
        torch.bitwise_right_shift(raw.unsqueeze(-2), _shifts(bits, raw.device), out=codes)
    else:  # slot j starts at bit j*b of its unit: byte k = j*b // 8, shift s = j*b % 8, and
        # takes the next byte's low bits when it straddles (uint8 shifts drop what overflows)
        units = raw.view(*lead, r // w, w, c)
        for j in range(u):
            k, sh = divmod(j * bits, 8)
            dst = codes[..., j, :]
            torch.bitwise_right_shift(units[..., k, :], sh, out=dst)
            if sh + bits > 8:
                dst.bitwise_or_(units[..., k + 1, :] << (8 - sh))
    codes.bitwise_and_((1 << bits) - 1)
    return out.copy_(codes.view(*lead, r // w * u, c))


def unpack_cols(raw: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """uint8 ``[..., T, packed_length(D)]`` packed along channels -> float32 ``[..., D, T]``
    (channels first: the bytes are transposed, which is cheap, then unpacked with one broadcast
    shift over the long token dimension)."""
    return unpack_rows(raw.transpose(-1, -2).contiguous(), bits)[..., :d, :]


def _token_scales(store, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` of tokens ``[t0, t1)`` of a channel-packed store, each float32 ``[B, H,
    nJ, t1 - t0]`` (a per-tensor block's value repeated over its tokens), contiguous: a broadcast
    multiply with the transposed view is many times slower."""
    bt = store.block if store.spec.granularity == "per-tensor" else 1

    def rows(p: torch.Tensor) -> torch.Tensor:
        p = p.float().transpose(-1, -2)
        return (p.repeat_interleave(bt, dim=-1) if bt > 1 else p)[..., :t1 - t0].contiguous()

    return tuple(rows(p) for p in store.params(slice(t0 // bt, -(-t1 // bt))))


def _key_group(store) -> int:
    """Tokens sharing one key scale row of a token-packed (per-channel) store."""
    return store.spec.group_size or store.block


def _chunk(store, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scale, zero)`` float32 of packed tokens ``[t0, t1)``: a token-packed
    (per-channel) store's codes ``[B, H, n, D]`` with one row per ``G`` tokens ``[B, H, n/G,
    D]``, a channel-packed store's codes channels first ``[B, H, D, n]`` with
    ``_token_scales``. The codes are the chunk workspace (valid until the next unpack)."""
    raw = store.code_bytes(t0, t1)
    if store.packs_tokens:
        g = _key_group(store)
        scale, zero = (p.float() for p in store.params(slice(t0 // g, t1 // g)))
        return unpack_rows(raw, store.spec.bits), scale, zero
    return (unpack_cols(raw, store.spec.bits, store.head_dim), *_token_scales(store, t0, t1))


def _dequant_chunk(store, t0: int, t1: int) -> torch.Tensor:
    """Tokens ``[t0, t1)`` of a packed store as float32 ``[B, H, n, D]``: ``code * scale + zero``
    computed in place on the unpacked chunk (the same values as the reference's
    ``dequantize_range``). Used only where the scales cannot be folded (pre-RoPE keys)."""
    d = store.head_dim
    b, h = store.codes.shape[:2]
    n = t1 - t0
    x, scale, zero = _chunk(store, t0, t1)
    if store.packs_tokens:
        g = _key_group(store)
        x = x.view(b, h, n // g, g, d)
        x.mul_(scale[:, :, :, None]).add_(zero[:, :, :, None])
        return x.view(b, h, n, d)
    nj = scale.shape[-2]
    x5 = x.reshape(b, h, nj, d // nj, n)
    x5.mul_(scale.unsqueeze(3)).add_(zero.unsqueeze(3))
    return x5.view(b, h, d, n).transpose(-1, -2)


def _key_scores(layer, q: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """``q [B, Hkv, M, D]`` (balanced and scaled) against packed keys ``[t0, t1)`` ->
    ``[B, Hkv, M, t1 - t0]``. Scales fold into ``q`` (module docstring)."""
    store = layer.kstore
    packed = isinstance(store, PackedTensor)
    if not packed and not layer.stores_pre_rope and hasattr(store, "key_scores"):
        return store.key_scores(q, t0, t1)  # a layout with its own score path (codebook keys)
    if not packed or layer.stores_pre_rope:  # any other store: its read-back; pre-RoPE keys:
        # RoPE rotates the dequantized key: dequantize, rotate, dot
        k = _dequant_chunk(store, t0, t1) if packed else store.dequantize_range(t0, t1)
        if layer.stores_pre_rope:
            cos, sin = layer.rope_tables(layer.q_start + t0, layer.q_start + t1)
            r = cos.shape[-1]
            rot = k[..., :r]
            rot_k = rot * cos[:, None] + rotate(rot, layer.rope.layout) * sin[:, None]
            k = rot_k if r == k.shape[-1] else torch.cat((rot_k, k[..., r:]), dim=-1)
        return torch.matmul(q, k.transpose(-1, -2))
    b, h, m, d = q.shape
    n = t1 - t0
    codes, scale, zero = _chunk(store, t0, t1)
    if store.packs_tokens:  # per-channel: one scale row per G tokens
        g = _key_group(store)
        qs = q[:, :, None] * scale[:, :, :, None]  # [B, H, nG, M, D]
        s = torch.matmul(qs, codes.view(b, h, n // g, g, d).transpose(-1, -2))  # [B,H,nG,M,G]
        s += torch.matmul(zero, q.transpose(-1, -2)).unsqueeze(-1)  # bias [B, H, nG, M, 1]
        return s.permute(0, 1, 3, 2, 4).reshape(b, h, m, n)
    # per-token (groups of G channels) / per-tensor: codes [B, H, D, n], scales [B, H, nJ, n]:
    # score_t = sum_j s_tj (q_j . code_tj) + z_tj * sum(q_j)
    nj = scale.shape[-2]
    gd = d // nj
    qsum = q.reshape(b, h, m, nj, gd).sum(-1)  # [B, H, M, nJ]
    bias = torch.matmul(qsum, zero)  # [B, H, M, n]
    if nj == 1:
        return torch.matmul(q, codes).mul_(scale).add_(bias)
    qj = q.reshape(b, h, m, nj, gd).transpose(2, 3)  # [B, H, nJ, M, Gd]
    part = torch.matmul(qj, codes.reshape(b, h, nj, gd, n))  # [B, H, nJ, M, n]
    part.mul_(scale.unsqueeze(3))
    return part.sum(2).add_(bias)


def _value_out(layer, p: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Weights ``p [B, Hkv, M, t1 - t0]`` times packed values ``[t0, t1)`` -> ``[B, Hkv, M, D]``.
    Scales fold into the weights or the output (module docstring)."""
    store = layer.vstore
    if not isinstance(store, PackedTensor):  # dense history or another layout: its read-back
        return torch.matmul(p, store.dequantize_range(t0, t1))
    b, h, m, n = p.shape
    d = store.head_dim
    codes, scale, zero = _chunk(store, t0, t1)
    if store.packs_tokens:  # per-channel: o_d = sum_g s_gd (p_g . code_gd) + z_gd * sum(p_g)
        g = _key_group(store)
        pg = p.view(b, h, m, n // g, g).transpose(2, 3)  # [B, H, nG, M, G]
        part = torch.matmul(pg, codes.view(b, h, n // g, g, d))  # [B, H, nG, M, D]
        part.mul_(scale.unsqueeze(3))
        out = part.sum(2)
        return out.add_(torch.matmul(pg.sum(-1).transpose(-1, -2), zero))
    # per-token / per-tensor: out_d = sum_t (p_t * s_tj) code_td + sum_t p_t z_tj (d in group j)
    nj = scale.shape[-2]
    w = p[:, :, None] * scale[:, :, :, None]  # [B, H, nJ, M, n]
    out = torch.matmul(w, codes.reshape(b, h, nj, d // nj, n).transpose(-1, -2))  # [B,H,nJ,M,G]
    out += torch.matmul(p, zero.transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
    return out.permute(0, 1, 3, 2, 4).reshape(b, h, m, d)


# -- segments -------------------------------------------------------------------------------------

def _capped(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's logit soft-capping ``c * tanh(s / c)`` of scaled scores (before the mask);
    ``softcap`` 0 = none."""
    return torch.tanh(s / softcap) * softcap if softcap else s


def _segments(layer, q: torch.Tensor, qb: torch.Tensor, mask, tq: int, chunk_tokens: int,
              softcap: float = 0.0):
    """``(scores [B, Hkv, g, Tq, C], values_fn, positions)`` for every piece of ``layer``:
    ``values_fn(p [B, Hkv, M, C]) -> [B, Hkv, M, D]``; positions are ``(t0, t1)`` or per-head
    ``[B, Hkv, C]``. Scores are soft-capped (``softcap`` > 0) before the mask bias."""
    b, hkv, m, d = q.shape
    g = m // tq
    n_total = layer.cumulative_length
    nq, a0 = layer.quantized_length, layer.q_start  # packed: local [0, nq) = absolute a0 + t
    sinks = layer.sink_end - a0  # a prefix set (the sinks) hides the packed [0, sinks)
    f = max(layer.flush_every, 1)
    step = max(1, chunk_tokens // f) * f
    for t0 in range(0, nq, step):
        t1 = min(nq, t0 + step)
        s = _key_scores(layer, qb, t0, t1)
        s = _range_bias(_capped(s.view(b, hkv, g, tq, t1 - t0), softcap), mask, a0 + t0,
                        a0 + t1, tq, n_total)
        if layer.set_mask is not None:
            s = s.masked_fill(layer.set_mask[:, :, None, None, a0 + t0:a0 + t1], float("-inf"))
        if sinks > t0:
            s[..., :sinks - t0] = float("-inf")
        yield s, (lambda p, t0=t0, t1=t1: _value_out(layer, p, t0, t1)), (a0 + t0, a0 + t1)
    if layer.has_hp:
        k, v = layer.hp_k.read(), layer.hp_v.read()
        s = _capped(torch.matmul(q, k.transpose(-1, -2)).view(b, hkv, g, tq, -1), softcap)
        s = s + _bias(mask, layer.hp_pos.long(), tq, n_total, b, hkv)
        yield s, (lambda p, v=v: torch.matmul(p, v)), layer.hp_pos.long()
    if layer.n_res:
        k, v = layer.res_k.view().float(), layer.res_v.view().float()
        r0 = layer.res_start
        s = _capped(torch.matmul(q, k.transpose(-1, -2)).view(b, hkv, g, tq, -1), softcap)
        s = _range_bias(s, mask, r0, r0 + layer.n_res, tq, n_total)
        yield s, (lambda p, v=v: torch.matmul(p, v)), (r0, r0 + layer.n_res)


def _queries(query: torch.Tensor, layer, scaling: float):
    """``(q, qb)`` as ``[B, Hkv, g*Tq, D]`` float32 with ``scaling`` folded in; ``qb`` also
    divided by the channel balancer (used against the packed keys only)."""
    b, hq, tq, d = query.shape
    hkv = layer.res_k.buf.shape[1]
    q = query.float().reshape(b, hkv, (hq // hkv) * tq, d).mul(scaling).contiguous()
    qb = q
    if layer.balancer is not None and layer.setting.key is not None:
        bal = layer.balancer.float()
        qb = q / (bal[None, :, None, :] if bal.dim() == 2 else bal[:, :, None, :])
    return q, qb


def packed_attention(query: torch.Tensor, layer, mask: torch.Tensor | None, scaling: float,
                     chunk_tokens: int = CHUNK_TOKENS, with_probs: bool = False, *,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention output ``[B, Tq, Hq, D]`` (transformers' attention-function layout) and, with
    ``with_probs``, the attention mass per cached position ``[B, Hkv, N]`` (over each KV head's
    query heads and the queries). ``softcap``: 0 = none; ``sinks``: each query head's learned
    sink logit ``[Hq]`` (not the sink tokens a set keeps) or ``None``."""
    b, hq, tq, d = query.shape
    q, qb = _queries(query, layer, scaling)
    hkv, m_rows = q.shape[1], q.shape[2]
    g = m_rows // tq
    n_total = layer.cumulative_length
    m = s_sum = acc = None
    if sinks is not None:  # the sink column first: max = sink, sum = exp(0), no value
        m = sinks.detach().float().to(q.device).view(1, hkv, g, 1, 1).expand(b, hkv, g, tq, 1)
        s_sum = torch.ones(b, hkv, g, tq, 1, device=q.device)
        acc = torch.zeros(b, hkv, g, tq, d, device=q.device)
    for s, values, _ in _segments(layer, q, qb, mask, tq, chunk_tokens, softcap):
        seg_max = s.amax(-1, keepdim=True)
        m_new = seg_max if m is None else torch.maximum(m, seg_max)
        m_safe = m_new.nan_to_num(neginf=0.0)  # a fully masked row: exp(-inf - 0) = 0
        p = torch.exp(s - m_safe)
        pv = values(p.view(b, hkv, m_rows, -1)).view(b, hkv, g, tq, d)
        if m is None:
            s_sum, acc = p.sum(-1, keepdim=True), pv
        else:
            corr = torch.exp(m - m_safe)
            s_sum = s_sum * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + pv
        m = m_new
    if m is None:  # nothing cached at all
        out = torch.zeros(b, hkv, g, tq, d, device=query.device)
    else:
        out = acc / s_sum.clamp_min(torch.finfo(torch.float32).tiny)
    out = out.reshape(b, hq, tq, d).transpose(1, 2).to(query.dtype)
    if not with_probs:
        return out, None
    # Second pass: exact probabilities p = exp(s - lse), summed per key position.
    lse = torch.where(s_sum > 0, m.nan_to_num(neginf=0.0) + s_sum.log(),
                      torch.tensor(float("inf"), device=query.device))
    colsum = torch.zeros(b, hkv, n_total, device=query.device)
    for s, _, pos in _segments(layer, q, qb, mask, tq, chunk_tokens, softcap):
        p = torch.exp(s - lse).sum(dim=(2, 3))
        if isinstance(pos, tuple):
            colsum[:, :, pos[0]:pos[1]] += p
        else:
            colsum.scatter_add_(-1, pos, p)
    return out, colsum
