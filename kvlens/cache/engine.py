"""Engine-format cache layers: a layer that stores and reads its K/V the way llama.cpp or vLLM do.

An ``EngineLayer`` serves every layer whose config sets ``key_format``/``value_format``. It has
no full-precision window: ``update()`` writes the new tokens in the engine's format **first**,
then returns the whole held history read back, so the model's attention attends to exactly
what the engine's reads (llama.cpp ``cpy_k``/``cpy_v`` then ``build_attn_mha``; vLLM
``reshape_and_cache`` then attention over the paged cache).

``EngineStore`` holds per token and KV head exactly what the engine holds (by part, as
``kvlens.cache.layout.engine_tensor_bytes`` predicts). llama.cpp's rotated types store ``x R``
(``kvlens.quant.formats.engine_rotation``) and read back ``Q(x R) R^T``; the matrices live on
the session, as llama.cpp keeps them outside its KV buffer. Sliding layers keep the last ``W -
1`` tokens; attention reads the mask's columns of the returned positions (``read_start`` on).
"""

from __future__ import annotations

import torch

from kvlens.cache import layout
from kvlens.cache.layer import LAYER_ATTR, HistoryLayer, held_columns
from kvlens.layouts.protocol import TensorStore
from kvlens.quant.cachetypes import CacheType, DenseType, needs_scales, scale_count
from kvlens.quant.ds_mla import dequantize_ds_mla, quantize_ds_mla
from kvlens.quant.formats import rotate_rows
from kvlens.quant.fp8 import dequantize_token_head, fp8_decode, fp8_encode, quantize_token_head
from kvlens.quant.ggml import GGMLBlocks, dequantize_ggml, quantize_ggml
from kvlens.quant.llamacpp_cpu import attend as llamacpp_attend


def static_scale(ctype: CacheType, kv_heads: int, given=None) -> torch.Tensor | None:
    """The float32 ``[1, 1 or Hkv, 1, 1]`` static fp8 scale of ``ctype``: its fixed scale
    (``:sS``) or the calibrated ``given`` values (as many as it needs: the config was checked
    by ``kvlens.config.validate_for``); ``None`` for other types."""
    n = scale_count(ctype, kv_heads)
    if n == 0:
        return None
    if needs_scales(ctype):
        return torch.tensor(list(given), dtype=torch.float32).reshape(1, n, 1, 1)
    return torch.full((1, n, 1, 1), float(ctype.format.fixed_scale), dtype=torch.float32)


