"""kvlens: KV-cache quantization diagnostics for LLMs.

The library API lives in submodules (``kvlens.capture.run``, ``kvlens.capture.store``, ``kvlens.quant``...);
nothing heavy is imported here so that ``kvlens --help`` stays instant.
"""

__version__ = "0.1.0"
