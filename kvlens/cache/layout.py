"""What a compressed cache holds, part by part, after ``N`` tokens: the one description of its
bytes that the cache, ``memory_report``, ``config_bits`` and ``recommend``'s budget share.

The cache (``kvlens.cache.layer``) calls the streaming rules here (``flush_every``,
``flush_count``, ``evict_boundary``); ``layer_part_bytes`` predicts the bytes of every tensor a
layer holds from the same rules and each store's layout (``Layout.part_bytes``), and tests
check it against the bytes real caches hold. State after ``N`` tokens (any chunking), with ``R``
the residual window, ``F`` the flush block and ``W`` a sliding window:

- quantized ``Q(N) = ceil((N - R + 1) / F) * F`` when ``N >= R`` (else 0; ``R = 0``: ``floor(N /
  F) * F``); an uncompressed layer quantizes nothing;
- sliding layers drop positions ``< N - W + 1``: whole packed blocks, or, uncompressed, the
  oldest window tokens (keeping the last ``W - 1``, as transformers and engines do), unless a
  store's layout keeps them (``evicts``: ``hqq-strided``, as transformers' HQQ layers do);
- the window holds ``n_res = N - Q`` tokens in a buffer of ``max(R, n_res)`` (uncompressed:
  ``n_res``); the stores hold exactly their tokens.

Parts (``PARTS``): ``codes``, ``scales``, ``zeros`` (symmetric specs store their zero too),
``dense`` (an unquantized tensor beside a quantized one), ``window``, ``sets`` (the set's rows,
``SetPolicy.row_bytes`` each; global layers only), ``positions`` (int32: the set's, and every
held token's for pre-RoPE keys), ``masks`` and ``accumulators`` (``SetPolicy.state_bytes``),
``balancers`` (float32 ``[Hkv, D]``), ``norms`` (codebook keys), ``rotations`` (one float32
``[D, D]`` matrix per device with a rotating layer) and ``blocks`` (ggml). Engine-format layers
(``engine_layer_bytes``) hold every token they can attend to in their types, with no window and
no rotation matrix (llama.cpp keeps those outside its KV buffer). MLA models (``kv_shared``)
keep one store and one window for both where ``shares_storage`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvlens.cache.sets import set_policy
from kvlens.config import FP_BYTES
from kvlens.layouts import layout_of
from kvlens.model.architecture import describe
from kvlens.model.placement import layer_devices
from kvlens.model.shape import ModelShape
from kvlens.quant import ds_mla
from kvlens.quant.cachetypes import DenseType, scale_count

PARTS = ("codes", "scales", "zeros", "dense", "window", "sets", "positions", "masks",
         "accumulators", "balancers", "rotations", "blocks", "norms")
POSITION_BYTES = 4  # int32


# -- streaming rules (the cache calls these) -----------------------------------------------------

def flush_every(setting) -> int:
    """``F`` of a layer: tokens quantized together (0 = nothing is ever quantized)."""
    if not setting.compressed:
        return 0
    return max(layout_of(s).flush_block(setting.residual_tokens, setting.flush_tokens)
               for s in (setting.key, setting.value) if s is not None)


def flush_count(n_res: int, residual: int, flush: int) -> int:
    """Tokens to move from the window to the packed store when it holds ``n_res``: the fewest
    whole blocks that leave fewer than ``R`` tokens (``R = 0``: every whole block)."""
    if flush == 0:
        return 0
    if residual:
        over = n_res - residual + 1
        return -(-over // flush) * flush if over > 0 else 0
    return n_res // flush * flush


def evict_boundary(tokens: int, sliding_window: int | None) -> int:
    """Positions below this are invisible to every later query of a sliding layer."""
    if sliding_window is None:
        return 0
    return max(0, tokens - sliding_window + 1)


def evicts(setting) -> bool:
    """Whether a sliding-window layer of ``setting`` drops what it no longer sees: not when a
    store's layout keeps those tokens (its optional ``keeps_evicted = True``: a layout simulating
    a cache that never drops them and whose groups span them, ``hqq-strided``); the mask hides
    them."""
    return not any(getattr(layout_of(s), "keeps_evicted", False)
                   for s in (setting.key, setting.value) if s is not None)


@dataclass(frozen=True)
class StreamState:
    """Where the ``N`` tokens of one layer are (absolute positions)."""

    tokens: int
    q_start: int  # first position held in the packed store (earlier ones were evicted)
    q_end: int  # positions [q_start, q_end) are packed
    res_start: int  # positions [res_start, tokens) are in the window
    window_capacity: int

    @property
    def q_held(self) -> int:
        return self.q_end - self.q_start

    @property
    def n_res(self) -> int:
        return self.tokens - self.res_start


def stream_state(setting, tokens: int, sliding_window: int | None = None) -> StreamState:
    f = flush_every(setting)
    r = setting.residual_tokens
    q_end = flush_count(tokens, r, f)  # from an empty window: the rule is chunking-independent
    dead = evict_boundary(tokens, sliding_window if evicts(setting) else None)
    if f:
        q_start = min(q_end, dead // f * f)
        res_start = q_end
    else:
        q_start = 0
        res_start = dead
    n_res = tokens - res_start  # the window buffer keeps room for R tokens once compressed
    return StreamState(tokens, q_start, q_end, res_start, max(r, n_res) if f else n_res)


# -- bytes ---------------------------------------------------------------------------------------

def shares_storage(setting, kv_shared: bool, head_dim: int, *, balancer: bool = False) -> bool:
    """Whether a layer keeps its keys and values in **one** store: they are one tensor
    (``kv_shared``: an MLA latent row) stored alike (the same spec or engine type and rotation, no
    transform of the keys alone: pre-RoPE, balancer)."""
    if not kv_shared:
        return False
    if setting.engine:
        return engine_types_share(setting.key_type, setting.value_type, kv_shared, head_dim)
    return (setting.key == setting.value and setting.rotate_keys == setting.rotate_values
            and not setting.pre_rope_keys and not balancer)


def engine_types_share(key_type, value_type, kv_shared: bool, head_dim: int) -> bool:
    """``shares_storage`` for an engine-format layer: one type for both, not rotated (llama.cpp
    rotates keys and values differently), no static scale (calibrated per tensor)."""
    return kv_shared and key_type == value_type and not key_type.rotates(head_dim) and \
        scale_count(key_type, 1) == 0


def layer_part_bytes(setting, *, tokens: int, head_dim: int, kv_heads: int, batch: int = 1,
                     fp_bytes: int = 2, scale_dtype: str = "float16", protect=None,
                     balancer: bool = False, sliding_window: int | None = None,
                     kv_shared: bool = False) -> dict[str, int]:
    """Bytes of every part one ``CompressedLayer`` holds after ``tokens`` tokens; ``protect``:
    the layer's ``ProtectSettings`` (its set's policy; ignored for uncompressed layers),
    ``balancer``: it stores a float32 ``[Hkv, D]`` balancer, ``kv_shared``: MLA
    (``shares_storage``)."""
    parts = dict.fromkeys(PARTS, 0)
    if tokens == 0:
        return parts
    st = stream_state(setting, tokens, sliding_window)
    f = flush_every(setting)
    rows = batch * kv_heads
    one = shares_storage(setting, kv_shared, head_dim, balancer=balancer)
    for spec in (setting.key,) if one else (setting.key, setting.value):
        if spec is None:
            parts["dense"] += rows * st.q_held * head_dim * fp_bytes
        else:
            for part, n in layout_of(spec).part_bytes(st.q_held, head_dim, f,
                                                      scale_dtype).items():
                parts[part] += rows * n
    parts["window"] = (1 if one else 2) * rows * st.window_capacity * head_dim * fp_bytes
    policy = set_policy(protect) if setting.compressed and sliding_window is None else None
    if policy is not None:
        k = policy.size(st.q_start, st.q_end)
        parts["sets"] = 2 * rows * k * policy.row_bytes(head_dim, fp_bytes)
        parts["positions"] += rows * k * POSITION_BYTES
        for part, n in policy.state_bytes(rows, st.q_held, tokens - st.q_start).items():
            parts[part] += n
    if setting.pre_rope_keys and setting.key is not None:
        parts["positions"] += batch * (tokens - st.q_start) * POSITION_BYTES
    if balancer and setting.key is not None:
        parts["balancers"] = kv_heads * head_dim * 4
    return parts


def shape_of(model) -> ModelShape:
    """``ModelShape`` of a loaded model (``describe``) with the devices its layers run on:
    what its cache's bytes depend on besides the config and the tokens."""
    devices = tuple(str(d) for d in layer_devices(model))
    return replace(describe(model), devices=devices if len(set(devices)) > 1 else ())


