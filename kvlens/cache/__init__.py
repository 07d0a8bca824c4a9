"""The compressed KV cache: packed low-bit storage that plugs into transformers' generation.

``packed`` owns the storage layout, ``layer`` the per-layer streaming logic (residual window,
MiKV high-precision set), ``attention`` the decode attention over the packed store and the
backend dispatch, ``cache`` building the whole cache and installing it around a model.
"""

from kvlens.cache.cache import CompressionSession, compressed_attention, memory_report

__all__ = ["CompressionSession", "compressed_attention", "memory_report"]
