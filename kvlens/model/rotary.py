"""How an attention module applies RoPE, found by running the model's own rotary function.

transformers hands each attention module its RoPE in several forms (``kvlens.rope.RopeForm``),
and the tables alone do not say how the model pairs channels (GLM applies ``cat(f, f)`` tables
interleaved). So kvlens runs the function the module applies on a seeded random probe with the
layer's own tables and keeps the form whose kvlens application reproduces it
(``kvlens.rope.matching_form``), once per distinct kind of tables. A model no form reproduces,
or whose function cannot be found or called, raises ``ModelLoadError``: kvlens does not guess.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch

from kvlens.errors import ModelLoadError
from kvlens.rope import FORMS, RopeForm, RopeTables, matching_form

#: the names transformers gives the function an attention module applies RoPE with
ROTARY_FUNCTION_NAMES = ("apply_rotary_pos_emb", "apply_rotary_emb", "_apply_rotary_emb")
# the second tensor argument of a function that rotates queries and keys together
_KEY_ARGUMENTS = ("k", "xk", "key", "key_states", "k_embed")
# errors a rotary function raises when called with a convention it does not use (shapes that
# do not broadcast, a missing argument): that convention is not the model's, try the next one
_CALL_ERRORS = (RuntimeError, TypeError, ValueError, IndexError)
# attributes by which an attention module says it rotates only its first channels: Phi's
# forward slices them (``rotary_ndims``); an MLA layer's rotary channels come first in the
# latent rows kvlens' attention function receives (``qk_rope_head_dim``, kvlens.model.mla)
_ROTARY_WIDTHS = ("rotary_ndims", "qk_rope_head_dim")
_PROBE_POSITIONS = 37  # at most this many of the layer's positions, spread over all of them


def rotary_function(module) -> Callable | None:
    """The function ``module`` (an attention module) applies RoPE with, or ``None`` (DeepSeek's
    ``apply_rotary_pos_emb_interleave`` where its config sets ``rope_interleave``)."""
    source = sys.modules.get(type(module).__module__)
    names = ROTARY_FUNCTION_NAMES
    if getattr(getattr(module, "config", None), "rope_interleave", False):
        names = ("apply_rotary_pos_emb_interleave", *names)
    for name in names:
        fn = getattr(source, name, None)
        if callable(fn):
            return fn
    return None


def applies_rope(module) -> bool:
    """False for a layer the model runs without RoPE although it passes it the tables: Llama 4's
    and SmolLM3's NoPE layers (``use_rope``), Cohere2's full-attention layers."""
    if not getattr(module, "use_rope", True):
        return False
    config = getattr(module, "config", None)
    if getattr(config, "model_type", "") == "cohere2":
        return getattr(module, "sliding_window", None) is not None
    return True


class RopeInputs(dict):
    """Layer index -> ``(cos, sin, position_ids)`` of its attention module's latest call (a complex
    ``freqs_cis`` as ``(freqs_cis, None, position_ids)``; ``position_ids`` ``None`` where the model
    does not pass it); ``tables`` normalises a call's RoPE, each kind of tables checked once."""

    def __init__(self):
        super().__init__()
        self.modules: dict[int, object] = {}  # layer index -> its attention module
        self._forms: dict[tuple, RopeForm] = {}
        self.forms: list[RopeForm] = []  # the forms found so far, in order

    def record(self, module, pe, position_ids) -> None:
        """Keep ``pe`` where it has a shape kvlens reads: ``(cos, sin)`` or one complex tensor."""
        if isinstance(pe, torch.Tensor) and pe.is_complex():
            self[module.layer_idx] = (pe, None, position_ids)
        elif isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(t, torch.Tensor)
                                                            for t in pe):
            self[module.layer_idx] = (*pe, position_ids)
        else:
            return
        self.modules[module.layer_idx] = module

    def tables(self, layer: int, head_dim: int) -> RopeTables | None:
        """The layer's latest RoPE as ``RopeTables`` (``None``: it applies none); ``ModelLoadError``
        when no known form reproduces the model's."""
        cos, sin, _ = self[layer]
        pe = cos if sin is None else (cos, sin)
        module = self.modules[layer]
        if not applies_rope(module):
            return None
        fn = rotary_function(module)
        if fn is None:
            raise _unsupported(module, f"its module {type(module).__module__} has none of "
                                       f"{', '.join(ROTARY_FUNCTION_NAMES)}")
        key = (type(module), fn, sin is None, int(cos.shape[-1]), cos.dtype, head_dim)
        form = self._forms.get(key)
        if form is None or not form.accepts(pe):
            form = self._forms[key] = find_form(module, fn, pe, head_dim)
            if form not in self.forms:
                self.forms.append(form)
        return form.normalise(pe)


