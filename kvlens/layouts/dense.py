"""The full-precision store: a tensor's history kept at a fixed dtype, with the ``Store``
interface (``kvlens.layouts.protocol``). A cache layer keeps its residual window in one (part
``window``), and the history of a tensor it does not quantize when it quantizes the other
(part ``dense``)."""

from __future__ import annotations

import torch


class DenseTensor:
    """Full-precision history ``[B, H, T, D]``: its buffer holds exactly ``length`` tokens
    unless a ``capacity`` is asked for (the residual window keeps room for ``R``)."""

    def __init__(self, dtype: torch.dtype | None = None, part: str = "dense"):
        self.dtype = dtype  # None: the dtype of the first tensor appended
        self.part = part
        self.buf: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[2]

    def _resize(self, cap: int, keep_from: int = 0) -> None:
        """A new buffer of ``cap`` tokens holding ``[keep_from, length)`` at its front."""
        b, h, _, d = self.buf.shape
        new = self.buf.new_zeros(b, h, cap, d)
        m = self.length - keep_from
        new[:, :, :m] = self.buf[:, :, keep_from:self.length]
        self.buf = new

    def append(self, x: torch.Tensor, capacity: int = 0) -> None:
        if self.buf is None:
            self.dtype = self.dtype or x.dtype
            self.buf = x.new_zeros(*x.shape[:2], 0, x.shape[3], dtype=self.dtype)
        need = self.length + x.shape[2]
        if need > self.capacity:
            self._resize(max(need, capacity))
        self.buf[:, :, self.length:need] = x.to(self.dtype)
        self.length = need

    def drop_front(self, n: int, capacity: int = 0) -> None:
        """Forget the oldest ``n`` tokens; the buffer is resized to ``max(capacity, rest)``."""
        if self.buf is None or n == 0 and self.capacity == max(capacity, self.length):
            return
        self._resize(max(capacity, self.length - n), keep_from=n)
        self.length -= n

    def view(self, t0: int = 0, t1: int | None = None) -> torch.Tensor:
        return self.buf[:, :, t0:self.length if t1 is None else t1]

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        return self.buf[:, :, t0:t1].float()

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.buf is None else {self.part: self.buf}

    def select_batch(self, index: torch.Tensor) -> None:
        if self.buf is not None:
            self.buf = self.buf[index]
