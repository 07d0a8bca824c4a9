"""The attention function the compressed cache installs in the model (``make_attention_fn``).

Each call takes one path: the model's own attention when no kvlens cache is in the forward (or
nothing is quantized yet, or an engine-format layer without engine arithmetic), an engine
layer's own arithmetic (``EngineLayer.attend``, ``KVConfig.engine_attention``), the Triton
decode kernel (``kvlens.cache.triton_glue``) when the backend is triton and it can serve the
call, else the torch read path (``kvlens.cache.torch_read``); under the triton backend each
torch-path call is counted with its reason (``CompressionSession.backend_reason``). Soft-capping
(Gemma 2's ``softcap``) and attention sinks (gpt-oss's ``s_aux``, else the module's ``sinks``)
reach every path; the kernel reads neither, so such calls take the torch path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlens.cache.engine import EngineLayer
from kvlens.cache.layer import LAYER_ATTR, held_columns
from kvlens.cache.torch_read import packed_attention
from kvlens.cache.triton_glue import triton_decode, triton_unsupported
from kvlens.errors import BackendError, ConfigError


def _attention_sinks(module, kwargs: dict):
    """The learned attention-sink logits ``[Hq]`` of this call (gpt-oss passes them as
    ``s_aux``; a model that keeps them on the module as ``sinks`` without passing them is read
    there), or ``None``."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def _note_torch(layer, reason: str, backend: str) -> None:
    """Under the triton backend, count a call that took the torch path, with its reason."""
    note = getattr(layer.session, "note_torch_path", None)
    if backend == "triton" and note is not None:
        note(reason)


def make_attention_fn(backend: str = "torch") -> Callable[[Callable], Callable]:
    """Factory for ``kvlens.model.hooks.attention_override``: wraps the model's own attention.

    ``backend`` is what ``select_backend`` returned (``torch`` or ``triton``)."""
    if backend not in ("torch", "triton"):
        raise BackendError(f"Unknown resolved backend {backend!r}; allowed: torch, triton "
                           "(resolve 'auto' with select_backend first).")
    use_triton = backend == "triton"

    def factory(original: Callable) -> Callable:
        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
            layer = getattr(key, LAYER_ATTR, None)
            if layer is None:  # no compressed cache in this forward: the model's own path
                return original(module, query, key, value, attention_mask, scaling=scaling,
                                dropout=dropout, **kwargs)
            layer.claim_attention()
            if attention_mask is not None and attention_mask.dim() == 4 and \
                    attention_mask.shape[1] > 1:
                raise ConfigError(f"layer {layer.layer_idx}: the model masks each attention "
                                  "head differently (a dynamic, per-head mask), which kvlens' "
                                  "cache attention does not model.")
            if isinstance(layer, EngineLayer) and layer.engine_attention is None:
                # the model's own attention over the K/V the engine layer read back; the mask
                # covers positions from 0 (HistoryLayer), the returned K/V from read_start.
                # An untagged key: ``original`` may be another session's kvlens attention
                # (nested sessions), which must not trim the mask again.
                return original(module, query, key.view_as(key),
                                value, layer.returned_mask(attention_mask),
                                scaling=scaling, dropout=dropout, **kwargs)
            scaling = module.scaling if scaling is None else scaling
            softcap = float(kwargs.get("softcap") or 0.0)
            sinks = _attention_sinks(module, kwargs)
            if isinstance(layer, EngineLayer):  # an engine's own attention arithmetic
                _note_torch(layer, "engine attention arithmetic", backend)
                return layer.attend(query, attention_mask, scaling, softcap=softcap,
                                    sinks=sinks).contiguous(), None
            # rotated keys: every stored key is k R, so the query is rotated once (q R)(k R)^T
            query = layer.to_stored_basis(query, layer.setting.rotate_keys)
            probs = layer.needs_attention_probs
            out = colsum = None
            if layer.quantized_length == 0 and not layer.has_hp and not probs:
                # Nothing compressed yet: exact attention with the model's own function.
                _note_torch(layer, "nothing quantized yet (model's own attention)", backend)
                k = layer.res_k.view().to(query.dtype).contiguous()
                v = layer.res_v.view().to(query.dtype).contiguous()
                # a sliding layer dropped [0, res_start)
                attention_mask = held_columns(attention_mask, layer.res_start)
                out, _ = original(module, query, k, v, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)
            else:
                if use_triton:
                    why = triton_unsupported(layer, query, probs, softcap=softcap, sinks=sinks)
                    if why is None:
                        out, why = triton_decode(query, layer, attention_mask, scaling)
                    if why is not None:
                        _note_torch(layer, why, backend)
                if out is None:
                    out, colsum = packed_attention(query, layer, attention_mask, scaling,
                                                   with_probs=probs, softcap=softcap, sinks=sinks)
            layer.commit(query, colsum)
            # contiguous as transformers' own attention functions return it (some models view
            # the output without reshaping)
            return layer.from_stored_basis(out).contiguous(), None

        return attention

    return factory
