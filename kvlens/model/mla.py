"""Multi-head latent attention (MLA: DeepSeek V2/V3 and their kin) as engines cache it.

An MLA layer caches, per token, one latent ``c`` (``kv_lora_rank`` channels, after
``kv_a_layernorm``) and one RoPE key ``k_r`` (``qk_rope_head_dim`` channels), shared by every
head; ``kv_b_proj`` (``W_UK``, ``W_UV``) re-expands each head's key and value. Engines (FlashMLA,
vLLM's MLA backends) attend in the *absorbed* form: with ``q_lat[h] = q_nope[h] W_UK[h]``,

    score_t[h] = (q_rot[h] . k_r,t + q_lat[h] . c_t) * scaling
    out[h]     = (sum_t p_t[h] c_t) W_UV[h]^T

which is multi-query attention with one KV head over the latent row ``x_t = [k_r,t ; c_t]``
(rotary channels first) and queries ``[q_rot ; q_lat]``. ``absorbed_mla`` (inside every
``kvlens.model.hooks.attention_override``) runs each MLA module so, with the model's own RoPE
function: attention functions receive the latent rows as ``key`` = ``value`` ``[B, 1, T, dr +
r]`` and a cache stores them, as engines do. It equals the model's own forward up to float
rounding (tested on DeepSeek V2 and V3).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvlens.errors import ModelLoadError
from kvlens.model.rotary import rotary_function

_MLA_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


@dataclass(frozen=True)
class MlaShape:
    """The cached latent of one MLA layer: ``rope_dim`` (``qk_rope_head_dim``) RoPE channels
    then ``latent_dim`` (``kv_lora_rank``) latent channels, per token, for all heads."""

    rope_dim: int
    latent_dim: int
    nope_dim: int
    value_dim: int

    @property
    def row_dim(self) -> int:
        return self.rope_dim + self.latent_dim


def is_mla(module) -> bool:
    """Whether ``module`` is an MLA attention module kvlens knows how to absorb."""
    return all(hasattr(module, p) for p in _MLA_PARTS) and \
        isinstance(getattr(module, "kv_lora_rank", None), int)


def mla_shape(module) -> MlaShape:
    return MlaShape(int(module.qk_rope_head_dim), int(module.kv_lora_rank),
                    int(module.qk_nope_head_dim), int(module.v_head_dim))


def _absorbed_forward(module):
    """A forward for ``module`` in the absorbed form (module docstring), same signature and
    outputs as the model's own, applying RoPE with the model's own function."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rope = rotary_function(module)
    if rope is None:
        raise ModelLoadError(f"Unsupported MLA model {type(module).__name__}: kvlens cannot find "
                             "the rotary function its attention uses.")
    shape = mla_shape(module)
    heads = int(module.num_heads)
    code = sys.modules[type(module).__module__]

    def forward(hidden_states, attention_mask=None, *args, **kwargs):
        # (cos, sin), or a complex freqs_cis (DeepSeek V2)
        pe = kwargs.pop("position_embeddings", None)
        if pe is None and args:
            pe, args = args[0], args[1:]
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        b, t = hidden_states.shape[:-1]
        if module.q_lora_rank is None:
            q = module.q_proj(hidden_states)
        else:
            q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
        q = q.view(b, t, heads, shape.nope_dim + shape.rope_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [shape.nope_dim, shape.rope_dim], dim=-1)
        kv = module.kv_a_proj_with_mqa(hidden_states)
        c, k_rot = torch.split(kv, [shape.latent_dim, shape.rope_dim], dim=-1)
        c = module.kv_a_layernorm(c).view(b, 1, t, shape.latent_dim)
        k_rot = k_rot.view(b, 1, t, shape.rope_dim)
        q_rot, k_rot = rope(q_rot, k_rot, *pe) if isinstance(pe, tuple) else \
            rope(q_rot, k_rot, pe.to(q_rot.device))
        w = module.kv_b_proj.weight.view(heads, shape.nope_dim + shape.value_dim,
                                         shape.latent_dim)
        w_uk, w_uv = w[:, :shape.nope_dim], w[:, shape.nope_dim:]
        q_lat = torch.matmul(q_nope, w_uk.to(q_nope.dtype))  # [B, H, T, r]
        query = torch.cat((q_rot, q_lat), dim=-1)
        row = torch.cat((k_rot.to(c.dtype), c), dim=-1)  # [B, 1, T, dr + r]
        key = value = row
        if cache is not None:
            key, value = cache.update(row, row, module.layer_idx, kwargs=kwargs)
        name = module.config._attn_implementation
        fn = ALL_ATTENTION_FUNCTIONS.get(name) if name != "eager" else None
        fn = fn or code.eager_attention_forward
        out, weights = fn(module, query, key, value, attention_mask, dropout=0.0,
                          scaling=module.scaling, **kwargs)
        lat = out[..., shape.rope_dim:]  # [B, T, H, r]: the latent part of the output
        out = torch.einsum("bthr,hvr->bthv", lat, w_uv.to(lat.dtype))
        return module.o_proj(out.reshape(b, t, heads * shape.value_dim)), weights

    return forward


@contextmanager
def absorbed_mla(model) -> Iterator[list]:
    """Run every MLA attention module of ``model`` in the absorbed form, its
    ``num_key_value_groups`` set to its head count (one latent row serves every head), for the
    duration of the block; yields the patched modules and restores everything on exit."""
    modules = [m for m in model.modules() if is_mla(m)]
    saved = []
    try:
        for m in modules:
            forward = _absorbed_forward(m)
            saved.append((m, m.__dict__.get("forward"), m.num_key_value_groups))
            m.forward = forward
            m.num_key_value_groups = int(m.num_heads)
        yield modules
    finally:
        for m, forward, groups in saved:
            if forward is None:
                del m.forward
            else:
                m.forward = forward
            m.num_key_value_groups = groups
