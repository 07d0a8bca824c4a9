"""A coupled-coded K or V store (research, issue #50) and its torch read path.

``CoupledStore`` holds one tensor (keys or values) of one cache layer, ``[B, H, N, D]`` tokens,
in the layout of ``kvlens.quant.coupled``: per vector its ``D / c`` group indices (``b`` bits
each) densely packed (``pack_indices``, ``CoupledSpec.index_bytes(D)`` uint8 per token and head),
and the layer's codebooks: float16 centroids ``[num_codebooks, 2^b, c]``, the uint8 channel
permutation ``[H, D]`` (``"correlation"`` grouping) and the float16 channel weights ``[H, D]``
the weighted encoder searches with (``weighted``). No per-vector or per-group scale. The codebooks
come from the config (``coupled_codebooks``, fitted on a capture) and are held from the start.
``held_bytes()`` counts the tensors the store holds; ``CoupledSpec.held_bytes`` predicts them
(tested equal), and ``kvlens.cache.layout`` counts them as ``codes`` and ``codebooks``.

The store has the interface ``kvlens.cache.layer.CompressedLayer`` streams through (``block``,
``length``, ``append``, ``drop_front``, ``dequantize_range``, ``named_tensors``,
``select_batch``) and the two reads of the torch path (``kvlens.cache.torch_read``), which merges
them with the exact window and sinks by the same online softmax as every layout. The grouping's
change of basis (a channel permutation per head, or the Hadamard rotation) is orthogonal, so it
folds into the query once and the output once (``to_group_basis``, ``from_group_basis``); the
layer itself does not rotate a coupled tensor (``kvlens.config.coupled``).

Reads of the tokens ``[t0, t1)`` (``C`` tokens, ``G = D / c`` groups, ``L = 2^b`` centroids,
``M`` query rows per KV head), in one of two exact forms chosen per call by size:

- **lookup tables** (when the table ``[M, G, L]`` is no larger than the chunk's centroids
  ``[C, D]``: decode steps against long chunks). Keys: ``T[m, g, l] = q_g · c_{g,l}`` once,
  then ``score_t = sum_g T[m, g, idx_{t,g}]`` (a gather; no key vector is formed). Values: the
  softmax weights are summed per group and centroid, ``W[m, g, l] = sum_{t: idx_{t,g} = l}
  p_t`` (a scatter-add), then ``o_g = sum_l W[m, g, l] c_{g,l}``; no value vector is formed.
- **chunk decode** (prefill: many query rows): the chunk's centroids are looked up,
  ``[B, H, C, D]`` float32 in the grouping's basis, and multiplied; one chunk is the only
  chunk-sized float tensor, the history is never decoded whole (``chunk_tokens`` bounds it).

Unpacking a chunk's indices (``unpack_indices``) makes a transient bit tensor of 64 bytes per
packed byte: a research path, not a tuned one (no Triton kernel reads it:
``kvlens.cache.triton_glue.kernel_layout_problem``). Same math as "decode with
``kvlens.quant.coupled.decode_coupled`` and attend", different float rounding (tested to 1e-5).
"""

from __future__ import annotations

import torch

from kvlens.errors import InputError
from kvlens.quant.coupled import (
    CoupledCodebooks,
    CoupledSpec,
    codebook_table,
    decode_coupled,
    encode_coupled,
    from_group_basis,
    pack_indices,
    to_group_basis,
    unpack_indices,
)


