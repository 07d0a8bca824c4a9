"""The compressed KV cache: packed low-bit storage that plugs into transformers' generation
(its modules: docs/internals/architecture.md)."""

from kvlens.cache.cache import CompressionSession, compressed_attention, memory_report

__all__ = ["CompressionSession", "compressed_attention", "memory_report"]
