"""What a ``compare-axes`` sweep returns: one ``Record`` per (layer, head, variant, metric) and
the ``CompareResult`` holding them with their summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Record:
    """One relative error: ``head`` is a KV head for ``reconstruction`` and a query head for
    the attention metrics (``head_kind`` says which). ``stage`` is None for values.

    ``format`` is None for the integer specs; for an engine format it is the format's name and
    ``axis`` says what shares a scale (``per-token`` for ggml blocks and per-token-head,
    ``per-layer`` / ``per-head`` for static fp8), ``bits`` is the code width and
    ``group_size`` the channels sharing a scale (0 for static scales)."""

    layer: int
    head: int
    tensor: str
    axis: str
    bits: int
    group_size: int
    stage: str | None
    variant: str
    metric: str
    rel_error: float
    head_kind: str
    format: str | None = None


@dataclass(frozen=True)
class CompareResult:
    records: list[Record]
    summary: dict[str, Any]  # with the sweep's config, as CompareConfig.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {"records": [asdict(r) for r in self.records], "summary": self.summary}


def format_axis(fmt) -> str:
    """What shares one scale in an engine format, as a ``Record.axis``."""
    if fmt.family == "fp8":
        return "per-layer" if fmt.scope == "tensor" else "per-head"
    return "per-token"


def format_group_size(fmt, head_dim: int) -> int:
    """Channels of one token sharing a scale (0: a static scale shared over tokens)."""
    if fmt.family == "ggml":
        return fmt.block_size
    return head_dim if fmt.family == "token-head" else 0
