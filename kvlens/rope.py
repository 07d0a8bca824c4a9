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
