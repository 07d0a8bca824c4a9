"""llama.cpp's CPU attention arithmetic around its KV cache, in plain torch (x86, AVX2 build).

Each step of what the engine does with a query and the cached K/V, the llama.cpp function it
was read from (the llama.cpp llama-cpp-python 0.3.36 vendors) and what is not modelled:
docs/lab-notes/deploy-llamacpp.md#the-engines-arithmetic-cpu-read-from-llamacpps-source.
Tensors are ``[B, H, T, D]``; keys and values are in the stored (rotated) basis, queries
already multiplied by K's rotation. With flash attention (``-fa on``) the query row is converted
to K's ``vec_dot_type`` (``query_to_vec_dot``) and dotted with the stored keys (``key_scores``);
an f16 V is accumulated in an fp16 buffer (``accumulate_f16``), any other V in float32; the
tiled path of f16/f16 (``fa_path``) is the model's own float arithmetic. Without it (``:nofa``)
the probabilities are rounded to V's vec_dot type (f16 for an f16 V).

Logit soft-capping (Gemma 2) and learned attention sinks (gpt-oss), as ``one_chunk`` and
``tiled`` apply them: ``scale /= softcap`` once, then ``softcap * tanhf(s * scale)`` per score
before the mask (the non-flash graph's ``ggml_tanh`` between two ``ggml_scale`` is the same
formula, not modelled to the last ulp); the head's sink logit joins the row maximum and adds
``expf(sink - M)`` to the sum after the last key, with no value (``ggml_soft_max_add_sinks`` /
``ggml_flash_attn_ext_add_sinks``).
"""

from __future__ import annotations

import torch

from kvlens.errors import ConfigError
from kvlens.quant.ggml import _inverse

#: K cache type -> the type the query row is converted to for ``vec_dot`` (``type_traits_cpu``)
VEC_DOT_TYPE = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0",
                "q5_0": "q8_0", "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1"}
#: queries per tile of the tiled flash-attention path (``GGML_FA_TILE_Q``)
FA_TILE_Q = 64
#: the attention arithmetic a KVConfig can ask for (``KVConfig.engine_attention``)
ENGINE_ATTENTIONS = ("llamacpp-cpu-fa", "llamacpp-cpu-nofa")
Q8_BLOCK = 32
Q8_K_BLOCK = 256


def _check_type(name: str) -> None:
    if name not in VEC_DOT_TYPE:
        raise ConfigError(f"Unknown llama.cpp cache type {name!r}; allowed: "
                          f"{', '.join(VEC_DOT_TYPE)}.")


def fa_read_type(cache_type: str) -> str:
    """The type flash attention reads a cache of ``cache_type`` as: f32 is cast to f16."""
    _check_type(cache_type)
    return "f16" if cache_type == "f32" else cache_type


def fa_path(key_type: str, value_type: str, n_queries: int) -> str:
    """``"tiled"`` or ``"one_chunk"``: the CPU flash-attention kernel for these (read) types
    and ``n_queries`` query rows per ubatch (``ggml_compute_forward_flash_attn_ext_f16``)."""
    same_float = key_type == value_type and key_type in ("f16", "f32")
    return "tiled" if same_float and n_queries >= FA_TILE_Q else "one_chunk"


def quantize_q8_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x86 ``quantize_row_q8_0`` / ``quantize_row_q8_1`` of the rows of ``x`` ``[..., D]``.

    Returns ``(codes, d, s)``: int codes float32 ``[..., D//32, 32]`` (``round_nearest_even(x *
    127/amax)``), ``d`` the fp16 scale ``amax/127`` as float32 ``[..., D//32]``, and q8_1's
    ``s = fp16(d * sum(codes))`` (``d`` unrounded there) as float32 ``[..., D//32]``."""
    if x.shape[-1] % Q8_BLOCK:
        raise ConfigError(f"q8_0/q8_1 need a row length divisible by {Q8_BLOCK}, got "
                          f"{x.shape[-1]}.")
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)
    amax = blocks.abs().amax(-1)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None])  # _mm256_round_ps nearest: ties to even
    s = (d * codes.sum(-1)).half().float()
    return codes, d.half().float(), s


