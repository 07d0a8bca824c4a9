"""One layer of the compressed cache: the streaming logic around each tensor's store.

A ``CompressedLayer`` keeps, for its layer, ``[B, H, *, D]`` history in up to three places:

- the **store** of each tensor (its storage layout's, ``kvlens.layouts``, or a full-precision
  ``DenseTensor`` when only the other tensor is quantized): positions ``[q_start, q_end)``,
  immutable once written;
- the **residual window**: the newest ``n_res`` tokens (``[res_start, N)``) at ``fp_dtype``,
  exact; at ``R = residual_tokens`` tokens its oldest are flushed in blocks of ``F``
  (``flush_tokens``; default ``F = R``, as KIVI);
- the **set** (``kvlens.cache.sets``): per KV head, copies of some quantized tokens, re-chosen
  by the layer's ``SetPolicy`` at every flush (the sinks by default; global layers only).
  Their low-bit copies stay in the store and are hidden at attention, by the policy's mask
  (``set_mask``) or, for a set that is the packed prefix, as ``[q_start, sink_end)``.

Nothing is kept twice; the rules and the bytes they imply live in ``kvlens.cache.layout``.
``update()`` appends to the window and returns the new tokens tagged with this layer; the
attention function then calls ``commit(query, colsum)``, which fits the online balancer, feeds
the set policy, flushes and evicts. So prefill attention sees exact K/V, except with
``KVConfig.write_before_attention`` (vLLM TurboQuant's order: after the first forward,
``update()`` codes the new tokens at once). Pre-RoPE keys: each held token's RoPE position
(int32) is kept and its (cos, sin) re-created from the model's frequencies
(``kvlens.rope.RopeFrequencies``), checked against the tables the model passed.
"""

from __future__ import annotations

import torch
from transformers import cache_utils
from transformers.cache_utils import DynamicLayer

from kvlens.cache import layout
from kvlens.cache.sets import SetRows, set_policy
from kvlens.config import LayerKV, ProtectSettings
from kvlens.errors import ConfigError
from kvlens.layouts import DenseTensor, Store, layout_of
from kvlens.quant import fit_balancer
from kvlens.rope import RopeFrequencies, invert_rope

LAYER_ATTR = "_kvlens_layer"
#: what transformers' linear-attention cache layer keeps of a hybrid layer's fixed-size state
#: (conv and recurrent states of its Mamba / linear-attention part): not K/V bytes
STATE_FIELDS = frozenset({"conv_states", "recurrent_states"})


