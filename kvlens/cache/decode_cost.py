"""What one decode step reads from a compressed cache: a documented model of bytes, per layout.

Decode attention is bound by the bytes it reads (docs/kernels.md): per single-token step, what
``kvlens.cache.layout`` says a layer holds, with only the filled part of the window.
``torch_unpack_bytes``: the eager torch path also unpacks each quantized element to float32
once per step (4 bytes, written then read), which the fused kernel never does; ``fused``: every
layer has the kernel's path (``kernel_layout_problem``). A model, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlens.cache import layout
from kvlens.cache.sets import set_policy
from kvlens.cache.triton_glue import kernel_layout_problem


@dataclass(frozen=True)
class DecodeCost:
    """Bytes one decode step reads (all layers, ``batch`` rows) after ``tokens`` tokens."""

    tokens: int
    read_bytes: int
    fp16_bytes: int  # an fp16 K/V cache of the same tokens (what fp16 attention reads)
    torch_unpack_bytes: int  # float32 transient of the eager torch path (see module doc)
    unfused: dict[int, str] = field(default_factory=dict)  # layer -> why no fused kernel

    @property
    def fused(self) -> bool:
        return not self.unfused

    @property
    def ratio_fp16(self) -> float:
        return self.read_bytes / self.fp16_bytes if self.fp16_bytes else 0.0

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "read_bytes": self.read_bytes,
                "fp16_bytes": self.fp16_bytes, "read_vs_fp16": self.ratio_fp16,
                "torch_unpack_bytes": self.torch_unpack_bytes, "fused": self.fused,
                "unfused_layers": {str(k): v for k, v in self.unfused.items()}}


def config_decode_cost(config, shape: layout.ModelShape, tokens: int, batch: int = 1
                       ) -> DecodeCost:
    """``DecodeCost`` of ``config`` on a model of ``shape`` (``kvlens.cache.layout.ModelShape``),
    with the same per-layer rules as ``layout.config_part_bytes``; a store shared by keys and
    values (MLA, ``layout.shares_storage``) is read once."""
    # bytes read per scale (and per zero) are the bytes held: the kernel reads 8-bit metadata
    # as bytes and decodes it in registers (docs/kernels.md)
    read = unpack = 0
    unfused = {}
    for i in shape.attention_layers:
        setting = config.layer(i)
        kw = layout.layer_arguments(config, shape, i, tokens, batch)
        parts = layout.layer_part_bytes(setting, **kw)
        d = shape.head_dim
        one = layout.shares_storage(setting, kw["kv_shared"], d, balancer=kw["balancer"])
        st = layout.stream_state(setting, tokens, kw["sliding_window"])
        rows = batch * kw["kv_heads"]
        parts["window"] = (1 if one else 2) * rows * st.n_res * d * kw["fp_bytes"]  # filled only
        read += sum(parts.values())
        quantized = 1 if one else sum(s is not None for s in (setting.key, setting.value))
        unpack += 4 * rows * st.q_held * d * quantized
        if setting.compressed:
            why = kernel_layout_problem(setting, shape.head_dim)
            policy = set_policy(kw["protect"])
            if why is None and policy is not None and policy.needs_attention_probs \
                    and shape.window(i) is None:
                why = policy.kernel_problem
            if why:
                unfused[i] = why
    return DecodeCost(tokens, read, shape.fp16_bytes(tokens, batch), unpack, unfused)
