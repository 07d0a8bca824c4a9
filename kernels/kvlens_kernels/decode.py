"""Fused split-K decode attention over the packed KV cache (one layer, one query token).

One file on purpose (over 600 lines): as in the Triton tutorials, a kernel file reads from top to
bottom as what it computes, the jitted kernels (packed split, dense split, merge) with a comment
per argument, and the launcher that checks inputs and picks the split.

Torch reference: dequantize the packed store with ``kvlens.quant`` (``kvlens.layouts.packed.
PackedTensor.dequantize_range``; codebook stores ``kvlens.quant.codebook.dequantize_codebook``,
``tests/test_kernels_codebook.py``), concatenate the residual window and the extra fp16 sets, then
``softmax(q kᵀ * scaling + mask) v`` (``kvlens.analysis.metrics.attention_output`` / ``kvlens.cache.
attention.packed_attention``). Tested in ``tests/test_kernels_decode.py`` and
``tests/test_kernels_codebook.py``.

Inputs (layout of ``kvlens.layouts.packed``; codes packed densely in units of ``U`` codes in
``W`` bytes, ``kvlens.quant.pack_unit``, little-endian; ``Pk``/``Pv = U / W`` codes per byte):

- ``q`` ``[B, Hq, 1, D]``; ``Hq = g * Hkv`` (GQA, ``repeat_kv`` order: query head ``h*g + i``
  reads KV head ``h``).
- keys, per-channel groups of ``Gk`` tokens packed along tokens: ``k_codes [B, Hkv, capK/Pk,
  D]`` uint8, ``k_scale``/``k_zero`` ``[B, Hkv, capK/Gk, D]`` (row ``t // Gk``).
- values, per-token groups of ``Gv`` channels packed along channels: ``v_codes [B, Hkv, capV,
  ceil(D/Pv)]`` uint8, ``v_scale``/``v_zero`` ``[B, Hkv, capV, D/Gv]`` (row ``t``).
- keys may instead be codebook-coded (``k_layout="codebook"``, ``kvlens.layouts.codebook``, vLLM
  TurboQuant's keys): per token and head the codes of the vector packed along channels ``[B,
  Hkv, cap, ceil(D/U)*W]``, its norm ``n_t`` in ``k_scale [B, Hkv, cap]`` (no zero), and the
  codebook's ``2^bits`` centroids ``c`` (``k_centroids``). The key is ``s_t * c[code_t]`` with
  ``s_t = n_t / ||c[code_t]||`` (renormalised) or ``n_t / sqrt(D)``, in the basis it was coded
  in (a rotated codebook: the caller passes ``q R``).
- tokens ``[0, length)`` of the packed store sit at absolute positions ``0..length-1``; the
  residual window ``[B, Hkv, >=n_res, D]`` at ``length..length+n_res-1``; each extra set
  ``(k, v, pos)`` (``[B, Hkv, N, D]`` x2, ``pos [B, Hkv, N]`` absolute positions, ``pos < 0`` =
  unused slot) is one more segment (MiKV's high-precision tokens; their low-bit copies are hidden
  with ``packed_valid``).

Kernels and grid (``Bq = B * Hkv`` programs per split, each owning *all* ``g`` query heads of
its KV head so packed bytes are read once):

1. ``_packed_split_kernel``, grid ``(B*Hkv, ceil(length / split))``: loops over blocks of
   ``BT | Gk`` tokens. Key scales are folded into the query once per block (``q_s[d] = q[d] *
   k_scale[d]``, ``bias = sum_d q[d] * k_zero[d]``) so a score is ``dot(q_s, codes) + bias``: one
   convert + FMA per code (fp16 tensor-core dot, fp32 accumulate). Value scales are folded into
   the softmax weights: ``out[j-th channel group] += dot(p * v_scale[:, j], codes[:, group j]) +
   sum_t p * v_zero[:, j]`` as a batched dot over the ``D/Gv`` channel groups. The channel
   balancer is folded into ``q`` (``q / balancer``) and ``scaling * log2(e)`` too (``exp2``).
   Codebook keys (``K_CB``): the block's codes index the centroid table (a gather from at most
   256 floats, L1-resident), ``score_t = s_t * dot(q, c[code_t])`` (fp16 dot, fp32 accumulate;
   ``s_t`` from the norm and, renormalised, the gathered centroids' norm).
   Online softmax per split; writes the unnormalised output, running max and sum.
2. ``_dense_split_kernel``, same idea for a full-precision segment (residual window, each extra
   set): its splits are further rows of the same partial buffers.
3. ``_merge_kernel``, grid ``(B*Hq,)``: log-sum-exp merge of all splits -> ``[B, Hq, 1, D]``.

Memory traffic per KV head and step: packed codes ``length * D * (ck + cv) / 8`` bytes, key
scales+zeros ``2 * length/Gk * D * s`` and value scales+zeros ``2 * length * D/Gv * s`` (``s``
= scale bytes: 2 or 4, or 1 for 8-bit metadata, decoded in registers with one exp2 per
group; codebook keys: their codes, ``length * s`` bytes of norms and the ``2^bits`` table),
the residual/extra segments in full precision, plus ``splits * g * (D + 2) * 4``
bytes of partials written and read back once. Nothing dequantized is ever written to memory.
Bytes of one packed byte that several tokens (keys) or channels (values) share are fetched by
several lanes of the same program; they hit L1, HBM reads each byte once.

Masks: decode is causal by construction (the query is the newest token, every cached token is
at or before it). Padding and other masks come as ``key_mask [B, N]`` bool over absolute
positions (True = attend) and/or ``valid_start [B]`` (first attended position per sequence,
left padding). A query with no visible token returns zeros (as the torch path does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlens_kernels._common import (
    META8_SCALE_BIAS,
    META8_SCALE_STEPS,
    KernelInputError,
    check_int,
    check_shape,
    check_tensor,
    next_pow2,
    pack_unit,
)

LOG2E = 1.4426950408889634
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.float16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)
#: Tests set this to allocate the split partials NaN-filled, so a split that is never written
#: poisons the output instead of reading stale memory (off by default: it costs a memset).
POISON_PARTIALS = False


@triton.jit
def _group_meta(s_raw, z_raw, unit, M8: tl.constexpr, MB: tl.constexpr, MS: tl.constexpr):
    """A group's float32 ``(scale, zero)`` from what the store holds: float16/float32 as they
    are, or 8-bit codes (``M8``; reference ``kvlens.quant.meta8.decode_group_meta``): ``s =
    2^((e - MB) / MS)`` from the uint8 ``e``, ``z = n * unit * s`` from the int8 ``n``."""
    if M8:
        sc = tl.exp2((s_raw.to(tl.float32) - MB) / MS)
        return sc, z_raw.to(tl.float32) * unit * sc
    else:
        return s_raw.to(tl.float32), z_raw.to(tl.float32)


@triton.jit
def _unpack_at(base, i, stride, m, BITS: tl.constexpr, U: tl.constexpr, W: tl.constexpr):
    """int32 codes at indices ``i`` along the packed dimension of rows starting at ``base``
    (broadcast against ``i``), ``stride`` elements per byte along it (``kvlens.quant.packing``:
    code ``i`` sits at bit ``(i // U) * 8W + (i % U) * BITS`` of the row, little-endian). A code
    that straddles two bytes of its unit (3, 5, 6, 7 bits) reads the next byte too; a
    power-of-two width never does (``W == 1``: one load, one shift, one mask)."""
    off = (i // U) * (8 * W) + (i % U) * BITS
    byte = off // 8
    sh = off % 8
    word = tl.load(base + byte * stride, mask=m, other=0).to(tl.int32)
    if W > 1:
        hi = tl.load(base + (byte + 1) * stride, mask=m & (sh + BITS > 8), other=0)
        word = word | (hi.to(tl.int32) << 8)
    return (word >> sh) & ((1 << BITS) - 1)


@triton.jit
def _centroids(cb_ptr, code, keep):
    """float32 centroids ``c[code]`` from the ``2^bits`` table at ``cb_ptr`` (a gather from a
    table of at most 256 entries: it stays in L1); 0 where ``keep`` is False (padded channels,
    so they add nothing to a dot or a norm)."""
    c = tl.load(cb_ptr + code).to(tl.float32)
    return tl.where(keep, c, 0.0)


@triton.jit
def _codebook_scale(norm, cent, inv_sqrt_d, RN: tl.constexpr):
    """Each codebook key's float32 scale (``kvlens.layouts.codebook.CodebookStore.chunk``):
    ``norm / ||c||`` over the channels (axis 0) of its centroids ``cent [BD, BT]`` when
    renormalised (``RN``), else ``norm / sqrt(D)``."""
    n = norm.to(tl.float32)
    if RN:
        return n / tl.maximum(tl.sqrt(tl.sum(cent * cent, axis=0)),
                              1.1754943508222875e-38)  # float32 tiny, as the reference
    else:
        return n * inv_sqrt_d


@triton.jit
def _token_mask(b, pos, valid, mask_ptr, smb, smn, start_ptr,
                HAS_MASK: tl.constexpr, HAS_START: tl.constexpr):
    """``valid`` AND the padding mask / valid start at absolute positions ``pos``."""
    if HAS_MASK:
        keep = tl.load(mask_ptr + b * smb + pos * smn, mask=valid, other=0)
        valid = valid & (keep != 0)
    if HAS_START:
        start = tl.load(start_ptr + b)
        valid = valid & (pos >= start)
    return valid


@triton.jit
def _packed_split_kernel(
    q_ptr, sqb, sqh, sqd,  # [B, Hq, 1, D] query (T stride unused)
    bal_ptr, sbb, sbh, sbd,  # balancer [B|1, Hkv, D] (sbb = 0 when shared)
    kc_ptr, skcb, skch, skct, skcd,  # key codes uint8: [B, Hkv, cap/Pk, D] or [B, Hkv, cap, D/Pk]
    ks_ptr, sksb, sksh, skst, sksd,  # key scale [B, Hkv, rows, cols] (skst/sksd per layout)
    kz_ptr, skzb, skzh, skzt, skzd,  # key zero, same shape
    vc_ptr, svcb, svch, svct, svcd,  # value codes uint8, same two layouts as the keys
    vs_ptr, svsb, svsh, svst, svsd,  # value scale [B, Hkv, rows, cols]
    vz_ptr, svzb, svzh, svzt, svzd,  # value zero, same shape
    kcb_ptr,  # codebook keys: centroid table [2^bits] (K_CB)
    pv_ptr, spvb, spvh, spvt,  # packed_valid [B, Hkv, cap] uint8 (MiKV: not in the hp set)
    mask_ptr, smb, smn,  # key_mask [B, N] uint8 over absolute positions
    start_ptr,  # valid_start [B] int
    o_ptr, m_ptr, l_ptr,  # partials [B*Hkv, S, GQ, D] fp32 and [B*Hkv, S, GQ] fp32 x2
    Hkv, D, GQ, length, split, S_TOTAL, qscale,  # sizes; qscale = scaling * log2(e)
    k_unit, v_unit,  # 8-bit metadata: the zero's unit in steps (kvlens.quant.meta8.zero_unit)
    inv_sqrt_d,  # codebook scale without renormalisation: norm / sqrt(D)
    BG: tl.constexpr,  # padded query heads per KV head (>= 16 for tl.dot)
    BD: tl.constexpr,  # padded head dim
    BT: tl.constexpr,  # tokens per block; divides every token group (KRT, VRT when > 1)
    KB: tl.constexpr, KU: tl.constexpr, KW: tl.constexpr,  # key bits, packing unit (U, W)
    K_TOK: tl.constexpr,  # keys packed along tokens (per-channel) instead of channels
    KRT: tl.constexpr,  # tokens per key scale row (per-channel G, per-tensor F; 1 = per-token;
    #                     0 = codebook: one norm per token, no scale rows)
    GKD: tl.constexpr, GKD_P: tl.constexpr,  # per-token keys: channels per group and pad
    NKG: tl.constexpr, NKG_P: tl.constexpr,  # per-token keys: groups per token (D/GKD) and pad
    VB: tl.constexpr, VU: tl.constexpr, VW: tl.constexpr,  # value bits, packing unit (U, W)
    V_TOK: tl.constexpr,  # values packed along tokens (per-channel)
    VRT: tl.constexpr,  # tokens per value scale row (per-channel G, per-tensor F; 1 = per-token)
    K_M8: tl.constexpr,  # key scale/zero are 8-bit codes (uint8 / int8), decoded here
    V_M8: tl.constexpr,  # value scale/zero likewise
    MB: tl.constexpr,  # 8-bit scale code bias (kvlens.quant.meta8.SCALE_BIAS)
    MS: tl.constexpr,  # 8-bit scale codes per octave (kvlens.quant.meta8.SCALE_STEPS)
    GV: tl.constexpr, GV_P: tl.constexpr,  # per-token values: channels per group and pad
    NDG: tl.constexpr, NDG_P: tl.constexpr,  # per-token values: groups per token (D/GV) and pad
    HAS_BAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_START: tl.constexpr,
    HAS_PVALID: tl.constexpr,
    K_CB: tl.constexpr,  # keys codebook-coded (k_scale = norms)
    K_RN: tl.constexpr,  # codebook scale norm / ||c|| (renormalised)
):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    gi = tl.arange(0, BG)
    di = tl.arange(0, BD)
    gmask = gi < GQ
    dmask = di < D
    q = tl.load(q_ptr + b * sqb + (h * GQ + gi[:, None]) * sqh + di[None, :] * sqd,
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * qscale
    if HAS_BAL:
        bal = tl.load(bal_ptr + b * sbb + h * sbh + di * sbd, mask=dmask, other=1.0)
        q = q / bal.to(tl.float32)[None, :]
    if KRT == 1:  # per-token keys: q split into channel groups [NKG_P, BG, GKD_P]
        kj = tl.arange(0, NKG_P)
        kcc = tl.arange(0, GKD_P)
        kch = kj[:, None, None] * GKD + kcc[None, None, :]
        kchm = (kj[:, None, None] < NKG) & (kcc[None, None, :] < GKD)
        kct = kj[:, None, None] * GKD + kcc[None, :, None]  # [NKG_P, GKD_P, 1] for the codes
        kctm = (kj[:, None, None] < NKG) & (kcc[None, :, None] < GKD)
        q3 = tl.load(q_ptr + b * sqb + (h * GQ + gi[None, :, None]) * sqh + kch * sqd,
                     mask=kchm & gmask[None, :, None], other=0.0).to(tl.float32) * qscale
        if HAS_BAL:
            bal3 = tl.load(bal_ptr + b * sbb + h * sbh + kch * sbd, mask=kchm, other=1.0)
            q3 = q3 / bal3.to(tl.float32)
        qsum3 = tl.sum(q3, axis=2)  # [NKG_P, BG]: the zero's weight per channel group
        q3h = q3.to(tl.float16)
    # per-token value geometry: [NDG_P, BT, GV_P] codes, channel = j*GV + c
    vj = tl.arange(0, NDG_P)
    vcc = tl.arange(0, GV_P)
    vch = vj[:, None, None] * GV + vcc[None, None, :]
    vchm = (vj[:, None, None] < NDG) & (vcc[None, None, :] < GV)
    m_i = tl.full((BG,), float("-inf"), tl.float32)
    l_i = tl.zeros((BG,), tl.float32)
    if VRT == 1:
        acc = tl.zeros((NDG_P, BG, GV_P), tl.float32)
    else:
        acc = tl.zeros((BG, BD), tl.float32)
    t_begin = sid * split
    t_end = tl.minimum(t_begin + split, length)
    for t0 in range(t_begin, t_end, BT):
        t = t0 + tl.arange(0, BT)
        tv = t < t_end
        valid = _token_mask(b, t, tv, mask_ptr, smb, smn, start_ptr, HAS_MASK, HAS_START)
        if HAS_PVALID:
            keep = tl.load(pv_ptr + b * spvb + h * spvh + t * spvt, mask=tv, other=0)
            valid = valid & (keep != 0)
        # -- keys -> scores [BG, BT] (log2 units)
        if K_CB:
            # codebook: score_t = s_t * (q . c[code_t]), codes packed along channels
            kcode = _unpack_at(kc_ptr + b * skcb + h * skch + t[None, :] * skct, di[:, None],
                               skcd, tv[None, :] & dmask[:, None], KB, KU, KW)
            kcent = _centroids(kcb_ptr, kcode, dmask[:, None])  # [BD, BT]
            knorm = tl.load(ks_ptr + b * sksb + h * sksh + t * skst, mask=tv, other=0)
            ksc = _codebook_scale(knorm, kcent, inv_sqrt_d, K_RN)  # [BT]
            s = tl.dot(q.to(tl.float16), kcent.to(tl.float16)) * ksc[None, :]
        elif KRT == 1:
            # per-token: score_t = sum_j s_tj * (q_j . code_tj) + z_tj * sum(q_j)
            kcode = _unpack_at(kc_ptr + b * skcb + h * skch + t[None, None, :] * skct, kct,
                               skcd, kctm & tv[None, None, :], KB, KU, KW).to(tl.float16)
            part = tl.dot(q3h, kcode)  # [NKG_P, BG, BT]
            ksp = kj[:, None] * sksd + t[None, :] * skst
            kgm = (kj[:, None] < NKG) & tv[None, :]
            ks = tl.load(ks_ptr + b * sksb + h * sksh + ksp, mask=kgm, other=0)
            kzp = kj[:, None] * skzd + t[None, :] * skzt
            kz = tl.load(kz_ptr + b * skzb + h * skzh + kzp, mask=kgm, other=0)
            ks, kz = _group_meta(ks, kz, k_unit, K_M8, MB, MS)
            s = tl.sum(part * ks[:, None, :] + qsum3[:, :, None] * kz[:, None, :], axis=0)
        else:
            # one scale row per block (BT divides KRT): fold it into q
            krow = t0 // KRT
            ks = tl.load(ks_ptr + b * sksb + h * sksh + krow * skst + di * sksd, mask=dmask,
                         other=0)
            kz = tl.load(kz_ptr + b * skzb + h * skzh + krow * skzt + di * skzd, mask=dmask,
                         other=0)
            ks, kz = _group_meta(ks, kz, k_unit, K_M8, MB, MS)
            qs = (q * ks[None, :]).to(tl.float16)
            bias = tl.sum(q * kz[None, :], axis=1)
            if K_TOK:
                kcode = _unpack_at(kc_ptr + b * skcb + h * skch + di[:, None] * skcd,
                                   t[None, :], skct, tv[None, :] & dmask[:, None], KB, KU, KW)
            else:  # per-tensor: packed along channels
                kcode = _unpack_at(kc_ptr + b * skcb + h * skch + t[None, :] * skct,
                                   di[:, None], skcd, tv[None, :] & dmask[:, None], KB, KU, KW)
            s = tl.dot(qs, kcode.to(tl.float16)) + bias[:, None]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # -- values
        if VRT == 1:
            # per-token: fold the scale of each channel group into p
            vsp = vj[:, None] * svsd + t[None, :] * svst
            pmask = (vj[:, None] < NDG) & tv[None, :]
            vs = tl.load(vs_ptr + b * svsb + h * svsh + vsp, mask=pmask, other=0)
            vzp = vj[:, None] * svzd + t[None, :] * svzt
            vz = tl.load(vz_ptr + b * svzb + h * svzh + vzp, mask=pmask, other=0)
            vs, vz = _group_meta(vs, vz, v_unit, V_M8, MB, MS)
            vcode = _unpack_at(vc_ptr + b * svcb + h * svch + t[None, :, None] * svct, vch,
                               svcd, vchm & tv[None, :, None], VB, VU, VW).to(tl.float16)
            pw = (p[None, :, :] * vs[:, None, :]).to(tl.float16)  # [NDG_P, BG, BT]
            pv = tl.dot(pw, vcode)  # [NDG_P, BG, GV_P]
            zt = tl.sum(p[None, :, :] * vz[:, None, :], axis=2)  # [NDG_P, BG]
            acc = acc * alpha[None, :, None] + pv + zt[:, :, None]
        else:
            # one scale row per block (BT divides VRT): o_d += s_d * (p . code_d) + z_d * sum(p)
            vrow = t0 // VRT
            vs = tl.load(vs_ptr + b * svsb + h * svsh + vrow * svst + di * svsd, mask=dmask,
                         other=0)
            vz = tl.load(vz_ptr + b * svzb + h * svzh + vrow * svzt + di * svzd, mask=dmask,
                         other=0)
            vs, vz = _group_meta(vs, vz, v_unit, V_M8, MB, MS)
            if V_TOK:
                vcode = _unpack_at(vc_ptr + b * svcb + h * svch + di[None, :] * svcd,
                                   t[:, None], svct, tv[:, None] & dmask[None, :], VB, VU, VW)
            else:
                vcode = _unpack_at(vc_ptr + b * svcb + h * svch + t[:, None] * svct,
                                   di[None, :], svcd, tv[:, None] & dmask[None, :], VB, VU, VW)
            pv = tl.dot(p.to(tl.float16), vcode.to(tl.float16))  # [BG, BD]
            acc = acc * alpha[:, None] + pv * vs[None, :] + tl.sum(p, axis=1)[:, None] * vz[None, :]
        m_i = m_new
    base = pid * S_TOTAL + sid
    if VRT == 1:
        optr = o_ptr + (base * GQ + gi[None, :, None]) * D + vch
        tl.store(optr, acc, mask=gmask[None, :, None] & vchm)
    else:
        tl.store(o_ptr + (base * GQ + gi[:, None]) * D + di[None, :], acc,
                 mask=gmask[:, None] & dmask[None, :])
    tl.store(m_ptr + base * GQ + gi, m_i, mask=gmask)
    tl.store(l_ptr + base * GQ + gi, l_i, mask=gmask)


@triton.jit
def _dense_split_kernel(
    q_ptr, sqb, sqh, sqd,  # [B, Hq, 1, D] query
    k_ptr, skb, skh, skt, skd,  # [B, Hkv, N, D] full-precision keys
    v_ptr, svb, svh, svt, svd,  # [B, Hkv, N, D] full-precision values
    pos_ptr, spb, sph, spt,  # [B, Hkv, N] absolute positions (HAS_POS), < 0 = unused slot
    mask_ptr, smb, smn,  # key_mask [B, N] uint8
    start_ptr,  # valid_start [B]
    o_ptr, m_ptr, l_ptr,  # partials
    Hkv, D, GQ, n_tok, pos0, split, split_base, S_TOTAL, qscale,
    BG: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_START: tl.constexpr,
):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    gi = tl.arange(0, BG)
    di = tl.arange(0, BD)
    gmask = gi < GQ
    dmask = di < D
    q = tl.load(q_ptr + b * sqb + (h * GQ + gi[:, None]) * sqh + di[None, :] * sqd,
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * qscale
    m_i = tl.full((BG,), float("-inf"), tl.float32)
    l_i = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, BD), tl.float32)
    t_begin = sid * split
    t_end = tl.minimum(t_begin + split, n_tok)
    for t0 in range(t_begin, t_end, BT):
        t = t0 + tl.arange(0, BT)
        tv = t < t_end
        if HAS_POS:
            pos = tl.load(pos_ptr + b * spb + h * sph + t * spt, mask=tv, other=-1)
            tv = tv & (pos >= 0)
            pos = tl.where(tv, pos, 0)
        else:
            pos = pos0 + t
        valid = _token_mask(b, pos, tv, mask_ptr, smb, smn, start_ptr, HAS_MASK, HAS_START)
        kt = tl.load(k_ptr + b * skb + h * skh + t[None, :] * skt + di[:, None] * skd,
                     mask=tv[None, :] & dmask[:, None], other=0.0)  # [BD, BT]
        s = tl.dot(q.to(kt.dtype), kt)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * svb + h * svh + t[:, None] * svt + di[None, :] * svd,
                    mask=tv[:, None] & dmask[None, :], other=0.0)  # [BT, BD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    base = pid * S_TOTAL + split_base + sid
    tl.store(o_ptr + (base * GQ + gi[:, None]) * D + di[None, :], acc,
             mask=gmask[:, None] & dmask[None, :])
    tl.store(m_ptr + base * GQ + gi, m_i, mask=gmask)
    tl.store(l_ptr + base * GQ + gi, l_i, mask=gmask)


@triton.jit
def _merge_kernel(
    o_ptr, m_ptr, l_ptr,  # partials [B*Hkv, S, GQ, D], [B*Hkv, S, GQ] x2 (fp32)
    out_ptr, sob, soh, sod,  # output [B, Hq, 1, D]
    Hq, D, GQ, S_TOTAL,
    BS: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0)  # b * Hq + query head
    b = pid // Hq
    hq = pid % Hq
    kv = b * (Hq // GQ) + hq // GQ
    g = hq % GQ
    si = tl.arange(0, BS)
    di = tl.arange(0, BD)
    smask = si < S_TOTAL
    idx = (kv * S_TOTAL + si) * GQ + g
    m = tl.load(m_ptr + idx, mask=smask, other=float("-inf"))
    lsum = tl.load(l_ptr + idx, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * lsum, axis=0)
    o = tl.load(o_ptr + idx[:, None] * D + di[None, :], mask=smask[:, None] & (di[None, :] < D),
                other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)
    out = tl.where(denom > 0, num / tl.maximum(denom, 1.1754943508222875e-38), 0.0)
    tl.store(out_ptr + b * sob + hq * soh + di * sod, out.to(out_ptr.dtype.element_ty),
             mask=di < D)


# -- launcher -------------------------------------------------------------------------------------

def _pow2_factor(n: int) -> int:
    return n & -n


def _auto_split(tokens: int, programs: int, block: int, device: torch.device) -> int:
    """Tokens per split: enough splits to fill a GPU (~2 waves of 132 SMs), never below 256
    tokens; on CPU (interpreter) as few programs as possible."""
    if tokens <= 0:
        return block
    if device.type == "cuda":
        want = max(1, math.ceil(264 / max(programs, 1)))
        per = max(256, math.ceil(tokens / want))
    else:
        per = max(4096, tokens)
    return -(-per // block) * block


def _as_u8(name: str, t, b: int, hkv: int | None, min_len: int, device) -> torch.Tensor:
    ndim = 2 if hkv is None else 3
    check_tensor(name, t, ndim, (torch.bool, torch.uint8), device)
    check_shape(name, t, (b, None) if hkv is None else (b, hkv, None))
    if t.shape[-1] < min_len:
        raise KernelInputError(f"{name} covers {t.shape[-1]} positions but {min_len} are needed.")
    return t.view(torch.uint8) if t.dtype == torch.bool else t


CODEBOOK = "codebook"
LAYOUTS = ("per-channel", "per-token", "per-tensor", CODEBOOK)  # codebook: keys only
VALUE_LAYOUTS = LAYOUTS[:3]


def _packed_geometry(which: str, layout: str, bits: int, group, codes, scale, zero, length: int,
                     b: int, hkv: int, d: int, dev, meta8: bool = False
                     ) -> tuple[bool, int, int]:
    """Check one packed tensor (``which`` = ``k`` or ``v``) against ``layout``; return
    ``(packed along tokens, tokens per scale row (1 = per-token), channels per scale group)``.

    ``group``: per-channel = tokens per group ``G``; per-tensor = tokens per block ``F`` (one
    scale per block); per-token = channels per group (``None`` = ``D``)."""
    gname = f"{which}_group"
    if layout not in LAYOUTS:
        raise KernelInputError(f"{which}_layout {layout!r} is not a packed layout; allowed: "
                         f"{', '.join(LAYOUTS)}.")
    per, width = pack_unit(bits)
    if layout == CODEBOOK:
        return _codebook_geometry(which, bits, group, codes, scale, zero, length, b, hkv, d,
                                  dev, meta8)
    if layout == "per-token":
        gd = d if group is None else group
        check_int(gname, gd, 1)
        if d % gd or gd < 16:
            raise KernelInputError(f"{gname} {gd} must divide head_dim {d} and be >= 16; allowed "
                             f"e.g. 32, 64, 128 (or None for the whole head).")
        if gd % per:
            raise KernelInputError(f"{gname} {gd} must be a multiple of {per} ({bits}-bit codes "
                             f"are packed {per} per {width} byte(s)).")
        rows_t, cols = 1, d // gd
    else:
        if group is None:
            what = "G (tokens per group)" if layout == "per-channel" else "the flush block F"
            raise KernelInputError(f"{gname} is required for {layout} {which}: {what}.")
        check_int(gname, group, 1)
        if group % 16 or group % per:
            raise KernelInputError(f"{gname} {group} must be a multiple of 16 (tensor-core token "
                             f"blocks) and of {per}; allowed e.g. 32, 64, 128.")
        rows_t, gd = group, d
        cols = d if layout == "per-channel" else 1
    tok = layout == "per-channel"
    cname = f"{which}_codes"
    check_tensor(cname, codes, 4, (torch.uint8,), dev)
    check_shape(cname, codes, (b, hkv, None, d if tok else -(-d // per) * width))
    held = codes.shape[2] // width * per if tok else codes.shape[2]
    if held < length:
        raise KernelInputError(f"{cname} holds {held} tokens < length {length}.")
    n_rows = -(-length // rows_t)
    dtypes = ((torch.uint8,), (torch.int8,)) if meta8 else (SCALE_DTYPES, SCALE_DTYPES)
    for (name, t), allowed in zip(((f"{which}_scale", scale), (f"{which}_zero", zero)), dtypes):
        check_tensor(name, t, 4, allowed, dev)
        check_shape(name, t, (b, hkv, None, cols))
        if t.shape[2] < n_rows:
            raise KernelInputError(f"{name} has {t.shape[2]} group rows < {n_rows} needed for length "
                             f"{length} ({layout}, {gname} {group}).")
    return tok, rows_t, gd


def _param_strides(t, layout: str) -> tuple[int, int, int, int]:
    """Strides of a scale/zero tensor as the kernel indexes it ``[B, H, row, col]``: a per-tensor
    one has one column (stride 0 reads it for every channel); codebook norms ``[B, H, N]`` get a
    column stride of 0 and a codebook's absent zero all zeros."""
    if t is None:
        return 0, 0, 0, 0
    if layout == CODEBOOK:
        return (*t.stride(), 0)
    return t.stride()[:3] + ((0,) if layout == "per-tensor" else t.stride()[3:])


def _codebook_geometry(which: str, bits: int, group, codes, norms, zero, length: int, b: int,
                       hkv: int, d: int, dev, meta8: bool) -> tuple[bool, int, int]:
    """Check a codebook-coded tensor (``kvlens.layouts.codebook``): codes packed along channels
    ``[B, Hkv, >=length, ceil(D/U)*W]``, ``*_scale`` = the norms ``[B, Hkv, >=length]``, no
    zero, group or 8-bit unit. Returns the geometry ``(False, 0, D)`` (no scale rows)."""
    for name, given in ((f"{which}_zero", zero), (f"{which}_group", group)):
        if given is not None:
            raise KernelInputError(f"{name} must be None for {which}_layout 'codebook' (a codebook "
                                   f"tensor has one norm per vector and a centroid table).")
    if meta8:
        raise KernelInputError(f"{which}_zero_unit must be None for {which}_layout 'codebook' "
                               "(its norms are float16/float32, not 8-bit codes).")
    per, width = pack_unit(bits)
    cname = f"{which}_codes"
    check_tensor(cname, codes, 4, (torch.uint8,), dev)
    check_shape(cname, codes, (b, hkv, None, -(-d // per) * width))
    nname = f"{which}_scale"
    check_tensor(nname, norms, 3, SCALE_DTYPES, dev)
    check_shape(nname, norms, (b, hkv, None))
    for name, t in ((cname, codes), (nname, norms)):
        if t.shape[2] < length:
            raise KernelInputError(f"{name} holds {t.shape[2]} tokens < length {length}.")
    return False, 0, d


def _centroid_table(which: str, table, bits: int, dev) -> torch.Tensor:
    """A codebook's ``2^bits`` centroids (float16/float32, 1-D, contiguous on ``dev``)."""
    name = f"{which}_centroids"
    if table is None:
        raise KernelInputError(f"{which}_layout 'codebook' needs {name}: the {1 << bits} "
                               f"centroids of its {bits}-bit codebook.")
    check_tensor(name, table, 1, SCALE_DTYPES, dev)
    check_shape(name, table, (1 << bits,))
    return table.contiguous()


def _head_vectors(name: str, t, b: int, hkv: int, d: int, dev) -> torch.Tensor | None:
    """A per-KV-head vector argument (``[Hkv, D]`` or ``[B, Hkv, D]``) checked and as
    ``[1|B, Hkv, D]``; ``None`` stays ``None``."""
    if t is None:
        return None
    check_tensor(name, t, t.dim() if isinstance(t, torch.Tensor) and t.dim() in (2, 3) else 3,
                 FLOAT_DTYPES, dev)
    out = t if t.dim() == 3 else t.unsqueeze(0)
    check_shape(name, out, (out.shape[0], hkv, d))
    if out.shape[0] not in (1, b):
        raise KernelInputError(f"{name} batch {out.shape[0]} must be 1 or {b}.")
    return out


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    length: int,
    *,
    k_bits: int,
    v_bits: int,
    k_group: int | None,
    v_group: int | None,
    scaling: float,
    k_layout: str = "per-channel",
    v_layout: str = "per-token",
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    residual_len: int = 0,
    extra: tuple | list = (),
    packed_valid: torch.Tensor | None = None,
    balancer: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    valid_start: torch.Tensor | None = None,
    split_tokens: int | None = None,
    k_zero_unit: float | None = None,
    v_zero_unit: float | None = None,
    k_centroids: torch.Tensor | None = None,
    k_renormalize: bool = False,
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, Hq, 1, D]`` over one layer's compressed cache ->
    ``[B, Hq, 1, D]`` in ``q.dtype``. Layout and semantics: module docstring.

    k_codes/k_scale/k_zero, v_codes/v_scale/v_zero: the packed keys / values in
    ``kvlens.layouts.packed``'s layout for ``k_layout`` / ``v_layout``: ``per-channel`` (groups of
    ``*_group`` tokens, packed along tokens; KIVI's keys), ``per-token`` (groups of ``*_group``
    channels, ``None`` = ``D``, packed along channels; KIVI's values) or ``per-tensor`` (one
    scale per block of ``*_group`` tokens, packed along channels). ``length``: packed tokens (absolute positions ``0..length-1``); the
    packed tensors may be ``None`` when ``length == 0``.
    residual_k/residual_v: ``[B, Hkv, >=residual_len, D]`` full precision, positions
    ``length..length+residual_len-1``.
    extra: sequence of ``(k, v, pos)`` full-precision token sets (``[B, Hkv, N, D]`` x2, ``pos
    [B, Hkv, N]`` absolute positions, ``< 0`` = unused); each is one more split segment.
    packed_valid: bool ``[B, Hkv, >=length]``, False hides a packed token (MiKV hp copies).
    balancer: ``[Hkv, D]`` or ``[B, Hkv, D]``: keys were stored as ``k * balancer``; the query is
    divided by it for the packed segment only.
    key_mask: bool ``[B, N]`` over absolute positions, True = attend. valid_start: ``[B]`` ints,
    positions before it are masked (left padding).
    split_tokens: tokens per split of the packed store (multiple of the token block); ``None``
    picks one for the device.
    k_zero_unit/v_zero_unit: ``None``: the scales and zeros are float16/float32. A number: they
    are 8-bit group metadata (``kvlens.quant.meta8``: scale uint8 codes, zero int8 codes whose
    unit is this many quantization steps, ``zero_unit(bits)``), decoded in the kernel.
    ``k_layout`` ``"codebook"`` (``kvlens.layouts.codebook``, keys only: vLLM TurboQuant's):
    ``k_codes`` uint8 ``[B, Hkv, >=length, ceil(D/U)*W]`` (one vector's codes packed along
    channels), ``k_scale`` its norms ``[B, Hkv, >=length]`` float16/float32, ``k_zero`` and
    ``k_group`` ``None``; ``k_centroids`` the ``2^bits`` centroids (float16/float32),
    ``k_renormalize`` the spec's flag (scale ``norm / ||c||`` instead of ``norm / sqrt(D)``).
    The keys are read in the basis they were coded in: a rotated codebook's query must come
    rotated.
    """
    check_tensor("q", q, 4, FLOAT_DTYPES)
    dev = q.device
    b, hq, tq, d = q.shape
    if tq != 1:
        raise KernelInputError(f"decode_attention takes one query token per sequence (q [B, Hq, 1, D]),"
                         f" got q of shape {list(q.shape)}; use the torch path for prefill.")
    check_int("length", length, 0)
    check_int("residual_len", residual_len, 0)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool):
        raise KernelInputError(f"scaling must be a float, got {scaling!r}.")
    kunit, vunit = pack_unit(k_bits), pack_unit(v_bits)
    hkv = None
    for name, t in (("k_codes", k_codes), ("residual_k", residual_k)):
        if t is not None:
            check_tensor(name, t, 4, (torch.uint8,) if name == "k_codes" else FLOAT_DTYPES, dev)
            hkv = t.shape[1]
            break
    if hkv is None and extra:
        hkv = extra[0][0].shape[1] if isinstance(extra[0][0], torch.Tensor) else None
    if hkv is None:
        raise KernelInputError("decode_attention got no keys: pass the packed store (length > 0), a "
                         "residual window or an extra token set.")
    if hkv < 1 or hq % hkv:
        raise KernelInputError(f"query heads {hq} must be a multiple of KV heads {hkv} (GQA).")
    gq = hq // hkv
    kgeo = vgeo = (False, 1, d)
    for name, lay, allowed in (("k_layout", k_layout, LAYOUTS),
                               ("v_layout", v_layout, VALUE_LAYOUTS)):
        if lay not in allowed:
            raise KernelInputError(f"{name} {lay!r} is not a packed layout; allowed: "
                                   f"{', '.join(allowed)}.")
    k_book = k_layout == CODEBOOK
    k_table = None
    if length:
        needed = [k_codes, k_scale, v_codes, v_scale, v_zero] + ([] if k_book else [k_zero])
        if any(t is None for t in needed):
            raise KernelInputError("length > 0 needs all of k_codes, k_scale, k_zero, v_codes, "
                             "v_scale, v_zero (no zeros for a codebook layout).")
        for name, unit in (("k_zero_unit", k_zero_unit), ("v_zero_unit", v_zero_unit)):
            if unit is not None and not (isinstance(unit, (int, float)) and unit > 0):
                raise KernelInputError(f"{name} must be a positive number (8-bit metadata) or None, "
                                 f"got {unit!r}.")
        kgeo = _packed_geometry("k", k_layout, k_bits, k_group, k_codes, k_scale, k_zero,
                                length, b, hkv, d, dev, meta8=k_zero_unit is not None)
        vgeo = _packed_geometry("v", v_layout, v_bits, v_group, v_codes, v_scale, v_zero,
                                length, b, hkv, d, dev, meta8=v_zero_unit is not None)
        if not isinstance(k_renormalize, bool):
            raise KernelInputError(f"k_renormalize must be True or False, got "
                                   f"{k_renormalize!r}.")
        if k_book:
            k_table = _centroid_table("k", k_centroids, k_bits, dev)
    if residual_len:
        for name, t in (("residual_k", residual_k), ("residual_v", residual_v)):
            if t is None:
                raise KernelInputError(f"residual_len {residual_len} > 0 but {name} is None.")
            check_tensor(name, t, 4, FLOAT_DTYPES, dev)
            check_shape(name, t, (b, hkv, None, d))
            if t.shape[2] < residual_len:
                raise KernelInputError(f"{name} holds {t.shape[2]} tokens < residual_len "
                                 f"{residual_len}.")
    extras = []
    for i, item in enumerate(extra):
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise KernelInputError(f"extra[{i}] must be a tuple (k, v, pos).")
        ek, ev, ep = item
        check_tensor(f"extra[{i}] k", ek, 4, FLOAT_DTYPES, dev)
        check_shape(f"extra[{i}] k", ek, (b, hkv, None, d))
        check_tensor(f"extra[{i}] v", ev, 4, FLOAT_DTYPES, dev)
        check_shape(f"extra[{i}] v", ev, tuple(ek.shape))
        check_tensor(f"extra[{i}] pos", ep, 3, INT_DTYPES, dev)
        check_shape(f"extra[{i}] pos", ep, tuple(ek.shape[:3]))
        if ek.shape[2]:
            extras.append((ek, ev, ep))
    pvalid = None
    if packed_valid is not None and length:
        pvalid = _as_u8("packed_valid", packed_valid, b, hkv, length, dev)
    mask = None
    if key_mask is not None:
        mask = _as_u8("key_mask", key_mask, b, None, length + residual_len, dev)
    start = None
    if valid_start is not None:
        check_tensor("valid_start", valid_start, 1, INT_DTYPES, dev)
        check_shape("valid_start", valid_start, (b,))
        start = valid_start
    bal = _head_vectors("balancer", balancer, b, hkv, d, dev)

    bg = max(16, next_pow2(gq))
    bd = max(16, next_pow2(d))
    programs = b * hkv
    # -- segments: packed splits, then residual splits, then each extra set
    token_groups = [g for g in (kgeo[1], vgeo[1]) if g > 1]
    bt_p = min([64] + [_pow2_factor(g) for g in token_groups]) if length else 16
    if split_tokens is not None:
        check_int("split_tokens", split_tokens, 1)
        if split_tokens % bt_p:
            raise KernelInputError(f"split_tokens {split_tokens} must be a multiple of the token block "
                             f"{bt_p}.")
    split_p = split_tokens or _auto_split(length, programs, bt_p, dev)
    n_packed = -(-length // split_p) if length else 0
    dense = []  # (k, v, pos or None, n_tok, pos0, split, n_splits)
    bt_d = 32
    if residual_len:
        split_r = split_tokens or _auto_split(residual_len, programs, bt_d, dev)
        split_r = -(-split_r // bt_d) * bt_d
        dense.append((residual_k, residual_v, None, residual_len, length, split_r,
                      -(-residual_len // split_r)))
    for ek, ev, ep in extras:
        n = ek.shape[2]
        split_e = -(-(split_tokens or _auto_split(n, programs, bt_d, dev)) // bt_d) * bt_d
        dense.append((ek, ev, ep, n, 0, split_e, -(-n // split_e)))
    s_total = n_packed + sum(x[-1] for x in dense)
    out = torch.full_like(q, float("nan"))
    if s_total == 0:
        return out.zero_()
    alloc = (lambda *shape: torch.full(shape, float("nan"), device=dev)) if POISON_PARTIALS \
        else (lambda *shape: torch.empty(shape, dtype=torch.float32, device=dev))
    o_part = alloc(programs, s_total, gq, d)
    m_part = alloc(programs, s_total, gq)
    l_part = alloc(programs, s_total, gq)
    qscale = float(scaling) * LOG2E
    dummy = o_part  # never dereferenced when the matching HAS_* flag is off
    mask_args = (mask, *mask.stride()) if mask is not None else (dummy, 0, 0)
    start_arg = start if start is not None else dummy
    qs = (q.stride(0), q.stride(1), q.stride(3))
    if n_packed:
        bal_args = ((bal, 0 if bal.shape[0] == 1 else bal.stride(0), bal.stride(1),
                     bal.stride(2)) if bal is not None else (dummy, 0, 0, 0))
        pv_args = (pvalid, *pvalid.stride()) if pvalid is not None else (dummy, 0, 0, 0)
        nkg, ndg = d // kgeo[2], d // vgeo[2]
        # per-tensor scales have one column: stride 0 reads it for every channel
        # codebook norms are 3-D (a fourth stride of 0) and have no zero (never read)
        kss, kzs = (_param_strides(t, k_layout) for t in (k_scale, k_zero))
        vss, vzs = (_param_strides(t, v_layout) for t in (v_scale, v_zero))
        _packed_split_kernel[(programs, n_packed)](
            q, *qs, *bal_args,
            k_codes, *k_codes.stride(), k_scale, *kss, dummy if k_book else k_zero, *kzs,
            v_codes, *v_codes.stride(), v_scale, *vss, v_zero, *vzs,
            dummy if k_table is None else k_table,
            *pv_args, *mask_args, start_arg, o_part, m_part, l_part,
            hkv, d, gq, length, split_p, s_total, qscale,
            float(k_zero_unit or 0.0), float(v_zero_unit or 0.0), 1.0 / math.sqrt(d),
            BG=bg, BD=bd, BT=bt_p, KB=k_bits, KU=kunit[0], KW=kunit[1], K_TOK=kgeo[0], KRT=kgeo[1],
            GKD=kgeo[2], GKD_P=max(16, next_pow2(kgeo[2])), NKG=nkg, NKG_P=next_pow2(nkg),
            VB=v_bits, VU=vunit[0], VW=vunit[1], V_TOK=vgeo[0], VRT=vgeo[1],
            GV=vgeo[2], GV_P=max(16, next_pow2(vgeo[2])), NDG=ndg, NDG_P=next_pow2(ndg),
            HAS_BAL=bal is not None, HAS_MASK=mask is not None, HAS_START=start is not None,
            HAS_PVALID=pvalid is not None, K_M8=k_zero_unit is not None,
            V_M8=v_zero_unit is not None, MB=META8_SCALE_BIAS, MS=META8_SCALE_STEPS,
            K_CB=k_book, K_RN=k_book and k_renormalize)
    base = n_packed
    for dk, dv, dpos, n_tok, pos0, split, n_splits in dense:
        pos_args = (dpos, *dpos.stride()) if dpos is not None else (dummy, 0, 0, 0)
        _dense_split_kernel[(programs, n_splits)](
            q, *qs, dk, *dk.stride(), dv, *dv.stride(), *pos_args, *mask_args, start_arg,
            o_part, m_part, l_part, hkv, d, gq, n_tok, pos0, split, base, s_total, qscale,
            BG=bg, BD=bd, BT=bt_d, HAS_POS=dpos is not None, HAS_MASK=mask is not None,
            HAS_START=start is not None)
        base += n_splits
    _merge_kernel[(b * hq,)](o_part, m_part, l_part, out, out.stride(0), out.stride(1),
                             out.stride(3), hq, d, gq, s_total, BS=next_pow2(s_total), BD=bd)
    return out


__all__ = ["decode_attention"]