class HistoryLayer(DynamicLayer):
    """What every kvlens cache layer shares: its bookkeeping, what it refuses, and its mask
    size. transformers builds **one** mask per layer type for every layer of that type, so all
    kvlens layers report a mask over absolute positions ``[0, N + q)``, whatever each still
    holds; a layer that dropped positions reads only its columns (``held_columns``)."""

    is_compileable = False
    is_croppable = False
    #: what the messages call this layer's cache
    what = "compressed"

    def __init__(self, layer_idx: int, head_dim: int, session, sliding_window: int | None,
                 kv_shared: bool):
        super().__init__()
        self.is_initialized = False  # set by the base class from transformers 4.57 on, not 4.56
        self.layer_idx = layer_idx
        self.head_dim = head_dim
        self.session = session
        self.cumulative_length = 0
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # an MLA layer's keys and values are one latent row: an fp16 cache holds it once
        self.kv_tensors = 1 if kv_shared else 2

    def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:
        self.check_shapes(key_states, value_states)
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys = key_states.new_empty(0)
        self.values = value_states.new_empty(0)
        self.is_initialized = True

    def begin_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The start of every ``update``: inside a session, initialised, not yet attended."""
        if self.session is None or not self.session.active:
            raise ConfigError(f"A kvlens {self.what} cache must be used inside "
                              "kvlens.cache.compressed_attention(model, config) (it installs "
                              "the attention function that reads the stored K/V).")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.attended = False

    def reset(self) -> None:
        raise ConfigError(f"A kvlens {self.what} cache cannot be reset; build a new one.")

    def crop(self, tokens_to_remove: int) -> None:
        raise ConfigError(f"A kvlens {self.what} cache cannot be cropped; assisted/speculative "
                          "decoding is not supported.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ConfigError(f"A kvlens {self.what} cache does not support beam search or "
                          "num_return_sequences > 1.")

    def reorder_cache(self, beam_idx) -> None:
        self.batch_repeat_interleave(0)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        # transformers < 5 passes cache_position (the new positions), later the query length
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def claim_attention(self) -> None:
        """Called by kvlens' attention function once per call: a second call over one ``update``
        (a model attending twice per layer, e.g. differential attention) is refused."""
        if getattr(self, "attended", False):
            raise ConfigError(f"layer {self.layer_idx}'s attention ran twice over one cache "
                              "update (a model that attends twice per layer, such as "
                              "differential attention); kvlens' cache supports one attention "
                              "call per update.")
        self.attended = True

    def check_shapes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """At the first update: refuse K/V whose KV heads or head_dim differ from what the cache was
        built for (``kvlens.model.architecture.describe``)."""
        info = getattr(self.session, "info", None)
        want = (getattr(info, "num_key_value_heads", key_states.shape[1]), self.head_dim)
        for name, x in (("keys", key_states), ("values", value_states)):
            if (x.shape[1], x.shape[-1]) != want:
                raise ConfigError(
                    f"layer {self.layer_idx}: the model hands the cache {name} of {x.shape[1]} "
                    f"heads x {x.shape[-1]} channels, but its modules and config say "
                    f"{want[0]} x {want[1]}; kvlens cannot cache this architecture.")


def held_columns(mask: torch.Tensor | None, first: int) -> torch.Tensor | None:
    """The columns of transformers' mask (absolute positions, ``HistoryLayer``) for the
    positions ``[first, N)`` a layer still holds; ``None`` (causal) stays ``None``."""
    if mask is None or not first:
        return mask
    return mask[..., first:]


_WITH_STATE: dict = {}


def with_fixed_state(cls):
    """``cls`` that also keeps a hybrid layer's fixed-size state (Falcon-H1: attention and a
    Mamba mixer in one layer) exact, as transformers' ``LinearAttentionLayer`` does; its
    constructor takes ``number_of_states`` besides ``cls``'s arguments."""
    linear = getattr(cache_utils, "LinearAttentionLayer", None)
    if linear is None:
        raise ConfigError("This model has layers with both attention and a recurrent state; "
                          "kvlens' cache supports them on transformers versions that have "
                          "LinearAttentionLayer (5.x): upgrade transformers.")
    if cls not in _WITH_STATE:
        def __init__(self, *args, number_of_states: int = 1, **kwargs):
            linear.__init__(self, number_of_states=number_of_states)
            cls.__init__(self, *args, **kwargs)

        def lazy_initialization(self, *args, **kwargs):
            # K/V: (key_states, value_states); the state: keyword arguments only
            if args:
                return cls.lazy_initialization(self, *args, **kwargs)
            return linear.lazy_initialization(self, **kwargs)

        _WITH_STATE[cls] = type(f"Hybrid{cls.__name__}", (cls, linear),
                                {"__init__": __init__,
                                 "lazy_initialization": lazy_initialization})
    return _WITH_STATE[cls]