class CoupledStore:
    """One tensor of one cache layer coded with ``books`` (module docstring).

    packed: uint8 ``[B, H, N, index_bytes]``; centroids float16 ``[num_codebooks, 2^b, c]``;
    permutation uint8 ``[H, D]`` or None; weights float16 ``[H, D]`` or None. ``block``: tokens
    the cache flushes together (``drop_front`` drops whole blocks)."""

    def __init__(self, books: CoupledCodebooks, block: int = 1, device=None):
        if not isinstance(books, CoupledCodebooks):
            raise InputError("A coupled store needs fitted CoupledCodebooks (the config's "
                             "coupled_codebooks entry of the layer).")
        self.spec: CoupledSpec = books.spec
        self.head_dim = books.head_dim
        self.kv_heads = books.kv_heads
        self.block = block
        self.centroids = books.centroids.to(device=device, dtype=torch.float16)
        self.permutation = None if books.permutation is None else \
            books.permutation.to(device=device, dtype=torch.uint8)
        self.weights = None if books.channel_weights is None else \
            books.channel_weights.to(device=device, dtype=torch.float16)
        self.packed: torch.Tensor | None = None

    @property
    def books(self) -> CoupledCodebooks:
        """The codebooks as the reference quantizer takes them (float32 from the stored float16;
        built per call, so nothing beyond the stored tensors is held)."""
        weights = None if self.weights is None else self.weights.float()
        return CoupledCodebooks(self.spec, self.centroids.float(), self.kv_heads, self.head_dim,
                                self._perm(), weights)

    @property
    def length(self) -> int:
        return 0 if self.packed is None else self.packed.shape[2]

    @property
    def groups(self) -> int:
        return self.head_dim // self.spec.channels

    def append(self, x: torch.Tensor) -> None:
        """Code ``x`` ``[B, H, t, D]`` (``encode_coupled``) and append it along tokens."""
        if x.dim() != 4 or tuple(x.shape[1::2]) != (self.kv_heads, self.head_dim):
            raise InputError(f"Expected [B, {self.kv_heads}, t, {self.head_dim}], got "
                             f"{tuple(x.shape)}.")
        if x.shape[2] == 0:
            return
        packed = pack_indices(encode_coupled(x, self.books), self.spec.index_bits)
        self.packed = packed if self.packed is None else torch.cat((self.packed, packed), dim=2)

    def indices(self, t0: int, t1: int) -> torch.Tensor:
        """int64 group indices of tokens ``[t0, t1)``, ``[B, H, t1 - t0, D / c]``."""
        return unpack_indices(self.packed[:, :, t0:t1], self.spec.index_bits,
                              self.groups).long()

    # -- the cache's store interface (kvlens.cache.layer) --------------------------------------
    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens (whole blocks: a sliding layer's expired history)."""
        if n % self.block or n > self.length:
            raise ValueError(f"drop_front needs whole blocks of {self.block} tokens within the "
                             f"{self.length} stored, got {n}")
        if n:
            self.packed = self.packed[:, :, n:].clone()

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        """Tokens ``[t0, t1)`` as float32 ``[B, H, t1 - t0, D]`` (the reference decode,
        ``decode_coupled``; only this slice is materialised)."""
        return decode_coupled(self.indices(t0, t1), self.books)

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_range(0, self.length)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(part, tensor)`` by ``kvlens.cache.layout`` part: the packed indices (``codes``,
        once something is stored) and the codebooks, permutation and weights (``codebooks``,
        held from the start)."""
        out = [] if self.packed is None else [("codes", self.packed)]
        return out + [("codebooks", t) for t in (self.centroids, self.permutation, self.weights)
                      if t is not None]

    def select_batch(self, index: torch.Tensor) -> None:
        if self.packed is not None:
            self.packed = self.packed[index]

    def held_bytes(self) -> int:
        """Bytes of the tensors held (``named_tensors``)."""
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    def reported_bytes(self) -> int:
        """``CoupledSpec.held_bytes`` for what the store holds."""
        if self.packed is None:
            return self.spec.codebook_bytes(self.kv_heads, self.head_dim)
        b, _, n, _ = self.packed.shape
        return self.spec.held_bytes(n, self.kv_heads, self.head_dim, batch=b)

    # -- reads ---------------------------------------------------------------------------------
    def _perm(self) -> torch.Tensor | None:
        return None if self.permutation is None else self.permutation.long()

    def _table(self, device) -> torch.Tensor:
        """float32 ``[H, G, L, c]`` centroids per head and group (``codebook_table``)."""
        return codebook_table(self.books).to(device)

    def _use_tables(self, rows: int, tokens: int) -> bool:
        """Lookup tables when ``[rows, G, L]`` is no larger than the chunk's ``[C, D]``."""
        return rows * self.spec.levels <= tokens * self.spec.channels

    def _chunk(self, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The centroids of ``idx`` ``[B, H, C, G]``: float32 ``[B, H, C, D]`` (group basis)."""
        b, h, n, g = idx.shape
        heads = torch.arange(h, device=idx.device)[None, :, None, None]
        groups = torch.arange(g, device=idx.device)[None, None, None, :]
        return table[heads, groups, idx].reshape(b, h, n, g * self.spec.channels)

    def _flat(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` ``[B, H, C, G]`` as positions in a ``[G * L]`` table row, ``[B, H, 1, C G]``."""
        b, h, n, g = idx.shape
        offset = torch.arange(g, device=idx.device) * self.spec.levels
        return (idx + offset).reshape(b, h, 1, n * g)

    def key_scores(self, q: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Queries ``q`` ``[B, H, M, D]`` (scaling folded in) against the coded keys
        ``[t0, t1)``: ``q · k_hat_t``, ``[B, H, M, t1 - t0]`` (module docstring)."""
        b, h, m, d = q.shape
        qy = to_group_basis(q, self.spec, self._perm())
        table = self._table(q.device)
        idx = self.indices(t0, t1)
        n, g = idx.shape[2], self.groups
        if not self._use_tables(m, n):
            return torch.matmul(qy, self._chunk(idx, table).transpose(-1, -2))
        lut = torch.einsum("bhmgc,hglc->bhmgl", qy.reshape(b, h, m, g, self.spec.channels),
                           table).reshape(b, h, m, g * self.spec.levels)
        picked = lut.gather(-1, self._flat(idx).expand(b, h, m, n * g))
        return picked.view(b, h, m, n, g).sum(-1)

    def value_out(self, p: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Softmax weights ``p`` ``[B, H, M, t1 - t0]`` times the coded values ``[t0, t1)``:
        ``sum_t p_t v_hat_t``, ``[B, H, M, D]`` (module docstring)."""
        b, h, m, n = p.shape
        table = self._table(p.device)
        idx = self.indices(t0, t1)
        g = self.groups
        if not self._use_tables(m, n):
            out = torch.matmul(p.float(), self._chunk(idx, table))
        else:
            src = p.float()[..., None].expand(b, h, m, n, g).reshape(b, h, m, n * g)
            mass = p.new_zeros(b, h, m, g * self.spec.levels, dtype=torch.float32)
            mass.scatter_add_(-1, self._flat(idx).expand(b, h, m, n * g), src)
            out = torch.einsum("bhmgl,hglc->bhmgc", mass.view(b, h, m, g, self.spec.levels),
                               table).reshape(b, h, m, self.head_dim)
        return from_group_basis(out, self.spec, self._perm())