class EngineStore(TensorStore):
    """One tensor (K or V) of one layer in an engine cache type, ``[B, H, N, D]`` tokens.

    ``scale``: the static fp8 scale(s), float32 ``[1, 1 or H, 1, 1]`` (``None`` for other
    types), held beside the buffers: a type holds per-token scales or a static scale, not
    both, and RoPE channels (``fp8_ds_mla``) only beside codes."""

    def __init__(self, ctype: CacheType, head_dim: int, scale: torch.Tensor | None = None):
        self.ctype = ctype
        self.head_dim = head_dim
        self.family = ctype.family if isinstance(ctype, DenseType) else ctype.format.family
        self.fmt = None if isinstance(ctype, DenseType) else ctype.format
        if self.family in ("ggml", "ds-mla"):
            self.fmt.check_fits((1, 1, 1, head_dim))
        self.static_scale = scale
        # codes / blocks / dense values; per-token-head float32 scales [B, H, N, 1] (fp8_ds_mla:
        # [B, H, N, tiles]); fp8_ds_mla's bfloat16 RoPE channels
        self.BUFFERS = {"data": {"dense": "dense", "ggml": "blocks"}.get(self.family, "codes"),
                        "scales": "scales", "rope": "dense"}
        self.data = self.scales = self.rope = None

    # -- writing -----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``x`` float ``[B, H, t, D]`` (stored basis) -> (data, per-token scales or None,
        fp8_ds_mla's RoPE channels or None)."""
        if self.family == "dense":
            return x.to(getattr(torch, self.ctype.torch_dtype)), None, None
        if self.family == "ggml":
            return quantize_ggml(x, self.fmt).to_bytes(), None, None
        if self.family == "fp8":
            scale = self.static_scale.to(x.device)
            return fp8_encode(x, scale, self.fmt.fp8, self.fmt.rounding), None, None
        if self.family == "ds-mla":
            return quantize_ds_mla(x)
        return (*quantize_token_head(x, self.fmt), None)  # dynamic per-token-head

    def append(self, x: torch.Tensor) -> None:
        self.extend(*self.encode(x))

    # -- reading ------------------------------------------------------------------------------
    def read(self) -> torch.Tensor:
        """Every held token as float32 ``[B, H, N, D]`` (stored basis): exactly what
        ``kvlens.quant.formats.fake_quantize_format`` computes (before un-rotation)."""
        if self.family == "dense":
            return self.data.float()
        if self.family == "ggml":
            return dequantize_ggml(GGMLBlocks.from_bytes(self.data, self.fmt, self.head_dim))
        if self.family == "fp8":
            return fp8_decode(self.data, self.static_scale.to(self.data.device))
        if self.family == "ds-mla":
            return dequantize_ds_mla(self.data, self.scales, self.rope)
        return dequantize_token_head(self.data, self.scales, self.fmt, self.head_dim)

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        """Tokens ``[t0, t1)`` of ``read()`` (``kvlens.layouts.Store``)."""
        return self.read()[:, :, t0:t1]

    def block_minima(self) -> torch.Tensor | None:
        """The fp16 minima ``m`` ``[B, H, N, D // 32]`` (float32) of a ``_1`` ggml type (what
        llama.cpp's ``vec_dot`` adds as ``m * s``), else ``None``."""
        if self.family != "ggml" or not self.fmt.has_min or self.data is None:
            return None
        return GGMLBlocks.from_bytes(self.data, self.fmt, self.head_dim).m.float()

    @property
    def type_name(self) -> str:
        """The engine's name of the stored type (``f16``, ``q8_0`` ...)."""
        return self.ctype.name if self.fmt is None else self.fmt.name

    # -- accounting ---------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = super().named_tensors()
        if out and self.static_scale is not None:
            out["scales"] = self.static_scale
        return out


def _visible(mask: torch.Tensor | None, tq: int, n: int, device) -> torch.Tensor:
    """bool ``[B|1, 1, Tq, n]``: which of the ``n`` returned key positions each query sees, from
    ``mask``'s columns of those positions (``EngineLayer.returned_mask``); ``None`` mask =
    causal with the queries the last ``Tq`` positions."""
    if mask is None:
        pos = torch.arange(n, device=device)
        qpos = torch.arange(n - tq, n, device=device)
        return (pos[None, :] <= qpos[:, None])[None, None]
    m = mask
    if m.dtype == torch.bool:
        return m
    return m > torch.finfo(m.dtype).min / 2