def find_form(module, fn: Callable, pe, head_dim: int) -> RopeForm:
    """The form of ``pe`` that reproduces ``fn`` (the module's rotary function) on a probe, else
    ``ModelLoadError``: a probe over whole heads, then over the rotary channels alone where the
    module declares them (``_ROTARY_WIDTHS``: Phi's forward slices them before the call)."""
    first = pe if isinstance(pe, torch.Tensor) else pe[0]
    if first.dim() != 3:
        raise _unsupported(module, f"its position_embeddings have shape {tuple(first.shape)}, "
                                   "not [batch, tokens, width]")
    probe_pe = _probe_tables(pe)
    b, t = (probe_pe if isinstance(probe_pe, torch.Tensor) else probe_pe[0]).shape[:2]
    g = torch.Generator().manual_seed(0)
    heads = 3 if t != 3 else 5  # heads != positions, so a transposed call cannot broadcast
    probes = tuple(torch.randn(b, heads, t, head_dim, generator=g, dtype=torch.float64)
                   for _ in range(2))
    widths = [head_dim]
    for attr in _ROTARY_WIDTHS:
        declared = getattr(module, attr, None)
        if isinstance(declared, int) and 0 < declared < head_dim:
            widths.append(declared)
            break
    failed, ran = "", False
    for width in widths:
        x = tuple(p[..., :width] for p in probes)
        for transposed in (False, True):
            try:
                out = _call(fn, probe_pe, x, transposed)
            except _CALL_ERRORS as exc:  # not this convention; the next may be the model's
                failed = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
                continue
            ran = True
            form = matching_form(probe_pe, x[:len(out)], out)
            if form is not None:
                return form
    problem = (f"none of the RoPE forms kvlens knows ({'; '.join(f.name for f in FORMS)}) "
               "reproduces it" if ran else f"calling it on a probe failed ({failed})")
    raise _unsupported(module, f"its rotary function {fn.__name__}: {problem}")


def _probe_tables(pe):
    """``pe`` at a few of its positions, in float64 (complex128) on the CPU: the model's own
    values, compared without float32 rounding."""
    first = pe if isinstance(pe, torch.Tensor) else pe[0]
    t = int(first.shape[1])
    idx = torch.linspace(0, t - 1, min(t, _PROBE_POSITIONS)).round().long().unique()

    def take(x):
        x = x.detach().cpu().index_select(1, idx)
        return x.to(torch.complex128 if x.is_complex() else torch.float64)

    return take(pe) if isinstance(pe, torch.Tensor) else (take(pe[0]), take(pe[1]))


def _call(fn: Callable, pe, probes: tuple[torch.Tensor, ...], transposed: bool
          ) -> tuple[torch.Tensor, ...]:
    """``fn`` on the probes ``[B, H, T, W]`` (passed as ``[B, T, H, W]`` when ``transposed``,
    as Llama 4 and Gemma 3n call theirs), its outputs back as ``[B, H, T, W]``."""
    params = inspect.signature(fn).parameters
    names = list(params)
    pair = len(names) > 1 and names[1] in _KEY_ARGUMENTS
    tensors = tuple(p.transpose(1, 2) for p in probes) if transposed else probes
    tensors = tensors if pair else tensors[:1]
    kwargs = {"unsqueeze_dim": 2} if transposed and "unsqueeze_dim" in params else {}
    if isinstance(pe, torch.Tensor):
        out = fn(*tensors, pe, **kwargs)
    elif "cos" in params and "sin" in params:
        out = fn(*tensors, cos=pe[0], sin=pe[1], **kwargs)
    else:
        out = fn(*tensors, *pe, **kwargs)
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) != len(tensors) or not all(isinstance(o, torch.Tensor) for o in out):
        raise TypeError(f"returned {len(out)} values for {len(tensors)} tensors")
    return tuple(o.transpose(1, 2) for o in out) if transposed else out


def _unsupported(module, what: str) -> ModelLoadError:
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", "") or type(module).__name__
    return ModelLoadError(
        f"Unsupported RoPE in model type {model_type!r} ({type(module).__name__}, layer "
        f"{getattr(module, 'layer_idx', '?')}): {what}; kvlens cannot recover its pre-RoPE "
        "tensors exactly.")