def quantize_q8_k(x: torch.Tensor) -> torch.Tensor:
    """``quantize_row_q8_K_ref`` (also x86's) and back, rows ``[..., D]`` with ``D % 256 ==
    0`` -> float32 ``[..., D//256, 256]``: per block of 256 the first element of largest
    magnitude ``max`` sets ``iscale = -127 / max``, codes ``min(127, round_even(iscale x))``,
    values ``codes / iscale`` (a float32 scale: no fp16 rounding). The K-quant weights' type."""
    if x.shape[-1] % Q8_K_BLOCK:
        raise ConfigError(f"q8_K needs a row length divisible by {Q8_K_BLOCK}, got "
                          f"{x.shape[-1]}.")
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_K_BLOCK, Q8_K_BLOCK)
    idx = blocks.abs().argmax(-1, keepdim=True)  # the first of equal magnitudes
    top = torch.gather(blocks, -1, idx)
    safe = torch.where(top != 0, top, torch.ones_like(top))
    iscale = torch.where(top != 0, -127.0 / safe, torch.zeros_like(top))
    codes = torch.round(iscale * blocks).clamp(max=127)
    return codes * _inverse(iscale)


def query_to_vec_dot(q: torch.Tensor, key_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The query rows ``[..., D]`` as the key type's ``vec_dot`` sees them after
    ``from_float`` of its ``vec_dot_type``: ``(values, s)`` with ``values`` float32 (q8: codes
    times the fp16 scale) and ``s`` q8_1's fp16 block sums ``[..., D//32]`` (``None`` for the
    other types). The same conversion feeds every CPU ``mul_mat`` with a weight of that type
    (``kvlens.model.engine_matmul``)."""
    _check_type(key_type)
    return convert_rows(q, VEC_DOT_TYPE[key_type])


def convert_rows(q: torch.Tensor, vdt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``[..., D]`` through ``from_float`` of the vec_dot type ``vdt`` (``f32``, ``f16``,
    ``bf16``, ``q8_0``, ``q8_1``) and back: ``(values, s)`` as ``query_to_vec_dot``."""
    if vdt not in ("f32", "f16", "bf16", "q8_0", "q8_1", "q8_k"):
        raise ConfigError(f"Unknown vec_dot type {vdt!r}; allowed: f32, f16, bf16, q8_0, q8_1, "
                          "q8_k.")
    if vdt == "q8_k":
        return quantize_q8_k(q).reshape(q.shape), None
    if vdt == "f32":
        return q.float(), None
    if vdt == "f16":
        return q.float().half().float(), None
    if vdt == "bf16":
        return q.float().bfloat16().float(), None
    codes, d, s = quantize_q8_cpu(q)
    values = (codes * d[..., None]).reshape(q.shape)
    return values, (s if vdt == "q8_1" else None)