class EngineLayer(HistoryLayer):
    """A transformers cache layer storing K and V in engine cache types (module docstring).

    key_type / value_type: ``kvlens.quant.cachetypes`` types. key_scale / value_scale: float32
    static fp8 scales ``[1, 1 or Hkv, 1, 1]`` where the type needs them."""

    what = "engine-format"

    def __init__(self, key_type: CacheType, value_type: CacheType, layer_idx: int,
                 head_dim: int, *, key_scale: torch.Tensor | None = None,
                 value_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                 session=None, kv_shared: bool = False):
        super().__init__(layer_idx, head_dim, session, sliding_window, kv_shared)
        self.key_type, self.value_type = key_type, value_type
        self.kstore = EngineStore(key_type, head_dim, key_scale)
        self.vstore = EngineStore(value_type, head_dim, value_scale)
        # an MLA layer's latent row (kvlens.model.mla) stored once when both are stored alike
        self.shares = layout.engine_types_share(key_type, value_type, kv_shared, head_dim)
        if self.shares:
            self.vstore = self.kstore
        self.rotate_keys = key_type.rotates(head_dim)
        self.rotate_values = value_type.rotates(head_dim)
        self.start = 0  # first held position (a sliding layer drops older ones)
        self.read_start = 0  # first position of what the last update() returned

    # -- transformers interface -------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:
        super().lazy_initialization(key_states, value_states)
        for store in self._stores():
            if store.static_scale is not None:
                store.static_scale = store.static_scale.to(key_states.device, torch.float32).clone()

    def _rotation(self, tensor: str) -> torch.Tensor:
        return self.session.engine_rotation(tensor, self.head_dim, self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.begin_update(key_states, value_states)
        out, stored = [], []
        for store, x, rotated, tensor in ((self.kstore, key_states, self.rotate_keys, "key"),
                                          (self.vstore, value_states, self.rotate_values,
                                           "value")):
            r = self._rotation(tensor) if rotated else None
            if not (self.shares and tensor == "value"):  # one store: written once
                store.append(rotate_rows(x, r) if r is not None else x)
            back = store.read()
            stored.append(back)
            out.append((rotate_rows(back, r.T) if r is not None else back).to(x.dtype))
        self.cumulative_length += key_states.shape[2]
        self.read_start = self.start
        if self.engine_attention is not None:
            # the engine's attention reads the stored basis (and a _1 key type's block minima)
            self._read = (stored[0], stored[1], self.kstore.block_minima())
        # tagged for kvlens' attention function, which trims the mask to the returned positions
        setattr(out[0], LAYER_ATTR, self)
        self._evict()
        return out[0], out[1]

    def returned_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """transformers' mask (absolute positions from 0, ``HistoryLayer``) cut to the positions
        the last ``update()`` returned (``[read_start, N)``)."""
        return held_columns(mask, self.read_start)

    @property
    def engine_attention(self) -> str | None:
        """The engine arithmetic attention runs with (``KVConfig.engine_attention``), or
        ``None``: the model's own float attention over the read-back K/V."""
        return getattr(getattr(self.session, "config", None), "engine_attention", None)

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float, *,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` ``[B, Hq, Tq, D]`` over what the last ``update`` read, with
        llama.cpp's CPU arithmetic (``kvlens.quant.llamacpp_cpu.attend``), the query rotated by K's
        rotation and the output un-rotated by V's; ``mask`` over the returned positions (``None``:
        causal). Returns ``[B, Tq, Hq, D]``."""
        k, v, k_min = self._read
        self._read = None  # one attention call per update
        q = query.float()
        if self.rotate_keys:
            q = rotate_rows(q, self._rotation("key"))
        out = llamacpp_attend(q, k, v,
                              _visible(self.returned_mask(mask), q.shape[2], k.shape[2], q.device),
                              scaling, self.kstore.type_name, self.vstore.type_name,
                              k_min=k_min,
                              flash_attention=self.engine_attention == "llamacpp-cpu-fa",
                              softcap=softcap,
                              sinks=None if sinks is None else sinks.detach().to(q.device))
        if self.rotate_values:
            out = rotate_rows(out, self._rotation("value").T)
        return out.transpose(1, 2).to(query.dtype)

    def _evict(self) -> None:
        """Sliding layer: drop what no later query can see (the returned tensors still hold it
        for this call's attention)."""
        n = layout.evict_boundary(self.cumulative_length, self.sliding_window) - self.start
        if n > 0:
            for store in self._stores():
                store.drop_front(n)
            self.start += n

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for store in self._stores():
            store.select_batch(indices)

    def _stores(self) -> list:
        """The key store and the value store (once when they are one)."""
        return [self.kstore] if self.shares else [self.kstore, self.vstore]

    # -- state and accounting ----------------------------------------------------------------
    @property
    def held_tokens(self) -> int:
        return self.kstore.length

    @property
    def quantized_length(self) -> int:
        """Held tokens that attention reads quantized (0 when both types are float)."""
        return self.held_tokens if self.quantizes_on_write else 0

    @property
    def quantizes_on_write(self) -> bool:
        """Attention reads quantized entries from the first token on (write-before-attention),
        unless both types are float."""
        return not (isinstance(self.key_type, DenseType) and isinstance(self.value_type,
                                                                          DenseType))

    def kv_dims(self) -> tuple[int, int, int]:
        """``(B, Hkv, D)`` of the held tensors."""
        b, h = self.kstore.data.shape[:2]
        return b, h, self.head_dim

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [pair for store in self._stores() for pair in store.named_tensors().items()]
        for name in ("keys", "values"):
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor):
                out.append(("dense", t))
        return out
