"""Triton kernels over kvlens' packed KV cache (layout: ``kvlens.cache.packed``).

Stable API (tensors and ints only, never kvlens objects; tensors ``[B, H, T, D]``):

- ``quantize_pack_keys(x, bits, group_size)``: per-channel groups along tokens, packed along
  tokens (reference: ``kvlens.quant.quantize`` + ``pack_codes``), bit-exact codes.
- ``quantize_pack_values(x, bits, group_size)``: per-token groups along channels, packed along
  channels, bit-exact codes.
- ``decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, length, ...)``:
  fused split-K decode attention of ``q`` ``[B, Hq, 1, D]`` over the packed store plus the
  full-precision residual window and extra fp16 token sets (MiKV), returning ``[B, Hq, 1, D]``
  (reference: dequantize with ``kvlens.quant`` then softmax attention).
  Generation calls it for single-token decode steps when the backend is triton
  (``kvlens.cache.attention``: ``select_backend``, ``triton_decode``).

Importing this package needs triton but no GPU; on CPU the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1`` set before triton is imported). Choosing this backend is the
job of ``kvlens.cache.attention.select_backend``.
"""

from kvlens_kernels.decode import decode_attention
from kvlens_kernels.quant_pack import quantize_pack_keys, quantize_pack_values

__all__ = [
    "decode_attention",
    "quantize_pack_keys",
    "quantize_pack_values",
]
