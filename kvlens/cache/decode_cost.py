"""What one decode step reads from a compressed cache: a documented model of bytes, per layout.

Decode attention is bound by the bytes it reads (docs/kernels.md: every step
reads the whole cache). This module turns the byte description of ``kvlens.cache.layout`` into
the bytes one single-token decode step reads, for ``recommend`` to report next to the presets:

- the packed store: codes at their bits (densely packed), scales and zeros (the fused kernel reads
  each once per step; per-token scales cost ``2 * s * D / G`` bytes per token, per-channel ones
  ``2 * s * D / G`` per token too, per-tensor ones ``2 * s / F``);
- an unquantized tensor's dense history, the filled part of the residual window (not its spare
  capacity), the layer's set with its positions and its policy's state (mask, accumulators:
  ``kvlens.cache.sets``), pre-RoPE positions (to re-create RoPE) and balancers (read whole every
  step);
- ``torch_unpack_bytes``: on the eager torch path (CPU) each quantized element is also unpacked
  to float32 once per step, chunk by chunk (written, then read by the matmul): 4 bytes per
  element, which on a CPU costs as much traffic as an fp32 cache. The fused kernel never does.

``fused`` says whether every layer has the Triton decode kernel's path
(``kvlens.cache.triton_glue.kernel_layout_problem``); ``unfused`` gives the reason per layer.
A model, not a measurement: kernel efficiency differs by layout (see ``docs/kernels.md``), but at
long context the time of a memory-bound step is proportional to these bytes.
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


def layer_read_bytes(setting, *, tokens: int, head_dim: int, kv_heads: int, batch: int = 1,
                     fp_bytes: int = 2, scale_dtype: str = "float16", protect=None,
                     balancer: bool = False, sliding_window: int | None = None,
                     kv_shared: bool = False
                     ) -> tuple[int, int]:
    """``(read, torch_unpack)`` bytes of one decode step over one layer (module doc); a store
    shared by keys and values (MLA, ``layout.shares_storage``) is read once."""
    parts = layout.layer_part_bytes(setting, tokens=tokens, head_dim=head_dim,
                                    kv_heads=kv_heads, batch=batch, fp_bytes=fp_bytes,
                                    scale_dtype=scale_dtype, protect=protect, balancer=balancer,
                                    sliding_window=sliding_window, kv_shared=kv_shared)
    one = layout.shares_storage(setting, kv_shared, head_dim, balancer=balancer)
    st = layout.stream_state(setting, tokens, sliding_window)
    rows = batch * kv_heads
    parts["window"] = (1 if one else 2) * rows * st.n_res * head_dim * fp_bytes  # filled only
    quantized = 1 if one else sum(s is not None for s in (setting.key, setting.value))
    unpack = 4 * rows * st.q_held * head_dim * quantized
    return sum(parts.values()), unpack


def config_decode_cost(config, shape: layout.ModelShape, tokens: int, batch: int = 1
                       ) -> DecodeCost:
    """``DecodeCost`` of ``config`` on a model of ``shape`` (``kvlens.cache.layout.ModelShape``),
    with the same per-layer rules as ``layout.config_part_bytes``."""

    fp = layout.fp_bytes_of(config.fp_dtype, shape.dtype_bytes)
    # bytes read per scale (and per zero) are the bytes held: the kernel reads 8-bit metadata
    # as bytes and decodes it in registers (docs/kernels.md)
    read = unpack = 0
    unfused = {}
    for i in shape.attention_layers:
        setting = config.layer(i)
        protect = config.protect_for(i)
        balancer = protect is not None and (protect.balancer == "online" or
                                         (protect.balancer == "fixed" and i in config.balancers))
        r, u = layer_read_bytes(setting, tokens=tokens, head_dim=shape.head_dim,
                                kv_heads=shape.num_key_value_heads, batch=batch, fp_bytes=fp,
                                scale_dtype=config.scale_dtype, protect=protect,
                                balancer=balancer and setting.compressed,
                                sliding_window=shape.window(i), kv_shared=shape.kv_shared)
        read += r
        unpack += u
        if setting.compressed:
            why = kernel_layout_problem(setting, shape.head_dim)
            policy = set_policy(protect)
            if why is None and policy is not None and policy.needs_attention_probs \
                    and shape.window(i) is None:
                why = policy.kernel_problem
            if why:
                unfused[i] = why
    return DecodeCost(tokens, read, shape.fp16_bytes(tokens, batch), unpack, unfused)