def key_scores(q_values: torch.Tensor, q_sums: torch.Tensor | None, k: torch.Tensor,
               k_min: torch.Tensor | None) -> torch.Tensor:
    """Raw scores ``[B, Hq, Tq, N]`` (before the softmax scale) of converted queries
    ``[B, Hq, Tq, D]`` against stored keys ``[B, Hkv, N, D]`` (GQA broadcast). ``vec_dot`` of a
    ``_1`` key block with a q8_1 query block is ``d_k d_q sum(q_k q_q) + m_k s_q``: with the
    dequantized key ``d_k q_k + m_k`` that is the plain dot plus ``m_k (s_q - d_q sum q_q)``,
    added here from the key minima ``k_min`` ``[B, Hkv, N, D//32]``."""
    b, hq, tq, d = q_values.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q_values.reshape(b, hkv, g * tq, d)
    s = qg @ k.float().transpose(-1, -2)
    if q_sums is not None and k_min is not None:
        exact = q_values.reshape(b, hq, tq, d // Q8_BLOCK, Q8_BLOCK).sum(-1)
        err = (q_sums - exact).reshape(b, hkv, g * tq, d // Q8_BLOCK)
        s = s + err @ k_min.float().transpose(-1, -2)
    return s.reshape(b, hq, tq, -1)


def accumulate_f16(scores: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                   key_block: int = 256, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``one_chunk``'s online softmax with an fp16 V accumulator, key by key in cache order.

    scores: float32 ``[B, Hq, Tq, N]`` (scaled); v: ``[B, Hkv, N, D]``; visible: bool
    broadcastable to scores. Per visible key ``s``: on a new maximum ``VKQ = fp16(VKQ * exp(M_old -
    s))``; then ``VKQ = fp16(VKQ + v * exp(s - M))`` (as the x86 F16C code); returns ``VKQ / S``
    float32 ``[B, Hq, Tq, D]``. The running maximum is a cumulative maximum of the scores, so only
    the fp16 accumulator loops over keys; ``S`` is summed in float32 at once (its rounding order is
    not modelled). ``sinks`` ``[Hq]`` join after the last key (module docstring)."""
    b, hq, tq, n = scores.shape
    hkv, d = v.shape[1], v.shape[-1]
    g = hq // hkv
    vis = visible.expand(b, hq, tq, n).reshape(b, hkv, g * tq, n)
    sc = scores.reshape(b, hkv, g * tq, n).masked_fill(~vis, float("-inf"))
    big_m = torch.cummax(sc, dim=-1).values  # the running maximum after each key
    prev = torch.cat((torch.full_like(big_m[..., :1], float("-inf")), big_m[..., :-1]), -1)
    new_max = vis & (sc > prev)
    ms = torch.where(new_max, torch.exp(prev - big_m), torch.ones_like(sc))
    vs = torch.where(vis, torch.exp(sc - big_m), torch.zeros_like(sc))
    rescale = new_max.any(dim=(0, 1, 2)).tolist()  # keys where some row takes a new maximum
    vf = v.half().float()
    acc = torch.zeros(b, hkv, g * tq, d, dtype=torch.float16, device=scores.device)
    for k0 in range(0, n, key_block):
        k1 = min(n, k0 + key_block)
        # v * vs for this block of keys: [B, Hkv, rows, keys, D]
        pv = vs[..., k0:k1, None] * vf[:, :, None, k0:k1, :]
        for ic in range(k0, k1):
            if rescale[ic]:
                acc = (acc.float() * ms[..., ic:ic + 1]).half()
            acc = (acc.float() + pv[..., ic - k0, :]).half()
    total = (vs * torch.exp(big_m - big_m[..., -1:]).nan_to_num(0.0)).sum(-1, keepdim=True)
    # VKQ is relative to the final maximum already (every rescale applied): S likewise
    vkq = acc.float()
    if sinks is not None:  # after the last key, on the float32 copy of VKQ (module docstring)
        sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, tq, 1).reshape(b, hkv, g * tq, 1)
        last = big_m[..., -1:]
        above = sink > last
        ms = torch.where(above, torch.exp(last - sink), torch.ones_like(sink))
        vkq = vkq * ms
        total = total * ms + torch.where(above, torch.ones_like(sink), torch.exp(sink - last))
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = torch.where(total > 0, vkq / safe, torch.zeros_like(safe))
    return out.reshape(b, hq, tq, d)


def _softmax_v(scores: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
               p_type: str | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float32 softmax over visible keys (and the heads' ``sinks`` ``[Hq]``, no value) times V
    (GQA broadcast); ``p_type`` ``"f16"`` rounds the probabilities to fp16 first (the non-flash
    ``mul_mat(v, kq)`` with an f16 V)."""
    b, hq, tq, n = scores.shape
    hkv = v.shape[1]
    s = scores.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    sink = None if sinks is None else sinks.float().view(1, hq, 1, 1)
    m = (m if sink is None else torch.maximum(m, sink)).nan_to_num(neginf=0.0)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True) + (0.0 if sink is None else torch.exp(sink - m))
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    if p_type == "f16":
        p = p.half().float()
    out = p.reshape(b, hkv, -1, n) @ v.float()
    return out.reshape(b, hq, tq, -1)


def _scaled(raw: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Raw scores times ``scale``, soft-capped as ggml does it (module docstring)."""
    if not softcap:
        return raw * scale
    folded = torch.tensor(scale, dtype=torch.float32) / torch.tensor(softcap, dtype=torch.float32)
    return torch.tanh(raw * folded.to(raw.device)) * softcap


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
           scale: float, key_type: str, value_type: str, *, k_min: torch.Tensor | None = None,
           flash_attention: bool = True, softcap: float = 0.0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """llama.cpp's CPU attention output ``[B, Hq, Tq, D]`` float32 (module docstring).

    q: in K's stored basis; k, v: the cache as read back ``[B, Hkv, N, D]``; visible: bool
    broadcastable to ``[B, Hq, Tq, N]``; key_type / value_type: the ``-ctk/-ctv`` names; k_min: a
    ``_1`` key type's block minima (``key_scores``); softcap: 0 = none; sinks: ``[Hq]`` or None."""
    tq = q.shape[2]
    if flash_attention:
        kt, vt = fa_read_type(key_type), fa_read_type(value_type)
        k = k.half().float() if kt != key_type else k
        v = v.half().float() if vt != value_type else v
        if fa_path(kt, vt, tq) == "tiled":
            raw = key_scores(q.float(), None, k, None)
            return _softmax_v(_scaled(raw, scale, softcap), v, visible, sinks=sinks)
    else:
        kt, vt = key_type, value_type
    qv, qs = query_to_vec_dot(q, kt)
    scores = _scaled(key_scores(qv, qs, k, k_min), scale, softcap)
    if flash_attention and vt == "f16":
        return accumulate_f16(scores, v, visible, sinks=sinks)
    return _softmax_v(scores, v, visible, "f16" if not flash_attention and vt == "f16" else None,
                      sinks)
