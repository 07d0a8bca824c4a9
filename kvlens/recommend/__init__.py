"""``kvlens recommend``: a per-layer KV quantization config under a memory budget (``core``)."""