def engine_tensor_bytes(ctype, held: int, head_dim: int, kv_heads: int, batch: int = 1
                        ) -> dict[str, int]:
    """Bytes by part of one tensor (K or V) of ``held`` tokens in engine cache type ``ctype``
    (``kvlens.quant.cachetypes``)."""

    parts = dict.fromkeys(PARTS, 0)
    rows = batch * kv_heads * held
    if held == 0:
        return parts
    if isinstance(ctype, DenseType):
        parts["dense"] = rows * head_dim * ctype.element_bytes
        return parts
    fmt = ctype.format
    if fmt.family == "ggml":
        parts["blocks"] = rows * head_dim // fmt.block_size * fmt.block_bytes
    elif fmt.family == "fp8":
        parts["codes"] = rows * head_dim
        parts["scales"] = scale_count(ctype, kv_heads) * 4
    elif fmt.family == "ds-mla":  # fp8 latent tiles, a float32 scale each, bf16 RoPE channels
        rope, latent = fmt.split(head_dim)
        parts["codes"] = rows * latent
        parts["scales"] = rows * latent // ds_mla.TILE * ds_mla.SCALE_BYTES
        parts["dense"] = rows * rope * ds_mla.ROPE_BYTES
    else:  # dynamic per-token-head: packed codes + a float32 scale per token and head
        parts["codes"] = rows * -(-head_dim * fmt.code_bits // 8)
        parts["scales"] = rows * 4
    return parts


def engine_layer_bytes(setting, *, tokens: int, head_dim: int, kv_heads: int, batch: int = 1,
                       sliding_window: int | None = None, kv_shared: bool = False
                       ) -> dict[str, int]:
    """Bytes of every part one ``EngineLayer`` holds after ``tokens`` tokens (any chunking);
    one store where ``shares_storage`` says so (``kv_shared``: MLA)."""
    held = tokens - evict_boundary(tokens, sliding_window)
    total = dict.fromkeys(PARTS, 0)
    one = shares_storage(setting, kv_shared, head_dim)
    for ctype in (setting.key_type,) if one else (setting.key_type, setting.value_type):
        for k, v in engine_tensor_bytes(ctype, held, head_dim, kv_heads, batch).items():
            total[k] += v
    return total


def layer_arguments(config, shape: ModelShape, i: int, tokens: int, batch: int) -> dict:
    """The keywords of ``layer_part_bytes`` for layer ``i`` of ``config`` on ``shape``."""
    protect = config.protect_for(i)
    balancer = protect is not None and (protect.balancer == "online" or
                                     (protect.balancer == "fixed" and i in config.balancers))
    # fp_dtype "exact": the model's dtype (any other a KVConfig holds is one of FP_BYTES)
    fp = shape.dtype_bytes if config.fp_dtype == "exact" else FP_BYTES[config.fp_dtype]
    return dict(tokens=tokens, head_dim=shape.head_dim, kv_heads=shape.num_key_value_heads,
                batch=batch, fp_bytes=fp,
                scale_dtype=config.scale_dtype, protect=protect,
                balancer=balancer and config.layer(i).compressed,
                sliding_window=shape.window(i), kv_shared=shape.kv_shared)


def _layer_parts(config, shape: ModelShape, i: int, tokens: int, batch: int) -> dict[str, int]:
    setting = config.layer(i)
    if setting.engine:
        return engine_layer_bytes(setting, tokens=tokens, head_dim=shape.head_dim,
                                  kv_heads=shape.num_key_value_heads, batch=batch,
                                  sliding_window=shape.window(i), kv_shared=shape.kv_shared)
    return layer_part_bytes(setting, **layer_arguments(config, shape, i, tokens, batch))


def rotation_devices(config, shape: ModelShape) -> list[str]:
    """Devices holding a copy of the shared rotation matrix: one per device with a layer that
    rotates (layers on the same device share it)."""
    return list(dict.fromkeys(shape.device(i) for i in shape.attention_layers
                              if config.layer(i).rotates))


def config_part_bytes(config, shape: ModelShape, tokens: int, batch: int = 1
                      ) -> dict[str, int]:
    """Bytes by part of a whole cache for ``config`` after ``tokens`` tokens."""
    total = dict.fromkeys(PARTS, 0)
    for i in shape.attention_layers:
        for k, v in _layer_parts(config, shape, i, tokens, batch).items():
            total[k] += v
    total["rotations"] = len(rotation_devices(config, shape)) * shape.head_dim ** 2 * 4
    return total


def config_device_bytes(config, shape: ModelShape, tokens: int, batch: int = 1
                        ) -> dict[str, int]:
    """Held bytes per device (``shape.devices``; ``"all"`` when unset) after ``tokens``
    tokens: each layer's parts where it runs, a rotation copy on each rotating device."""
    out: dict[str, int] = {}
    for i in shape.attention_layers:
        dev = shape.device(i)
        out[dev] = out.get(dev, 0) + sum(_layer_parts(config, shape, i, tokens, batch).values())
    for dev in rotation_devices(config, shape):
        out[dev] += shape.head_dim ** 2 * 4
    return out


def config_bits(config, shape: ModelShape, tokens: int, batch: int = 1) -> float:
    """Held bits per K/V element of ``config`` after ``tokens`` tokens, relative to what an fp16
    cache holds for the same tokens (16.0 = as big as fp16)."""
    held = sum(config_part_bytes(config, shape, tokens, batch).values())
    return 16.0 * held / shape.fp16_bytes(tokens, batch)
