"""The compressed KV cache: packed low-bit storage that plugs into transformers' generation.

``layer`` holds the per-layer streaming logic (residual window, the set of kept tokens, whose
policy is the extension point ``sets``: the sinks by default), ``cache`` building the whole cache and installing it around a model.
Attention over it: ``attention`` is the function installed in the model (one path per call),
``torch_read`` the torch read path over the packed store, ``backend`` the per-run choice
between torch and Triton (``select_backend``), ``triton_glue`` the calls into the Triton decode
kernel and the layouts it reads (``kernel_layout_problem``).
"""

from kvlens.cache.cache import CompressionSession, compressed_attention, memory_report

__all__ = ["CompressionSession", "compressed_attention", "memory_report"]
