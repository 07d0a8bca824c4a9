"""One layer of the compressed cache: the streaming logic around the packed store.

A ``CompressedLayer`` keeps, for its layer, ``[B, H, *, D]`` history in up to three places:

- the **packed store** (``kvlens.cache.packed.PackedTensor`` for a quantized tensor, or a
  full-precision ``DenseTensor`` when only the other tensor is quantized): cache positions
  ``[0, quantized_length)``, immutable once written;
- the **residual window**: the newest ``n_res`` tokens in the model's dtype, exact; when it
  holds ``R = residual_tokens`` tokens its oldest are flushed to the packed store in blocks of
  ``F`` (``flush_tokens``; default ``F = R``: all of them, as KIVI);
- the **high-precision set** (MiKV only): per KV head, full-precision copies of the heavy-hitter
  tokens (largest accumulated attention, H2O) and the first ``sink_tokens`` positions, chosen
  again at every flush among the current set and the flushed tokens. Their low-bit copies stay
  in the packed store and are masked out at attention (``is_hp``).

``update()`` appends the new tokens to the residual window and returns them (tagged with this
layer, the side channel kvlens' attention function reads); the attention function then calls
``commit(query, colsum)`` which fits the online balancer (first call), accumulates attention and
flushes. So prefill attention always sees exact K/V and the cache stores them compressed after.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import DynamicLayer

from kvlens.cache.packed import PackedTensor, flush_block
from kvlens.errors import ConfigError
from kvlens.kvconfig import LayerKV, MikvSettings

LAYER_ATTR = "_kvlens_layer"


class DenseTensor:
    """Full-precision history with the ``PackedTensor`` interface (preallocated, doubling)."""

    def __init__(self, block: int = 1):
        self.block = block
        self.buf: torch.Tensor | None = None
        self.length = 0

    def append(self, x: torch.Tensor, min_capacity: int = 0) -> None:
        need = self.length + x.shape[2]
        cap = 0 if self.buf is None else self.buf.shape[2]
        if need > cap:
            new = x.new_zeros(*x.shape[:2], max(need, 2 * cap, min_capacity), x.shape[3])
            if self.buf is not None:
                new[:, :, :self.length] = self.buf[:, :, :self.length]
            self.buf = new
        self.buf[:, :, self.length:need] = x
        self.length = need

    def view(self, t0: int = 0, t1: int | None = None) -> torch.Tensor:
        return self.buf[:, :, t0:self.length if t1 is None else t1]

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        return self.buf[:, :, t0:t1].float()

    def used_bytes(self) -> int:
        if self.buf is None:
            return 0
        b, h, _, d = self.buf.shape
        return b * h * self.length * d * self.buf.element_size()

    def allocated_bytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()

    def select_batch(self, index: torch.Tensor) -> None:
        if self.buf is not None:
            self.buf = self.buf[index]


class CompressedLayer(DynamicLayer):
    """A transformers cache layer whose history is packed low-bit codes (see module doc)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, setting: LayerKV, layer_idx: int, head_dim: int, *,
                 scale_dtype: str = "float16", mikv: MikvSettings | None = None,
                 balancer: torch.Tensor | None = None, sliding_window: int | None = None,
                 session=None):
        super().__init__()
        self.is_initialized = False  # set by the base class from transformers 4.57 on, not 4.56
        self.setting = setting
        self.layer_idx = layer_idx
        self.head_dim = head_dim
        self.session = session
        self.cumulative_length = 0
        self.sliding_window = sliding_window
        # A sliding layer keeps every token here (no eviction); the model's sliding mask, built
        # over absolute positions from get_mask_sizes, hides the old ones.
        self.is_sliding = sliding_window is not None
        r = setting.residual_tokens
        self.flush_every = 0  # 0 = never flush (nothing is quantized)
        if setting.compressed:
            self.flush_every = max(flush_block(s, r, setting.flush_tokens)
                                   for s in (setting.key, setting.value) if s is not None)
        self.kstore = PackedTensor.create(setting.key, r, head_dim, scale_dtype,
                                          setting.flush_tokens) \
            if setting.key is not None else DenseTensor()
        self.vstore = PackedTensor.create(setting.value, r, head_dim, scale_dtype,
                                          setting.flush_tokens) \
            if setting.value is not None else DenseTensor()
        self.res_k, self.res_v = DenseTensor(), DenseTensor()
        self.rope_store = DenseTensor()  # [B, 1, T, 2R] cos|sin per position (pre-RoPE keys)
        self.mikv = mikv if setting.compressed else None
        # Only a layer that really balances its keys conflicts with pre-RoPE storage: with fixed
        # balancers (e.g. from `recommend`) other layers may store keys before RoPE.
        uses_balancer = mikv is not None and (mikv.balancer == "online" or
                                              (mikv.balancer == "fixed" and balancer is not None))
        if uses_balancer and setting.pre_rope_keys:
            raise ConfigError("The MiKV channel balancer cannot be combined with pre-RoPE keys "
                              "(RoPE mixes the balanced channel pairs); disable one of them.")
        self.balancer = balancer  # [Hkv, D] or [B, Hkv, D]; k*b stored, q/b used
        self.want_online_balancer = (self.mikv is not None and self.mikv.balancer == "online"
                                     and self.setting.key is not None and balancer is None)
        self.acc: torch.Tensor | None = None  # [B, Hkv, cap] accumulated attention (H2O)
        self.is_hp: torch.Tensor | None = None  # [B, Hkv, cap] bool
        self.hp_k = self.hp_v = self.hp_pos = None  # [B, Hkv, K, D] x2, [B, Hkv, K] long
        self.pending_rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- transformers interface -----------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys = key_states.new_empty(0)
        self.values = value_states.new_empty(0)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.session is None or not self.session.active:
            raise ConfigError("A kvlens compressed cache must be used inside "
                              "kvlens.cache.compressed_attention(model, config) (it installs "
                              "the attention function that reads the packed store).")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        self.res_k.append(key_states, min_capacity=2 * max(self.flush_every, t))
        self.res_v.append(value_states, min_capacity=2 * max(self.flush_every, t))
        if self.setting.pre_rope_keys:
            cos, sin = self.session.rope.get(self.layer_idx, (None, None))
            if cos is None:
                raise ConfigError("pre-RoPE keys need the layer's RoPE tables, which were not "
                                  "seen; this model does not pass position_embeddings.")
            table = torch.cat((cos, sin), dim=-1).unsqueeze(1)[:, :, -t:]
            table = table.expand(key_states.shape[0], 1, t, table.shape[-1])
            self.rope_store.append(table.to(torch.float32))
        self.cumulative_length += t
        key_states = key_states.view_as(key_states)  # a fresh tensor object to tag
        setattr(key_states, LAYER_ATTR, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        # transformers < 5 passes cache_position (a tensor of the new positions), later
        # versions the query length. Every token is kept: the mask covers positions 0..N-1.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise ConfigError("A kvlens compressed cache cannot be reset; build a new one.")

    def crop(self, tokens_to_remove: int) -> None:
        raise ConfigError("A kvlens compressed cache cannot be cropped (quantized blocks are "
                          "immutable); assisted/speculative decoding is not supported.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ConfigError("A kvlens compressed cache does not support beam search or "
                          "num_return_sequences > 1.")

    def reorder_cache(self, beam_idx) -> None:
        self.batch_repeat_interleave(0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for store in (self.kstore, self.vstore, self.res_k, self.res_v, self.rope_store):
            store.select_batch(indices)
        for name in ("acc", "is_hp", "hp_k", "hp_v", "hp_pos"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[indices])

    # -- state ----------------------------------------------------------------------------------
    @property
    def quantized_length(self) -> int:
        return self.kstore.length

    @property
    def n_res(self) -> int:
        return self.res_k.length

    @property
    def has_hp(self) -> bool:
        return self.hp_pos is not None and self.hp_pos.shape[-1] > 0

    @property
    def needs_attention_probs(self) -> bool:
        # sinks alone are chosen by position: only heavy hitters need the attention mass
        return self.mikv is not None and self.mikv.heavy_fraction > 0

    @property
    def keeps_full_precision_set(self) -> bool:
        return self.mikv is not None and self.mikv.heavy_fraction + self.mikv.sink_tokens > 0

    def rope_tables(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.rope_store.view(t0, t1)[:, 0]
        half = table.shape[-1] // 2
        return table[..., :half], table[..., half:]

    # -- after attention ------------------------------------------------------------------------
    def commit(self, query: torch.Tensor, colsum: torch.Tensor | None) -> None:
        """Called by the attention function after it attended to this step's tokens.

        query: ``[B, Hq, Tq, D]``; colsum: ``[B, Hkv, N]`` attention mass each cached position
        received in this call (summed over the query heads of its KV head and the queries)."""
        if self.want_online_balancer:
            from kvlens.quant import fit_balancer

            self.balancer = fit_balancer(query, self.res_k.view())
            self.want_online_balancer = False
        if colsum is not None:
            self._accumulate(colsum)
        if self.flush_every == 0:
            return
        r, f = self.setting.residual_tokens, self.flush_every
        # Flush the fewest whole blocks that leave fewer than R tokens in the window (F = R:
        # the whole window, KIVI; F < R: a sliding window). R = 0: every token (F = 1).
        if r:
            over = self.n_res - r + 1  # tokens that must leave so that fewer than R remain
            n = -(-over // f) * f if over > 0 else 0
        else:
            n = self.n_res // f * f
        if n:
            self._flush(n)

    def _accumulate(self, colsum: torch.Tensor) -> None:
        n = colsum.shape[-1]
        if self.acc is None or self.acc.shape[-1] < n:
            cap = max(n, 2 * (0 if self.acc is None else self.acc.shape[-1]), 256)
            acc = colsum.new_zeros(*colsum.shape[:2], cap)
            if self.acc is not None:
                acc[..., :self.acc.shape[-1]] = self.acc
            self.acc = acc
        self.acc[..., :n] += colsum

    def _flush(self, n: int) -> None:
        t0 = self.quantized_length
        k = self.res_k.view(0, n)
        v = self.res_v.view(0, n)
        k_store = k
        if self.setting.pre_rope_keys and self.setting.key is not None:
            from kvlens.rope import detect_layout, invert_rope

            cos, sin = self.rope_tables(t0, t0 + n)
            k_store = invert_rope(k.float(), cos, sin, detect_layout(cos))
        if self.balancer is not None and self.setting.key is not None:
            b = self.balancer.float()
            k_store = k_store.float() * (b.unsqueeze(-2) if b.dim() == 3 else b[None, :, None])
        cap = max(2 * (t0 + n), 1024)
        self.kstore.append(k_store if self.setting.key is not None else k, min_capacity=cap)
        self.vstore.append(v, min_capacity=cap)
        if self.keeps_full_precision_set:
            self._select_heavy(t0, n, k, v)
        # Shift the rest of the window to its front (at most R-1 tokens, once per flush).
        rest_k, rest_v = self.res_k.view(n), self.res_v.view(n)
        m = rest_k.shape[2]
        self.res_k.buf[:, :, :m] = rest_k.clone()
        self.res_v.buf[:, :, :m] = rest_v.clone()
        self.res_k.length = self.res_v.length = m

    def _select_heavy(self, t0: int, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """MiKV: re-choose the full-precision set among the current set and the flushed block."""
        b, h, _, d = k.shape
        total = t0 + n
        pos_new = torch.arange(t0, total, device=k.device).expand(b, h, n)
        if self.hp_pos is None:
            cand_pos, cand_k, cand_v = pos_new, k, v
        else:
            cand_pos = torch.cat((self.hp_pos, pos_new), dim=-1)
            cand_k = torch.cat((self.hp_k, k), dim=2)
            cand_v = torch.cat((self.hp_v, v), dim=2)
        acc = self.acc[..., :total] if self.acc is not None else k.new_zeros(b, h, total)
        score = acc.float().gather(-1, cand_pos)
        score = torch.where(cand_pos < self.mikv.sink_tokens, torch.inf, score)
        keep = min(cand_pos.shape[-1],
                   math.ceil(self.mikv.heavy_fraction * total) + self.mikv.sink_tokens)
        idx = score.topk(keep, dim=-1).indices
        self.hp_pos = cand_pos.gather(-1, idx)
        gi = idx[..., None].expand(b, h, keep, d)
        self.hp_k, self.hp_v = cand_k.gather(2, gi), cand_v.gather(2, gi)
        self.is_hp = torch.zeros(b, h, total, dtype=torch.bool, device=k.device)
        self.is_hp.scatter_(-1, self.hp_pos, True)

    # -- accounting -----------------------------------------------------------------------------
    def used_bytes(self) -> dict[str, int]:
        hp = 0
        if self.hp_pos is not None:
            hp = sum(t.numel() * t.element_size() for t in (self.hp_k, self.hp_v, self.hp_pos))
        bal = 0 if self.balancer is None else \
            self.balancer.numel() * self.balancer.element_size()
        return {"packed": self.kstore.used_bytes() + self.vstore.used_bytes(),
                "residual": self.res_k.used_bytes() + self.res_v.used_bytes(),
                "high_precision": hp, "balancer": bal}
