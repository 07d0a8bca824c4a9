"""transformers' HQQ cache with ``axis=0`` as a storage layout (``hqq-strided``): the whole
history of one layer tensor quantized with hqq's strided groups, and re-quantized whole at
every flush (semantics: ``kvlens.quant.reference.quantize_hqq_strided``).

What the real layer does (transformers 5.24 ``HQQQuantizedLayer`` over hqq 0.2.8
``Quantizer.quantize(..., axis=0, optimize=True)``; docs/lab-notes/transformers-caches.md):
it keeps one quantized tensor ``[B, H, T, D]`` per layer and tensor, in hqq's strided groups
(one channel over batch rows, heads and the whole history); at every window flush the history is
dequantized, the flushed tokens appended and everything quantized again, so the groups change and
the error compounds. The store does the same, batch rows included. It keeps the tokens a
sliding-window layer no longer sees (``keeps_evicted``: the real layers keep them, and their
drifting re-quantized values widen the groups; the mask hides them). Appends and drops between
two reads are one re-quantization: the store re-quantizes lazily, at the next read, byte count or
batch selection after its tokens changed. Held: codes packed along
channels ``[B, H, T, packed_length(D, b)]`` (part ``codes``) and each group's scale and zero at the
config's ``scale_dtype`` (parts ``scales``, ``zeros``; ``T * D / G`` each per batch row and head,
which ``check`` keeps whole: ``G`` must divide ``F * D``). JSON: ``{"layout": "hqq-strided",
"bits": 4, "group": 64}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.errors import ConfigError, is_int
from kvlens.layouts.packed import SCALE_BYTES
from kvlens.layouts.protocol import FieldsLayout, register
from kvlens.quant.packing import pack_codes, packed_length, unpack_codes
from kvlens.quant.reference import dequantize_hqq_strided, quantize_hqq_strided

KIND = "hqq-strided"
FLOAT_SCALES = ("float16", "float32")  # the scale dtypes it keeps (hqq keeps floats)


@dataclass(frozen=True)
class HqqStrided(FieldsLayout):
    """hqq's ``axis=0`` layout of ``bits``-bit codes in groups of ``group`` elements (module
    docstring)."""

    bits: int
    group: int = 64

    kind = KIND
    keeps_evicted = True  # kvlens.cache.layout.evicts (module docstring)

    def __post_init__(self) -> None:
        if not is_int(self.bits, 1, 8) or not is_int(self.group, 1):
            raise ConfigError(f"Invalid {KIND} spec bits={self.bits!r}, group={self.group!r}; "
                              "allowed: bits 1-8 and a group size >= 1.")

    @property
    def label(self) -> str:
        return f"{self.bits}-bit HQQ axis=0 G{self.group} (strided, re-quantized at each flush)"

    def check(self, residual_tokens: int, head_dim: int, what: str = "",
              flush_tokens: int = 0) -> None:
        f = self.flush_block(residual_tokens, flush_tokens)
        if f * head_dim % self.group:
            where = f"{what}: " if what else ""
            raise ConfigError(f"{where}{KIND} groups of {self.group} elements must divide each "
                              f"flush of {f} tokens x {head_dim} channels; use a group size "
                              f"that divides {f * head_dim}.")

    def reconstruct(self, x: torch.Tensor, block: int, scale_dtype: str = "float16"
                    ) -> torch.Tensor:
        """``x`` flushed ``block`` tokens at a time into a store (the first block quantized on
        its own, each later one with the dequantized history), read back."""
        store = self.new_store(x.shape[-1], block, scale_dtype)
        for t0 in range(0, x.shape[2], block):
            store.append(x[:, :, t0:t0 + block].float())
            store.settle()
        return store.dequantize_range(0, store.length)

    def new_store(self, head_dim: int, block: int, scale_dtype: str = "float16"
                  ) -> HqqStridedStore:
        if scale_dtype not in FLOAT_SCALES:
            raise ConfigError(f"{KIND} keeps float scales and zeros, as hqq does; scale_dtype "
                              f"{scale_dtype!r} is not one of {', '.join(FLOAT_SCALES)}.")
        return HqqStridedStore(self, head_dim, getattr(torch, scale_dtype))

    def part_bytes(self, tokens: int, head_dim: int, block: int,
                   scale_dtype: str = "float16") -> dict[str, int]:
        if tokens == 0:
            return {}
        meta = tokens * head_dim // self.group * SCALE_BYTES[scale_dtype]
        return {"codes": tokens * packed_length(head_dim, self.bits), "scales": meta,
                "zeros": meta}


class HqqStridedStore:
    """The history of one tensor as ``HqqStrided`` holds it (module docstring): ``codes`` uint8
    ``[B, H, T, packed_length(D, b)]``, ``scale`` and ``zero`` ``[B * H * T * D / G]``;
    ``dead`` tokens at the front evicted and ``pending`` tokens flushed since the last
    re-quantization (``settle``)."""

    def __init__(self, layout: HqqStrided, head_dim: int, scale_dtype: torch.dtype):
        self.layout, self.head_dim, self.scale_dtype = layout, head_dim, scale_dtype
        self.codes: torch.Tensor | None = None
        self.scale = self.zero = None
        self.dead = 0
        self.pending: list[torch.Tensor] = []

    @property
    def held(self) -> int:
        """Tokens of the quantized tensor (evicted ones included until the next settle)."""
        return 0 if self.codes is None else self.codes.shape[2]

    @property
    def length(self) -> int:
        return self.held - self.dead + sum(x.shape[2] for x in self.pending)

    def append(self, x: torch.Tensor) -> None:
        if x.shape[2]:
            self.pending.append(x.float())

    def drop_front(self, n: int) -> None:
        if n > self.length:
            raise ValueError(f"drop_front({n}) of a store holding {self.length} tokens")
        if n > self.held - self.dead:  # it evicts tokens flushed since the last settle
            self.settle()
        self.dead += n

    def settle(self) -> None:
        """Re-quantize the live history with what was flushed since, as one tensor."""
        if not self.pending and not self.dead:
            return
        live = [self._read(self.dead, self.held)] if self.held > self.dead else []
        self._quantize(torch.cat(live + self.pending, dim=2))

    def _quantize(self, x: torch.Tensor) -> None:
        self.pending, self.dead = [], 0
        if x.shape[2] == 0:
            self.codes = self.scale = self.zero = None
            return
        codes, scale, zero = quantize_hqq_strided(x, self.layout.bits, self.layout.group)
        self.codes = pack_codes(codes, self.layout.bits)
        self.scale, self.zero = scale.to(self.scale_dtype), zero.to(self.scale_dtype)

    def _read(self, t0: int, t1: int) -> torch.Tensor:
        """Quantized tokens ``[t0, t1)`` (of the held tensor) as float32 ``[B, H, n, D]``."""
        b, h, t, _ = self.codes.shape
        d = self.head_dim
        codes = unpack_codes(self.codes[:, :, t0:t1], self.layout.bits, d)
        rows = torch.arange(b * h, device=codes.device).reshape(b, h, 1, 1) * t
        index = (rows + torch.arange(t0, t1, device=codes.device)[:, None]) * d + \
            torch.arange(d, device=codes.device)
        return dequantize_hqq_strided(codes, self.scale, self.zero, index)

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        self.settle()
        return self._read(t0, t1)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        self.settle()
        if self.codes is None:
            return {}
        return {"codes": self.codes, "scales": self.scale, "zeros": self.zero}

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index``: the groups span batch rows, so what stays is quantized
        again (the real layer re-quantizes the reordered history at its next flush)."""
        self.settle()
        if self.codes is not None:
            self._quantize(self._read(0, self.held)[index])


register(HqqStrided, KIND, HqqStrided.from_dict)
