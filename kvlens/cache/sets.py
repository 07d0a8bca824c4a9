"""The kept set: which held tokens of a layer keep a copy beside their codes (an extension point).

A compressed global layer may keep, per KV head, a few of its quantized tokens as rows
(``SetRows``) read at attention instead of their hidden codes; a ``SetPolicy`` says which and
how. The stable policy is ``Sinks`` (the first ``sink_tokens`` positions at ``fp_dtype``);
another comes from ``ProtectSettings.importance`` (``kvlens.config.extension``), whose
``policy(sink_tokens)`` returns a ``SetPolicy`` (``kvlens.research`` registers one).
"""

from __future__ import annotations

from typing import Any

import torch


def _gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, h, idx[b, h, k]]``; float8 rows are gathered as their bytes (torch has no CPU
    gather for float8)."""
    index = idx[..., None].expand(*idx.shape, t.shape[-1])
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).gather(2, index).view(t.dtype)
    return t.gather(2, index)


class SetRows:
    """One tensor (keys or values) of a layer's set: rows ``[B, H, K, D]`` at ``dtype`` (``None``:
    the model's); a policy's subclass may store them otherwise (``encode``, ``read``, ``bits``)."""

    bits: int | None = None

    def __init__(self, dtype: torch.dtype | None, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.parts: tuple[torch.Tensor, ...] = ()  # the stored form, each [B, H, K, *]

    @property
    def empty(self) -> bool:
        return not self.parts

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """New rows ``x`` ``[B, H, n, D]`` in the stored form."""
        return (x.to(self.dtype or x.dtype),)

    def read(self) -> torch.Tensor:
        """float32 ``[B, H, K, D]`` (a transient for attention)."""
        return self.parts[0].float()

    def choose(self, candidates: tuple[torch.Tensor, ...], idx: torch.Tensor) -> None:
        """Keep rows ``idx`` ``[B, H, K]`` of ``candidates`` (stored form, ``[B, H, C, *]``)."""
        self.parts = tuple(_gather_rows(t, idx) for t in candidates)

    def candidates(self, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The current rows followed by ``new`` ``[B, H, n, D]``, stored form."""
        enc = self.encode(new)
        if self.empty:
            return enc
        return tuple(torch.cat((a, b.to(a.dtype)), dim=2) for a, b in zip(self.parts, enc))

    def select_batch(self, index: torch.Tensor) -> None:
        self.parts = tuple(t[index] for t in self.parts)


class SetPolicy:
    """Which held tokens a layer keeps in its set, and how: one object per cache layer (it may
    hold per-layer state; ``kvlens.cache.layout`` builds a fresh one to count bytes). A policy
    subclasses it and says ``empty``, ``size`` and ``choose``; the rest defaults to a set
    chosen by position, its rows at ``fp_dtype``, with no other state (``Sinks``)."""

    #: the set's tokens are hidden in the packed store by a mask (else: the packed prefix)
    masked = False
    #: the policy reads the attention mass every held token receives (``observe``)
    needs_attention_probs = False
    #: why the fused decode kernel cannot serve a layer with this set (``None``: it can)
    kernel_problem: str | None = None
    #: ``[B, Hkv, q_end]`` bool: the packed positions the set hides (``masked`` only)
    mask: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        """The set never holds a token (the layer keeps none)."""

    def size(self, q_start: int, q_end: int) -> int:
        """Tokens in the set after ``q_end`` tokens were quantized, those before ``q_start``
        evicted."""

    def choose(self, cand_pos: torch.Tensor, keep: int, end: int) -> torch.Tensor:
        """Indices ``[B, Hkv, keep]`` of the candidates (positions ``cand_pos`` ``[B, Hkv, C]``:
        the current set, then the block just flushed, ending at ``end``) that stay."""

    def new_rows(self, dtype: torch.dtype | None, head_dim: int) -> SetRows:
        """Empty rows of one tensor (``dtype``: the config's ``fp_dtype``)."""
        return SetRows(dtype, head_dim)

    def row_bytes(self, head_dim: int, fp_bytes: int) -> int:
        """Bytes one set token of one tensor holds."""
        return head_dim * fp_bytes

    def observe(self, colsum: torch.Tensor) -> None:
        """The attention mass ``[B, Hkv, N]`` each held position received in one step."""

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(part, tensor)`` of the state it keeps besides the rows."""
        return []

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` of its state."""

    def state_bytes(self, rows: int, q_held: int, held: int) -> dict[str, int]:
        """Bytes of that state by part, with ``rows`` (batch x KV heads), ``q_held`` packed
        tokens and ``held`` tokens in all."""
        return {}


class Sinks(SetPolicy):
    """The stable policy: the first ``sink_tokens`` positions while they are held, at
    ``fp_dtype``, chosen by position (no attention needed): the packed prefix."""

    def __init__(self, sink_tokens: int):
        self.sink_tokens = sink_tokens

    @property
    def empty(self) -> bool:
        return self.sink_tokens == 0

    def size(self, q_start: int, q_end: int) -> int:
        return sinks_held(self.sink_tokens, q_start, q_end)

    def choose(self, cand_pos: torch.Tensor, keep: int, end: int) -> torch.Tensor:
        return first_positions(cand_pos, keep)


def sinks_held(sink_tokens: int, q_start: int, q_end: int) -> int:
    """The sink tokens among the quantized positions ``[q_start, q_end)``."""
    return max(0, min(sink_tokens, q_end) - q_start)


def first_positions(cand_pos: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the ``keep`` smallest positions of ``cand_pos``, in position order."""
    return (-cand_pos.float()).topk(keep, dim=-1).indices.sort(-1).values


def set_policy(settings: Any) -> SetPolicy | None:
    """The policy of a layer's set settings (a ``kvlens.config.ProtectSettings`` as
    ``KVConfig.protect_for`` gives it; ``None``: no set): its ``importance`` extension's, else
    the sinks; ``None`` when the set would never hold a token."""
    if settings is None:
        return None
    ext = settings.importance
    policy = Sinks(settings.sink_tokens) if ext is None else ext.policy(settings.sink_tokens)
    return None if policy.empty else policy
