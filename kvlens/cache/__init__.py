"""The compressed KV cache: packed low-bit storage that plugs into transformers' generation.

``layer``: the per-layer streaming logic (its kept set's policy: ``sets``); ``engine``: the
engine-format layers; ``cache``: the whole cache around a model; ``layout``: its bytes;
``attention``: the function installed in the model, over ``torch_read`` or the Triton kernel
(``triton_glue``), as ``backend`` chooses.
"""

from kvlens.cache.cache import CompressionSession, compressed_attention, memory_report

__all__ = ["CompressionSession", "compressed_attention", "memory_report"]
