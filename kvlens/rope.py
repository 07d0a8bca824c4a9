"""Rotary position embeddings: apply and invert with the exact (cos, sin) a layer used.

Tensors are ``[B, H, T, D]``; ``cos``/``sin`` are ``[B, T, R]`` with ``R <= D`` (partial rotary
when ``R < D``: only the first ``R`` channels rotate). Two channel layouts exist:
- ``"half"`` (HF default, also GGUF Llama weights as loaded by HF): channel ``i`` pairs with
  ``i + R/2``;
- ``"interleaved"``: channel ``2i`` pairs with ``2i + 1``.
"""

from __future__ import annotations

import torch

LAYOUTS = ("half", "interleaved")


def detect_layout(cos: torch.Tensor) -> str:
    """Infer the pairing from the cos table: "half" when both halves repeat each other."""
    r = cos.shape[-1]
    if torch.equal(cos[..., : r // 2], cos[..., r // 2:]):
        return "half"
    if torch.equal(cos[..., 0::2], cos[..., 1::2]):
        return "interleaved"
    raise ValueError("Unrecognised RoPE cos layout (neither rotate-half nor interleaved).")


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
    inv_freq`` (float32, as transformers computes it), ``cos/sin * scaling``, laid out
    ``half`` (``cat(f, f)``) or ``interleaved``. Found by matching the tables a layer was
    called with (``match``), so the cache stores positions (int32) instead of tables."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, layout: str):
        self.inv_freq = inv_freq.detach()  # the model's own buffer (not a copy)
        self.scaling = float(scaling)
        self.layout = layout

    def tables(self, positions: torch.Tensor, dtype=torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, T, R]`` for integer ``positions`` ``[B, T]``."""
        freqs = positions.float()[..., None] * self.inv_freq.float().to(positions.device)
        emb = torch.cat((freqs, freqs), -1) if self.layout == "half" else \
            freqs.repeat_interleave(2, dim=-1)
        return ((emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype))

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
