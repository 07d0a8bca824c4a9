"""Rotary position embeddings: apply and invert with the exact (cos, sin) a layer used.

Tensors are ``[B, H, T, D]``; ``cos``/``sin`` are ``[B, T, R]`` with ``R <= D`` (partial rotary
when ``R < D``: only the first ``R`` channels rotate). Two channel layouts (``LAYOUTS``):
``half`` (channel ``i`` pairs with ``i + R/2``) and ``interleaved`` (``2i`` with ``2i + 1``).
``(layout, cos, sin)`` is kvlens' one normalised form of a layer's RoPE (``RopeTables``).

Models hand RoPE to their attention in other forms too; a ``RopeForm`` (``FORMS``) names one by
how its tables hold the per-pair angles (``TABLE_KINDS``) and which channels it pairs, and
normalises it: half tables applied half (most models) or interleaved (GLM), interleaved tables
(Cohere), compact (gpt-oss), complex (Llama 4), and half tables applied to de-interleaved input
(DeepSeek V3's ``apply_rotary_pos_emb_interleave``, whose pre-RoPE tensor is the de-interleaved
one, ``deinterleave``). A layer's form is never guessed from its tables: ``kvlens.model.rotary``
keeps the one that reproduces the model's own rotary function (``matching_form``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("half", "interleaved")
#: how ``position_embeddings`` hold the per-pair angles: ``cat(f, f)``, ``repeat_interleave(f,
#: 2)``, one column per pair, or one complex tensor ``cos + i sin`` per pair
TABLE_KINDS = ("half", "interleaved", "compact", "complex")
#: a form reproduces a model's rotary function when the largest difference on the probe is at
#: most this times the largest output (float32 rounding stays far below; a wrong form misses by
#: order one)
PROBE_TOLERANCE = 1e-5


def rotate(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The 90-degree partner rotation that RoPE mixes in with ``sin``."""
    if layout == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def partner_channel(c: int, rotary_dim: int, layout: str = "half") -> int | None:
    """The channel RoPE pairs with ``c`` (None for channels outside the rotary part)."""
    if c >= rotary_dim:
        return None
    if layout == "half":
        half = rotary_dim // 2
        return c + half if c < half else c - half
    return c + 1 if c % 2 == 0 else c - 1


