"""What ``recommend`` returns: a ``Choice`` per layer and tensor, and the ``Recommendation``
(the config, the choices, bytes and decode costs, notes), each with the ``to_dict`` that
``--json`` and the report read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvlens.recommend.options import Candidate
from kvlens.recommend.profile import Profile


@dataclass
class Choice:
    """The candidate chosen for one tensor of one layer, its bits and measured errors."""

    layer: int
    tensor: str
    candidate: Candidate
    bits: float
    output_error: float
    score_error: float | None
    reconstruction_error: float
    runner_up: str = ""  # the cheapest candidate with lower error, if the budget ruled it out
    flush_tokens: int = 0  # the layer's flush block (0 = the whole window)
    residual_tokens: int = 0  # the layer's full-precision window

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidate"] = asdict(self.candidate) | {"label": self.candidate.label}
        return d


@dataclass
class Recommendation:
    """A recommended config with what it was chosen from and what it costs."""

    config: Any  # kvlens.config.KVConfig
    choices: list[Choice]
    budget_bits: float
    mean_bits: float
    expected_output_error: float  # mean over layers of (e_K + e_V) / 2
    context: int
    weights: tuple[float, ...] = ()  # per-layer sensitivity weights used by the allocation
    kv_bytes: dict[int, float] = field(default_factory=dict)  # context -> bytes
    kv_bytes_fp16: dict[int, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    residual_tokens: int = 0  # the config default's window (layers may differ: choices)
    sink_tokens: int = 0
    windows: tuple[int, ...] = ()  # the window sizes offered
    # [(config name, kvlens.cache.decode_cost.DecodeCost)]: the recommendation, then presets
    decode_cost: list = field(default_factory=list)
    profile: Profile = field(default_factory=Profile)  # wall seconds per stage
    # each measured stage's predicted seconds (kvlens.recommend.profile.expect); None: the
    # measurement was read back from an earlier run (kvlens.recommend.reuse)
    predicted: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bits": self.budget_bits, "mean_bits": self.mean_bits,
                "expected_output_error": self.expected_output_error, "context": self.context,
                "residual_tokens": self.residual_tokens, "sink_tokens": self.sink_tokens,
                "windows": list(self.windows),
                "layer_weights": list(self.weights), "kv_bytes": self.kv_bytes, "kv_bytes_fp16": self.kv_bytes_fp16,
                "choices": [c.to_dict() for c in self.choices], "notes": self.notes,
                "decode_cost": [{"config": n, **c.to_dict()} for n, c in self.decode_cost],
                "profile": {**self.profile.to_dict(), "predicted": self.predicted},
                "config": self.config.to_dict()}
