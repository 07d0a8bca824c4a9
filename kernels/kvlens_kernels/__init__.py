"""Triton kernels over kvlens' packed KV cache (layout: ``kvlens.layouts.packed``).

Stable API (tensors and ints only, never kvlens objects, and nothing of kvlens imported; tensors ``[B, H, T, D]``):

- ``decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, length, ...)``:
  fused split-K decode attention of ``q`` ``[B, Hq, 1, D]`` over the packed store plus the
  full-precision residual window and extra fp16 token sets (MiKV), returning ``[B, Hq, 1, D]``
  (reference: dequantize with ``kvlens.quant`` then softmax attention). Keys and values are
  uniform codes with group scales; keys may instead be codebook codes with a norm per vector
  (``k_layout="codebook"``, ``kvlens.layouts.codebook``: vLLM TurboQuant's).
  Generation calls it for single-token decode steps when the backend is triton
  (``kvlens.cache.attention``: ``select_backend``, ``triton_decode``).

Importing this package needs triton but no GPU; on CPU the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1`` set before triton is imported). Choosing this backend is the
job of ``kvlens.cache.attention.select_backend``.
"""

from kvlens_kernels._common import KernelInputError
from kvlens_kernels.decode import decode_attention

__all__ = ["KernelInputError", "decode_attention"]