def _split(x: torch.Tensor, r: int):
    return x[..., :r], x[..., r:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half"):
    """``x * cos + rotate(x) * sin`` on the rotary part, in float64, cast back to x's dtype."""
    cos, sin = cos.unsqueeze(1).double(), sin.unsqueeze(1).double()
    rot, rest = _split(x.double(), cos.shape[-1])
    out = rot * cos + rotate(rot, layout) * sin
    return torch.cat((out, rest), dim=-1).to(x.dtype)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half"):
    """Exact inverse of ``apply_rope`` (also for scaled tables such as YaRN: divide by
    ``cos^2 + sin^2``); computed in float64."""
    cos, sin = cos.unsqueeze(1).double(), sin.unsqueeze(1).double()
    rot, rest = _split(x.double(), cos.shape[-1])
    norm = cos * cos + sin * sin
    out = (rot * cos - rotate(rot, layout) * sin) / norm
    return torch.cat((out, rest), dim=-1).to(x.dtype)


class RopeFrequencies:
    """A layer's RoPE re-created from positions, as a fused kernel would: ``angle = position *
    inv_freq`` (float32, as transformers computes it), ``cos/sin * scaling``, laid out ``half`` or
    ``interleaved``; matched against the tables a layer was called with (``reproduces``), so the
    cache stores positions (int32) instead of tables."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, layout: str):
        self.inv_freq = inv_freq.detach()  # the model's own buffer (not a copy)
        self.scaling = float(scaling)
        self.layout = layout

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` float32 ``[B, T, R]`` for integer ``positions`` ``[B, T]``."""
        freqs = positions.float()[..., None] * self.inv_freq.float().to(positions.device)
        emb = torch.cat((freqs, freqs), -1) if self.layout == "half" else \
            freqs.repeat_interleave(2, dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def reproduces(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> bool:
        """Do these frequencies give the tables ``cos, sin`` ``[B, T, R]`` (up to their dtype's
        rounding) at ``positions``?"""
        if cos.shape[-1] != 2 * self.inv_freq.numel():
            return False
        c, s = self.tables(positions)
        tol = 4 * torch.finfo(cos.dtype).eps * max(1.0, abs(self.scaling))
        return bool(((c - cos.float()).abs().max() <= tol) and
                    ((s - sin.float()).abs().max() <= tol))

    @classmethod
    def all_matching(cls, candidates) -> list[RopeFrequencies]:
        """Every ``(inv_freq, scaling)`` candidate in both layouts, to be narrowed down with
        ``reproduces`` as tables are seen."""
        return [cls(inv_freq, scaling, layout) for inv_freq, scaling in candidates
                for layout in LAYOUTS]


@dataclass(frozen=True, eq=False)
class RopeTables:
    """A layer's RoPE in kvlens' normalised form: ``cos``, ``sin`` ``[B, T, R]`` for the first
    ``R`` channels of each head, paired as ``layout``."""

    layout: str
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def rotary_dim(self) -> int:
        return int(self.cos.shape[-1])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE on ``x`` ``[B, H, T, D]`` (``apply_rope``)."""
        return apply_rope(x, self.cos, self.sin, self.layout)

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor RoPE was applied to, from ``x`` ``[B, H, T, D]`` (``invert_rope``)."""
        return invert_rope(x, self.cos, self.sin, self.layout)


@dataclass(frozen=True)
class RopeForm:
    """One way a model gives RoPE to its attention: how ``position_embeddings`` (``(cos, sin)``
    ``[B, T, W]``, or one complex ``[B, T, R/2]``) hold the per-pair angles (``tables``,
    ``TABLE_KINDS``) and which channels it pairs (``layout``, ``LAYOUTS``)."""

    tables: str
    layout: str
    #: the model de-interleaves its input's rotary channels before rotating (module docstring)
    deinterleaves_input: bool = False

    @property
    def name(self) -> str:
        return f"{self.tables} tables, {self.layout} pairs" + (
            " of de-interleaved input" if self.deinterleaves_input else "")

    def accepts(self, pe) -> bool:
        """Whether ``pe`` has this form's shape (duplicated tables repeat exactly)."""
        if self.tables == "complex":
            return isinstance(pe, torch.Tensor) and pe.is_complex()
        if not (isinstance(pe, tuple) and len(pe) == 2  # a real (cos, sin) pair
                and all(isinstance(t, torch.Tensor) and not t.is_complex() for t in pe)
                and pe[0].shape == pe[1].shape and pe[0].dim() >= 1):
            return False
        width = pe[0].shape[-1]
        if self.tables == "compact":
            return True
        if width % 2:
            return False
        if self.tables == "half":
            return all(torch.equal(t[..., : width // 2], t[..., width // 2:]) for t in pe)
        return all(torch.equal(t[..., 0::2], t[..., 1::2]) for t in pe)

    def rotary_dim(self, pe) -> int:
        """``R``: the channels ``pe`` rotates in this form."""
        width = int((pe if self.tables == "complex" else pe[0]).shape[-1])
        return 2 * width if self.tables in ("compact", "complex") else width

    def pairs(self, pe) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair ``(cos, sin)`` ``[B, T, R/2]``."""
        if self.tables == "complex":
            return pe.real, pe.imag
        cos, sin = pe
        if self.tables == "half":
            half = cos.shape[-1] // 2
            return cos[..., :half], sin[..., :half]
        if self.tables == "interleaved":
            return cos[..., 0::2], sin[..., 0::2]
        return cos, sin

    def normalise(self, pe) -> RopeTables:
        """``pe`` as ``RopeTables`` (``cat(f, f)`` for half pairs, ``repeat_interleave`` for
        interleaved ones), in the dtype of its tables."""
        cos, sin = self.pairs(pe)
        if self.layout == "half":
            return RopeTables("half", torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
        return RopeTables("interleaved", cos.repeat_interleave(2, -1),
                          sin.repeat_interleave(2, -1))


FORMS = (RopeForm("half", "half"), RopeForm("interleaved", "interleaved"),
         RopeForm("compact", "half"), RopeForm("half", "interleaved"),
         RopeForm("complex", "interleaved"), RopeForm("half", "half", deinterleaves_input=True))


def deinterleave(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``x`` ``[..., D]`` with its first ``rotary_dim`` channels reordered from interleaved
    pairs ``(2i, 2i+1)`` to half pairs ``(i, i + R/2)``: evens first, then odds."""
    rot, rest = _split(x, rotary_dim)
    return torch.cat((rot[..., 0::2], rot[..., 1::2], rest), dim=-1)


def matching_form(pe, probes: tuple[torch.Tensor, ...], model_out: tuple[torch.Tensor, ...]
                  ) -> RopeForm | None:
    """The first of ``FORMS`` whose normalised tables, applied by ``apply_rope`` to each probe
    ``[B, H, T, W]``, give ``model_out`` within ``PROBE_TOLERANCE`` (``None``: none does); a form
    rotating more than ``W`` channels is skipped."""
    width = probes[0].shape[-1]
    for form in FORMS:
        if not form.accepts(pe) or form.rotary_dim(pe) > width:
            continue
        tables = form.normalise(pe)
        r = tables.rotary_dim
        inputs = [deinterleave(p, r) if form.deinterleaves_input else p for p in probes]
        if all(_close(tables.apply(p.double()), o) for p, o in zip(inputs, model_out)):
            return form
    return None


def _close(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    if theirs.shape != mine.shape:
        return False
    diff = (mine - theirs.double()).abs().max()
    return bool(diff <= PROBE_TOLERANCE * max(1.0, float(mine.abs().max())))