class CompressedLayer(HistoryLayer):
    """A transformers cache layer whose history is packed low-bit codes (see module doc)."""

    def __init__(self, setting: LayerKV, layer_idx: int, head_dim: int, *,
                 scale_dtype: str = "float16", fp_dtype: str = "float16",
                 protect: ProtectSettings | None = None, balancer: torch.Tensor | None = None,
                 sliding_window: int | None = None, rotation: torch.Tensor | None = None,
                 session=None, write_first: bool = False,
                 kv_shared: bool = False):
        super().__init__(layer_idx, head_dim, session, sliding_window, kv_shared)
        self.setting = setting
        self.flush_every = layout.flush_every(setting)  # 0 = never flush (nothing quantized)
        self.evicts = layout.evicts(setting)  # a sliding layer drops what it no longer sees
        fp = None if fp_dtype == "exact" else getattr(torch, fp_dtype)  # None: the model's
        # keys and values that are one latent row (MLA) stored alike: one store and one window
        self.shares = layout.shares_storage(
            setting, kv_shared, head_dim,
            balancer=balancer is not None or (protect is not None and protect.balancer == "online"))
        self.kstore, self.vstore = (self._store(spec, head_dim, scale_dtype, fp)
                                    for spec in (setting.key, setting.value))
        self.res_k, self.res_v = DenseTensor(fp, "window"), DenseTensor(fp, "window")
        if self.shares:
            self.vstore, self.res_v = self.kstore, self.res_k
        self.fp_dtype = fp
        self.q_start = 0  # first packed position (a sliding layer evicts whole blocks)
        self.res_start = 0  # first window position
        self.protect = protect if setting.compressed else None
        # Only a layer that really balances its keys conflicts with pre-RoPE storage: with fixed
        # balancers (e.g. from `recommend`) other layers may store keys before RoPE.
        mode = protect.balancer if protect is not None else "off"
        uses_balancer = mode == "online" or (mode == "fixed" and balancer is not None)
        if uses_balancer and setting.pre_rope_keys:
            raise ConfigError("The key-channel balancer cannot be combined with pre-RoPE keys "
                              "(RoPE mixes the balanced channel pairs); disable one of them.")
        self.balancer = balancer  # [Hkv, D]; k*b stored, q/b used
        self.want_online_balancer = (self.protect is not None and self.protect.balancer == "online"
                                     and self.setting.key is not None and balancer is None)
        # the set's policy (kvlens.cache.sets; None: no set) and its rows
        self.set_policy = set_policy(self.protect) if not self.is_sliding else None
        self.hp_k, self.hp_v = (SetRows(fp, head_dim) if self.set_policy is None else
                                self.set_policy.new_rows(fp, head_dim) for _ in range(2))
        self.hp_pos = None  # [B, Hkv, K] int32
        # pre-RoPE keys: positions of held tokens [B, N - q_start] int32, and the RoPE re-creator
        self.stores_pre_rope = setting.pre_rope_keys and setting.key is not None
        self.positions: torch.Tensor | None = None
        # Hadamard rotation [D, D] float32 (shared by the layers): keys/values stored rotated
        self.rotation = rotation if setting.rotates else None
        if setting.rotates and rotation is None:
            raise ConfigError(f"layer {layer_idx} rotates keys or values but no rotation matrix "
                              "was given (build the cache with compressed_attention).")
        self.rope = None  # kvlens.rope.RopeFrequencies
        self.rope_options: list | None = None
        # KVConfig.write_before_attention: after the first forward, code the new tokens before
        # attending to them (needs no window and no set: validated by KVConfig)
        self.write_first = write_first and bool(self.flush_every)

    def _store(self, spec, head_dim: int, scale_dtype: str, fp) -> Store:
        """The history store of one tensor: its layout's (``kvlens.layouts``; the spec was
        checked against the layer by ``kvlens.config.validate_for``), or full precision at ``fp``
        when ``spec`` is ``None``."""
        if spec is None:
            return DenseTensor(fp)
        return layout_of(spec).new_store(head_dim, self.flush_every, scale_dtype)

    # -- transformers interface -----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.begin_update(key_states, value_states)
        t = key_states.shape[2]
        cap = self.setting.residual_tokens if self.flush_every else 0
        self.res_k.append(self.to_stored_basis(key_states, self.setting.rotate_keys), capacity=cap)
        if not self.shares:
            self.res_v.append(self.to_stored_basis(value_states, self.setting.rotate_values),
                              capacity=cap)
        if self.stores_pre_rope:
            self._record_positions(key_states.shape[0], t)
        first = self.cumulative_length == 0
        self.cumulative_length += t
        if self.write_first and not first:  # read back compressed by this forward's attention
            n = layout.flush_count(self.n_res, self.setting.residual_tokens, self.flush_every)
            if n:
                self._flush(n)
        key_states = key_states.view_as(key_states)  # a fresh tensor object to tag
        setattr(key_states, LAYER_ATTR, self)
        return key_states, value_states

    def to_stored_basis(self, x: torch.Tensor, rotated: bool) -> torch.Tensor:
        """``x R`` when this tensor is stored rotated (queries go through this too), else x."""
        if not rotated:
            return x
        return (x.float() @ self.rotation).to(x.dtype)

    def from_stored_basis(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[..., D]`` back from the rotated value basis (``out R^T``)."""
        if not self.setting.rotate_values:
            return out
        return (out.float() @ self.rotation.T).to(out.dtype)

    def _record_positions(self, b: int, t: int) -> None:
        """Keep the RoPE positions of the new tokens, checking that the model's RoPE can be
        re-created from them."""
        cos0, _, pos = self.session.rope.get(self.layer_idx, (None, None, None))
        if cos0 is None:
            raise ConfigError("pre-RoPE keys need the layer's RoPE tables, which this model "
                              "does not pass to its attention modules; use post-RoPE keys "
                              "(pre_rope_keys: false).")
        if pos is None:  # not passed to attention (Llama 4): the cache positions, checked below
            pos = torch.arange(self.cumulative_length, self.cumulative_length + t,
                               device=cos0.device)[None]
        # the call's tables, normalised (their form checked against the model's, model.rotary)
        tables = self.session.rope.tables(self.layer_idx, self.head_dim)
        if tables is None:
            raise ConfigError(f"pre-RoPE keys: layer {self.layer_idx} applies no RoPE (a NoPE "
                              "layer), so its keys have no pre-RoPE form; use post-RoPE keys "
                              "there (pre_rope_keys: false).")
        pos = pos[:, -t:].expand(b, t).to(torch.int32)
        cos, sin = (x[:, -t:].expand(b, t, -1) for x in (tables.cos, tables.sin))
        # Keep every (frequencies, layout) that reproduces all tables seen so far: a prompt of
        # one token (position 0) fits any of them.
        if self.rope_options is None:
            self.rope_options = [r for r in RopeFrequencies.all_matching(
                self.session.rope_candidates) if r.layout == tables.layout]
        self.rope_options = [r for r in self.rope_options if r.reproduces(cos, sin, pos)]
        if not self.rope_options:
            raise ConfigError(f"pre-RoPE keys: layer {self.layer_idx}'s RoPE tables cannot be "
                              "re-created from positions and the model's rotary frequencies "
                              "(a dynamic or unusual RoPE); use post-RoPE keys "
                              "(pre_rope_keys: false).")
        self.rope = self.rope_options[0]
        self.positions = pos if self.positions is None else torch.cat((self.positions, pos), 1)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for store in self._stores(self.kstore, self.vstore, self.res_k, self.res_v, self.hp_k,
                                  self.hp_v):
            store.select_batch(indices)
        for name in ("hp_pos", "positions"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[indices])
        if self.set_policy is not None:
            self.set_policy.select_batch(indices)

    # -- state ----------------------------------------------------------------------------------
    @property
    def quantized_length(self) -> int:
        """Tokens held in the packed store (positions ``[q_start, q_end)``)."""
        return self.kstore.length

    @property
    def q_end(self) -> int:
        return self.q_start + self.kstore.length

    @property
    def n_res(self) -> int:
        return self.res_k.length

    @property
    def has_hp(self) -> bool:
        return self.hp_pos is not None and self.hp_pos.shape[-1] > 0

    @property
    def sink_end(self) -> int:
        """A set that is the packed prefix (no mask) hides packed positions
        ``[q_start, sink_end)``."""
        if self.set_policy is None or self.set_policy.masked or not self.has_hp:
            return self.q_start
        return self.q_start + self.hp_pos.shape[-1]

    @property
    def set_mask(self) -> torch.Tensor | None:
        """``[B, Hkv, q_end]`` bool: the packed positions a masked set hides (else ``None``)."""
        return None if self.set_policy is None else self.set_policy.mask

    @property
    def needs_attention_probs(self) -> bool:
        # sinks are chosen by position: only a policy that reads the attention mass needs it
        return self.set_policy is not None and self.set_policy.needs_attention_probs

    def rope_tables(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` float32 ``[B, t1 - t0, R]`` of absolute positions ``[t0, t1)``."""
        pos = self.positions[:, t0 - self.q_start:t1 - self.q_start]
        return self.rope.tables(pos)

    # -- after attention ------------------------------------------------------------------------
    def commit(self, query: torch.Tensor, colsum: torch.Tensor | None) -> None:
        """Called by the attention function after it attended to this step's tokens: query ``[B,
        Hq, Tq, D]``; colsum ``[B, Hkv, N]`` the attention mass each position received (or None)."""
        if self.want_online_balancer:
            self.balancer = fit_balancer(query, self.res_k.view().float(),
                                         exponent=self.protect.balancer_exponent)
            self.want_online_balancer = False
        if colsum is not None:
            self.set_policy.observe(colsum)
        n = layout.flush_count(self.n_res, self.setting.residual_tokens, self.flush_every)
        if n:
            self._flush(n)
        self._evict()

    def _flush(self, n: int) -> None:
        t0 = self.q_end
        k = self.res_k.view(0, n)
        v = self.res_v.view(0, n)
        k_store = k.float()
        if self.stores_pre_rope:
            cos, sin = self.rope_tables(t0, t0 + n)
            k_store = invert_rope(k.float(), cos, sin, self.rope.layout)
        if self.balancer is not None and self.setting.key is not None:
            k_store = k_store.float() * self.balancer.float().unsqueeze(-2)
        k_store = k_store if self.setting.key is not None else k
        v_store = v.float() if self.setting.value is not None else v
        pairs = ((self.kstore, k_store), (self.vstore, v_store))
        for store, x in pairs[:1] if self.shares else pairs:
            store.append(x)
        if self.set_policy is not None:
            self._choose_set(t0, n, k, v)
        # The window keeps the rest (at most R-1 tokens) in a buffer of R tokens again.
        for res in self._stores(self.res_k, self.res_v):
            res.drop_front(n, self.setting.residual_tokens)
        self.res_start += n

    def _evict(self) -> None:
        """Sliding-window layer: drop what no later query can see (whole packed blocks, or the
        window's oldest tokens when nothing is quantized)."""
        if not self.evicts:
            return
        dead = layout.evict_boundary(self.cumulative_length, self.sliding_window)
        f = self.flush_every
        n = min(self.kstore.length, (dead - self.q_start) // f * f) if f else dead - self.res_start
        if n <= 0:
            return
        stores = (self.kstore, self.vstore) if f else (self.res_k, self.res_v)
        for store in self._stores(*stores):
            store.drop_front(n)
        if f:
            self.q_start += n
        else:
            self.res_start += n
        if self.positions is not None:
            self.positions = self.positions[:, n:].clone()

    def _choose_set(self, t0: int, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Re-choose the set among the current set and the flushed block ``[t0, t0 + n)``
        (its policy's ``size`` and ``choose``)."""
        b, h = k.shape[:2]
        end = t0 + n
        pos_new = torch.arange(t0, end, device=k.device, dtype=torch.int32).expand(b, h, n)
        cand_pos = pos_new if self.hp_pos is None else torch.cat((self.hp_pos, pos_new), dim=-1)
        cand_k, cand_v = self.hp_k.candidates(k), self.hp_v.candidates(v)
        keep = min(cand_pos.shape[-1], self.set_policy.size(0, end))
        idx = self.set_policy.choose(cand_pos, keep, end)
        self.hp_pos = cand_pos.gather(-1, idx)
        self.hp_k.choose(cand_k, idx)
        self.hp_v.choose(cand_v, idx)

    @staticmethod
    def _stores(*stores) -> list:
        """The distinct stores among ``stores`` (a shared key/value store once)."""
        return list({id(s): s for s in stores}.values())

    # -- accounting -----------------------------------------------------------------------------
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(part, tensor)`` for every tensor this layer holds (parts of
        ``kvlens.cache.layout``); ``memory_report`` counts their storages."""
        out = []
        for store in self._stores(self.kstore, self.vstore, self.res_k, self.res_v):
            out += list(store.named_tensors().items())
        out += [("sets", t) for t in self.hp_k.parts + self.hp_v.parts]
        if self.set_policy is not None:
            out += self.set_policy.named_tensors()
        for part, name in (("positions", "hp_pos"),
                           ("positions", "positions"), ("balancers", "balancer"),
                           ("rotations", "rotation"),
                           ("dense", "keys"), ("dense", "values")):
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor):
                out.append((part, t))
        return out
