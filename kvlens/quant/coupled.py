"""Coupled (vector) quantization of keys and values: ``c`` channels coded jointly by one index.

Reference for "KV Cache is 1 Bit Per Channel" (Zhang et al., NeurIPS 2024, "CQ"). Tensors are
``[B, H, T, D]`` at every public function. Each ``[D]`` vector (one token of one KV head) is cut
into ``D / c`` *channel groups* of ``c`` channels; each group is stored as one ``b``-bit index
into a codebook of ``2^b`` centroids in ``R^c``. No per-group scale or zero is stored: the
codebook, fitted on calibration data, carries the range. Bits per channel are ``b / c``
(``c=4, b=8``: 2.0; ``c=4, b=10``: 2.5; ``c=2, b=6``: 3.0). Coupling pays where channels are
dependent: the joint entropy of ``c`` channels grows slower than the sum of their marginal
entropies, and a joint codebook spends its points where the joint density is, which ``c``
scalar codes (a product grid) cannot.

``CoupledSpec`` says how (frozen, versioned JSON):

- ``grouping``: which channels share a group. ``"consecutive"`` (channels ``[j c, (j+1) c)``),
  ``"correlation"`` (per KV head, channels permuted so each group holds strongly correlated
  channels: the most correlated free pair by ``|corr|`` starts a group, which then takes the
  free channel with the highest mean ``|corr|`` to its members until it has ``c``; the
  permutation is stored, one byte per channel and head) or ``"hadamard"`` (consecutive groups of
  the Hadamard-rotated vector ``x R``, ``kvlens.quant.rotation``; nothing stored).
- ``scope``: which vectors share a codebook. ``"layer"``: one per layer (every channel group of
  every head); ``"group"``: one per layer and channel group, shared by the KV heads; ``"head"``:
  one per layer, KV head and channel group (CQ's: its groups are cut from the layer's
  concatenated heads, so each lies in one head).
- ``weighted`` (keys): the squared error of channel ``d`` is weighted by ``w_d = mean(q_d²)``
  over the query tokens and the query heads reading that KV head (in the grouping's basis,
  normalised to mean 1 per head), in the fit *and* in the encoder's nearest-centroid search. A
  key error ``e`` moves a score by ``q · e``; with independent errors its expected square is
  ``Σ_d w_d e_d²`` (CQ's Fisher-guided centroid learning, with the query's second moment as
  the Fisher proxy, as ``kvlens.quant.codebook``'s ``"weighted"`` fit).

Fitting (``fit_coupled``) is weighted k-means in float32, per codebook: k-means++ initialisation
drawn from a CPU generator seeded with ``spec.seed``, then exactly ``spec.iters`` Lloyd rounds
(assign each point to the centroid of least weighted squared distance; move each centroid to
the weighted mean of its points, per coordinate; an empty cell keeps its centroid). Centroids are
rounded to float16 (what is stored). The same inputs and seed give the same codebooks.

Storage, counted once in ``CoupledSpec.held_bytes``: per vector ``ceil((D / c) b / 8)`` bytes of
indices, packed densely (``pack_indices``: a little-endian bit stream, index ``j`` at bits
``[j b, (j+1) b)``); per codebook ``2^b · c`` float16 centroids; for ``"correlation"`` one byte
per channel and KV head of permutation; for ``weighted`` one float16 channel weight per channel
and KV head (the encoder's nearest-centroid search needs them, so a cache holds them). The codebooks are per model (fitted once on calibration
text), so their bytes do not grow with the context; ``bits_per_element`` amortises them over a
stated number of tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvlens.errors import ConfigError, InputError, is_int
from kvlens.quant.rotation import hadamard_rotation, rotate, unrotate
from kvlens.quant.spec import check_versioned_dict

COUPLED_SPEC_VERSION = 1
COUPLED_CHANNELS = (2, 4, 8)
GROUPINGS = ("consecutive", "correlation", "hadamard")
SCOPES = ("layer", "group", "head")
MIN_INDEX_BITS, MAX_INDEX_BITS = 1, 16
DEFAULT_ITERS = 20
CENTROID_BYTES = 2  # float16
PERMUTATION_BYTES = 1  # one uint8 channel index per channel and KV head (head_dim <= 256)
WEIGHT_BYTES = 2  # weighted: one float16 channel weight per channel and KV head
_CHUNK = 1 << 24  # distance-matrix entries computed at once in the nearest-centroid search
_FIELDS = ("channels", "index_bits", "grouping", "scope", "weighted", "iters", "seed")
# short names of the options in a setting name ("c4b8+corr+head+weighted")
_NAME_OPTIONS = {"corr": ("grouping", "correlation"), "hadamard": ("grouping", "hadamard"),
                 "layer": ("scope", "layer"), "head": ("scope", "head"),
                 "weighted": ("weighted", True)}


@dataclass(frozen=True)
class CoupledSpec:
    """A coupled quantization config for ``[B, H, T, D]`` tensors (frozen, versioned JSON).

    channels: ``c``, channels coded jointly (2, 4 or 8; must divide head_dim).
    index_bits: ``b``, bits of one group's index (1-16): ``2^b`` centroids per codebook, ``b/c``
        bits per channel.
    grouping: ``"consecutive"``, ``"correlation"`` or ``"hadamard"`` (module docstring).
    scope: ``"layer"``, ``"group"`` (default) or ``"head"``: what shares one codebook.
    weighted: keys: weight each channel's squared error by the queries' mean square there.
    iters: Lloyd rounds after the k-means++ start (a fixed number: deterministic cost).
    seed: seeds the k-means++ draws.
    """

    channels: int
    index_bits: int
    grouping: str = "consecutive"
    scope: str = "group"
    weighted: bool = False
    iters: int = DEFAULT_ITERS
    seed: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.channels, 1) or self.channels not in COUPLED_CHANNELS:
            raise ConfigError(f"Invalid coupled channels {self.channels!r}; allowed: "
                              f"{', '.join(map(str, COUPLED_CHANNELS))}.")
        if not is_int(self.index_bits, MIN_INDEX_BITS, MAX_INDEX_BITS):
            raise ConfigError(f"Invalid index bits {self.index_bits!r}; allowed: integers "
                              f"{MIN_INDEX_BITS}-{MAX_INDEX_BITS}.")
        if self.grouping not in GROUPINGS:
            raise ConfigError(f"Unknown grouping {self.grouping!r}; allowed: "
                              f"{', '.join(GROUPINGS)}.")
        if self.scope not in SCOPES:
            raise ConfigError(f"Unknown codebook scope {self.scope!r}; allowed: "
                              f"{', '.join(SCOPES)}.")
        if not isinstance(self.weighted, bool):
            raise ConfigError(f"Invalid weighted {self.weighted!r}; allowed: true, false.")
        if not is_int(self.iters, 0):
            raise ConfigError(f"Invalid Lloyd iterations {self.iters!r}; allowed: integers >= 0.")
        if not is_int(self.seed, 0):
            raise ConfigError(f"Invalid seed {self.seed!r}; allowed: integers >= 0.")

    @property
    def levels(self) -> int:
        return 1 << self.index_bits

    @property
    def bits_per_channel(self) -> float:
        """Index bits per coded element, ``b / c`` (no codebook)."""
        return self.index_bits / self.channels

    @property
    def name(self) -> str:
        """Canonical setting name, ``parse_coupled``'s inverse: ``c4b8``, ``c2b6+corr+head``."""
        parts = [f"c{self.channels}b{self.index_bits}"]
        parts += {"correlation": ["corr"], "hadamard": ["hadamard"]}.get(self.grouping, [])
        parts += [] if self.scope == "group" else [self.scope]
        parts += ["weighted"] if self.weighted else []
        return "+".join(parts)

    def check_fits(self, head_dim: int) -> None:
        """``ConfigError`` unless ``c`` divides ``head_dim`` (and Hadamard can rotate it)."""
        if not is_int(head_dim, 1) or head_dim % self.channels:
            raise ConfigError(f"Coupled {self.name}: {self.channels} channels per group do not "
                              f"divide head_dim {head_dim}; allowed channels: "
                              f"{', '.join(str(c) for c in COUPLED_CHANNELS if head_dim % c == 0)}"
                              " (or none).")
        if self.grouping == "hadamard":
            hadamard_rotation(head_dim)  # raises ConfigError for odd head_dim
        if self.grouping == "correlation" and head_dim > 256:
            raise ConfigError(f"Coupled {self.name}: the correlation permutation is stored in "
                              f"one byte per channel; head_dim {head_dim} > 256.")

    # -- storage: the one place bytes are counted ---------------------------------------------
    def num_codebooks(self, kv_heads: int, head_dim: int) -> int:
        groups = head_dim // self.channels
        return {"layer": 1, "group": groups, "head": kv_heads * groups}[self.scope]

    def codebook_bytes(self, kv_heads: int, head_dim: int) -> int:
        """Bytes of one layer's (one tensor's) codebooks, permutation and channel weights:
        ``2^b · c`` float16 per codebook, plus one byte per channel and KV head for
        ``"correlation"`` and two (float16) for ``weighted``."""
        books = self.num_codebooks(kv_heads, head_dim) * self.levels * self.channels
        perm = PERMUTATION_BYTES * kv_heads * head_dim if self.grouping == "correlation" else 0
        weights = WEIGHT_BYTES * kv_heads * head_dim if self.weighted else 0
        return books * CENTROID_BYTES + perm + weights

    def index_bytes(self, head_dim: int) -> int:
        """Packed index bytes of one ``[head_dim]`` vector: ``ceil((D / c) b / 8)``."""
        return -(-(head_dim // self.channels) * self.index_bits // 8)

    def held_bytes(self, num_tokens: int, kv_heads: int, head_dim: int, batch: int = 1) -> int:
        """Bytes one layer holds for one tensor of ``batch`` sequences of ``num_tokens`` tokens:
        the packed indices of every vector plus the layer's codebooks (once, not per sequence)."""
        vectors = batch * kv_heads * num_tokens
        return vectors * self.index_bytes(head_dim) + self.codebook_bytes(kv_heads, head_dim)

    def bits_per_element(self, num_tokens: int, kv_heads: int, head_dim: int,
                         batch: int = 1) -> float:
        """``held_bytes`` in bits per coded element: ``b / c`` plus the codebooks amortised over
        ``batch * num_tokens`` tokens."""
        elements = batch * kv_heads * num_tokens * head_dim
        return 8 * self.held_bytes(num_tokens, kv_heads, head_dim, batch) / elements

    def to_dict(self) -> dict[str, Any]:
        return {"version": COUPLED_SPEC_VERSION, **{k: getattr(self, k) for k in _FIELDS}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CoupledSpec:
        """Inverse of ``to_dict``; rejects unknown keys and other versions with ``ConfigError``."""
        check_versioned_dict(data, "coupled spec", COUPLED_SPEC_VERSION, _FIELDS)
        missing = [k for k in ("channels", "index_bits") if k not in data]
        if missing:
            raise ConfigError(f"Coupled spec is missing {', '.join(missing)}.")
        return cls(**{k: data[k] for k in _FIELDS if k in data})


def parse_coupled(name: object, iters: int = DEFAULT_ITERS, seed: int = 0) -> CoupledSpec:
    """``"c4b8+corr+head+weighted"`` -> ``CoupledSpec``: ``c<channels>b<index bits>`` then any of
    ``+corr`` / ``+hadamard`` (grouping; default consecutive), ``+layer`` / ``+head`` (scope;
    default one codebook per layer and channel group) and ``+weighted``."""
    allowed = ("c<2|4|8>b<1-16> optionally with " + " / ".join("+" + o for o in _NAME_OPTIONS)
               + ", e.g. c4b8, c2b6+corr+head")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"Invalid coupled setting {name!r}; allowed: {allowed}.")
    base, *opts = [p.strip().lower() for p in name.split("+")]
    c, sep, b = base.removeprefix("c").partition("b")
    if not base.startswith("c") or not sep or not c.isdigit() or not b.isdigit():
        raise ConfigError(f"Invalid coupled setting {name!r}; allowed: {allowed}.")
    kwargs: dict[str, Any] = {}
    for o in opts:
        if o not in _NAME_OPTIONS:
            raise ConfigError(f"Unknown coupled option {o!r} in {name!r}; allowed: {allowed}.")
        field_name, value = _NAME_OPTIONS[o]
        if kwargs.get(field_name, value) != value:
            raise ConfigError(f"Coupled setting {name!r} names two {field_name}s; give one.")
        kwargs[field_name] = value
    return CoupledSpec(int(c), int(b), iters=iters, seed=seed, **kwargs)


# -- packing ------------------------------------------------------------------------------------


def pack_indices(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` ``[..., G]`` (each ``< 2^bits``) densely along the last dimension:
    uint8 ``[..., ceil(G bits / 8)]``, a little-endian bit stream (index ``j`` at bits
    ``[j bits, (j+1) bits)``, zero padding at the end). For 1-8 bits and ``G`` a multiple of the
    packing unit this is ``kvlens.quant.packing.pack_codes``' byte layout."""
    if not is_int(bits, MIN_INDEX_BITS, MAX_INDEX_BITS):
        raise ConfigError(f"Cannot pack {bits!r}-bit indices; allowed: 1-16.")
    c = codes.long()
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise InputError(f"An index does not fit in {bits} bits (0-{(1 << bits) - 1}).")
    shifts = torch.arange(bits, device=c.device)
    stream = ((c[..., None] >> shifts) & 1).reshape(*c.shape[:-1], -1)
    pad = -stream.shape[-1] % 8
    if pad:
        stream = torch.cat((stream, stream.new_zeros(*stream.shape[:-1], pad)), dim=-1)
    stream = stream.reshape(*stream.shape[:-1], -1, 8)
    return (stream << torch.arange(8, device=c.device)).sum(-1).to(torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of ``pack_indices``: int32 ``[..., length]``. Index ``j`` starts at bit
    ``s = j bits`` and spans at most three bytes (``bits <= 16``, ``s mod 8 <= 7``): those bytes
    are gathered, joined little-endian into one int32 word, shifted right by ``s mod 8`` and
    masked (three gathers of ``length`` entries, no per-bit tensor)."""
    if packed.dtype != torch.uint8:
        raise InputError(f"Packed indices must be uint8, got {packed.dtype}.")
    if not is_int(bits, MIN_INDEX_BITS, MAX_INDEX_BITS):
        raise ConfigError(f"Cannot unpack {bits!r}-bit indices; allowed: 1-16.")
    if packed.shape[-1] * 8 < length * bits:
        raise InputError(f"{packed.shape[-1]} bytes cannot hold {length} {bits}-bit indices.")
    start = torch.arange(length, device=packed.device) * bits
    first, shift = start // 8, (start % 8).to(torch.int32)
    raw = torch.nn.functional.pad(packed, (0, 2)).to(torch.int32)
    word = raw[..., first] | (raw[..., first + 1] << 8) | (raw[..., first + 2] << 16)
    return (word >> shift) & ((1 << bits) - 1)


# -- k-means ------------------------------------------------------------------------------------


def kmeans(points: torch.Tensor, levels: int, iters: int, seed: int = 0,
           weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted k-means of ``K`` independent point sets at once: ``points`` float ``[K, N, c]``,
    ``weights`` (None: all 1) broadcastable to it, per point *and* coordinate, so the distance is
    ``Σ_d w_d (p_d - C_d)²``. k-means++ start (CPU generator seeded with ``seed``), then exactly
    ``iters`` Lloyd rounds; an empty cell keeps its centroid. Returns float32 ``[K, levels, c]``.
    With fewer distinct points than ``levels`` some centroids coincide (harmless: they are never
    preferred over their twin)."""
    p = points.detach().float()
    if p.dim() != 3 or p.shape[1] == 0:
        raise InputError(f"k-means needs [K, N, c] points with N >= 1, got {tuple(p.shape)}.")
    if not is_int(levels, 1):
        raise ConfigError(f"Invalid number of centroids {levels!r}; allowed: integers >= 1.")
    w = None if weights is None else torch.broadcast_to(weights.detach().float(), p.shape)
    gen = torch.Generator().manual_seed(seed)
    c = _kmeans_pp(p, w, levels, gen)
    for _ in range(iters):
        c = _lloyd_step(p, w, c)
    return c


def _distances(p, w, c):
    """``[K, n, L]`` weighted squared distances up to a per-point constant (argmin-safe):
    ``Σ_d w_d C_d² - 2 w_d p_d C_d`` as one batched product of ``[w, w p]`` with ``[C², -2C]``
    (the ``[K, n, L]`` result is the cost: no second pass over it)."""
    if w is None:  # [1, p] with [Σ_d C_d², -2C]
        lhs, rhs = torch.cat([torch.ones_like(p[..., :1]), p], -1), (c * c).sum(-1, keepdim=True)
    else:
        lhs, rhs = torch.cat([w, w * p], -1), c * c
    return torch.bmm(lhs, torch.cat([rhs, -2 * c], -1).transpose(1, 2))


def nearest(p: torch.Tensor, c: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest centroid (least weighted squared distance) of every point:
    ``p`` ``[K, N, c]``, ``c`` ``[K, L, c]`` -> int64 ``[K, N]``; chunked over ``N``."""
    k, n, _ = p.shape
    step = max(1, _CHUNK // max(1, k * c.shape[1]))
    out = torch.empty(k, n, dtype=torch.int64, device=p.device)
    for s in range(0, n, step):
        ws = None if w is None else w[:, s:s + step]
        out[:, s:s + step] = _distances(p[:, s:s + step], ws, c).argmin(-1)
    return out


def _kmeans_pp(p, w, levels, gen):
    k, n, d = p.shape
    rows = torch.arange(k)
    first = torch.randint(0, n, (k,), generator=gen)
    c = p.new_empty(k, levels, d)
    c[:, 0] = p[rows, first]

    def dist(j):  # [K, N] weighted squared distance to centroid j
        diff = (p - c[:, j:j + 1]) ** 2
        return (diff if w is None else w * diff).sum(-1)

    best = dist(0)  # distance to the nearest chosen centroid
    draws = torch.rand(k, levels, generator=gen, dtype=torch.float64)
    for j in range(1, levels):
        cum = best.double().clamp_min(0).cumsum(-1)
        total = cum[:, -1:]
        # a draw proportional to the distance; all points chosen already (fewer distinct
        # points than centroids): a uniform draw
        target = draws[:, j:j + 1] * total
        pick = torch.searchsorted(cum, target, right=True).clamp_max(n - 1)[:, 0]
        uniform = (draws[:, j] * n).long().clamp_max(n - 1)
        pick = torch.where(total[:, 0] > 0, pick, uniform)
        c[:, j] = p[rows, pick]
        best = torch.minimum(best, dist(j))
    return c


def _lloyd_step(p, w, c):
    k, n, d = p.shape
    levels = c.shape[1]
    assign = nearest(p, c, w)  # [K, N]
    ww = torch.ones_like(p) if w is None else w
    index = (assign + torch.arange(k)[:, None] * levels).reshape(-1)
    both = torch.zeros(k * levels, 2 * d).index_add_(0, index,
                                                     torch.cat([ww, ww * p], -1).reshape(-1, 2 * d))
    mass, sums = both.reshape(k, levels, 2 * d).split(d, -1)
    return torch.where(mass > 0, sums / mass.clamp_min(1e-30), c)


# -- fit / encode / decode ----------------------------------------------------------------------


@dataclass(frozen=True)
class CoupledCodebooks:
    """One layer's (one tensor's) fitted coupled codebooks.

    centroids: float32 ``[num_codebooks, 2^b, c]`` (float16-rounded: what is stored), indexed as
        ``spec.scope`` says (``"layer"``: 1; ``"group"``: by channel group; ``"head"``: by
        ``head * (D / c) + group``).
    permutation: ``"correlation"``: int64 ``[H, D]``, the channels of head ``h`` in group order
        (group ``j`` holds channels ``permutation[h, j c:(j+1) c]``); else None.
    channel_weights: ``weighted``: float32 ``[H, D]`` in the grouping's basis (float16-rounded:
        what is stored); else None.
    """

    spec: CoupledSpec
    centroids: torch.Tensor
    kv_heads: int
    head_dim: int
    permutation: torch.Tensor | None = None
    channel_weights: torch.Tensor | None = None

    def held_bytes(self, num_tokens: int, batch: int = 1) -> int:
        return self.spec.held_bytes(num_tokens, self.kv_heads, self.head_dim, batch)

    def to(self, device) -> CoupledCodebooks:
        """The same codebooks with their tensors on ``device``."""
        def move(t):
            return None if t is None else t.to(device)

        return CoupledCodebooks(self.spec, self.centroids.to(device), self.kv_heads,
                                self.head_dim, move(self.permutation), move(self.channel_weights))


def coupled_codebooks(spec: CoupledSpec, centroids, kv_heads: int, head_dim: int,
                      permutation=None, channel_weights=None) -> CoupledCodebooks:
    """``CoupledCodebooks`` from stored arrays (a KV config's ``coupled_codebooks`` entry, or a
    cache's float16 / uint8 tensors): ``centroids`` ``[num_codebooks, 2^b, c]``, ``permutation``
    ``[H, D]`` (``"correlation"`` only), ``channel_weights`` ``[H, D]`` (``weighted`` only).
    Shapes are checked against ``spec``, ``kv_heads`` and ``head_dim`` (``ConfigError`` saying
    which); centroids and weights are float16-rounded, as stored."""
    spec.check_fits(head_dim)
    c = torch.as_tensor(centroids, dtype=torch.float32)
    want = (spec.num_codebooks(kv_heads, head_dim), spec.levels, spec.channels)
    if tuple(c.shape) != want:
        raise ConfigError(f"Coupled {spec.name} codebooks for {kv_heads} KV heads x head_dim "
                          f"{head_dim} must have shape [codebooks, centroids, channels] = "
                          f"{list(want)}, got {list(c.shape)}.")
    if not bool(torch.isfinite(c).all()):
        raise ConfigError(f"Coupled {spec.name} centroids must be finite numbers.")
    perm = weights = None
    for name, given, needed in (("permutation", permutation, spec.grouping == "correlation"),
                                ("channel weights", channel_weights, spec.weighted)):
        if needed != (given is not None):
            why = "needs" if needed else "takes no"
            raise ConfigError(f"Coupled {spec.name} {why} {name} (correlation grouping: a "
                              "permutation; weighted: channel weights).")
    if permutation is not None:
        perm = torch.as_tensor(permutation).long()
        ok = tuple(perm.shape) == (kv_heads, head_dim) and bool(
            (perm.sort(-1).values == torch.arange(head_dim)).all())
        if not ok:
            raise ConfigError(f"Coupled {spec.name} permutation must be {kv_heads} rows (one per "
                              f"KV head), each a permutation of 0-{head_dim - 1}.")
    if channel_weights is not None:
        weights = torch.as_tensor(channel_weights, dtype=torch.float32)
        if tuple(weights.shape) != (kv_heads, head_dim) or not bool(
                (torch.isfinite(weights) & (weights > 0)).all()):
            raise ConfigError(f"Coupled {spec.name} channel weights must be {kv_heads} rows (one "
                              f"per KV head) of {head_dim} positive finite numbers.")
        weights = weights.half().float()
    return CoupledCodebooks(spec, c.half().float(), kv_heads, head_dim, perm, weights)


def coupled_arrays(books: CoupledCodebooks) -> dict[str, Any]:
    """``books`` as plain nested lists (the JSON form of a KV config's ``coupled_codebooks``
    entry, ``coupled_codebooks``' inverse): ``centroids`` and, when the spec has them,
    ``permutation`` and ``weights``."""
    out: dict[str, Any] = {"centroids": books.centroids.half().float().tolist()}
    if books.permutation is not None:
        out["permutation"] = books.permutation.long().tolist()
    if books.channel_weights is not None:
        out["weights"] = books.channel_weights.half().float().tolist()
    return out


def _check(x: torch.Tensor, what: str = "tensor") -> None:
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] {what}, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise InputError(f"Expected a floating-point {what}, got {x.dtype}.")


def correlation_permutation(x: torch.Tensor, channels: int) -> torch.Tensor:
    """int64 ``[H, D]``: per head of ``x`` ``[B, H, T, D]``, the channels in group order, groups
    of ``channels`` built greedily from ``|corr|`` over batch and tokens (module docstring).
    A constant channel correlates with nothing (0)."""
    _check(x)
    b, h, t, d = x.shape
    if d % channels:
        raise ConfigError(f"{channels} channels per group do not divide head_dim {d}.")
    flat = x.detach().double().transpose(0, 1).reshape(h, b * t, d)
    flat = flat - flat.mean(1, keepdim=True)
    cov = flat.transpose(1, 2) @ flat
    sd = cov.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()
    corr = (cov / (sd[:, :, None] * sd[:, None, :]).clamp_min(1e-300)).abs()
    corr = torch.where(sd[:, :, None] * sd[:, None, :] > 0, corr, torch.zeros_like(corr))
    return torch.stack([_greedy_groups(corr[i], channels) for i in range(h)])


def _greedy_groups(corr: torch.Tensor, channels: int) -> torch.Tensor:
    d = corr.shape[0]
    free = torch.ones(d, dtype=torch.bool)
    order: list[int] = []
    eye = torch.eye(d, dtype=torch.bool)
    while free.any():
        pair_ok = free[:, None] & free[None, :] & ~eye
        masked = torch.where(pair_ok, corr, torch.full_like(corr, -1.0))
        i, j = divmod(int(masked.argmax()), d)  # ties: the lowest flat index (deterministic)
        group = [i, j]
        free[i] = free[j] = False
        while len(group) < channels:
            score = corr[group].mean(0)
            score = torch.where(free, score, torch.full_like(score, -1.0))
            nxt = int(score.argmax())
            group.append(nxt)
            free[nxt] = False
        order.extend(sorted(group))
    return torch.tensor(order, dtype=torch.int64)


def to_group_basis(x: torch.Tensor, spec: CoupledSpec, permutation) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` in the basis whose consecutive channels form the groups, float32
    (an orthogonal change of basis: a channel permutation per head, or the Hadamard rotation,
    so dot products are kept)."""
    if spec.grouping == "hadamard":
        return rotate(x, hadamard_rotation(x.shape[-1], None, x.device))
    if spec.grouping == "correlation":
        idx = permutation.to(x.device)[None, :, None, :].expand(x.shape)
        return torch.gather(x.float(), -1, idx)
    return x.float()


def from_group_basis(y: torch.Tensor, spec: CoupledSpec, permutation) -> torch.Tensor:
    """Inverse of ``to_group_basis``."""
    if spec.grouping == "hadamard":
        return unrotate(y, hadamard_rotation(y.shape[-1], None, y.device))
    if spec.grouping == "correlation":
        idx = permutation.to(y.device)[None, :, None, :].expand(y.shape)
        return torch.empty_like(y).scatter_(-1, idx, y)
    return y


def codebook_table(books: CoupledCodebooks) -> torch.Tensor:
    """The centroids per KV head and channel group, float32 ``[H, D / c, 2^b, c]`` (a view
    expanded from the stored codebooks for the ``"layer"`` and ``"group"`` scopes): group ``j``
    of head ``h`` decodes index ``i`` to ``codebook_table(books)[h, j, i]``, in the grouping's
    basis."""
    spec, h = books.spec, books.kv_heads
    groups = books.head_dim // spec.channels
    c = books.centroids.float()
    if spec.scope == "layer":
        return c.expand(h, groups, *c.shape[1:])
    if spec.scope == "group":
        return c[None].expand(h, *c.shape)
    return c.reshape(h, groups, *c.shape[1:])


def _as_points(y: torch.Tensor, spec: CoupledSpec) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[num_codebooks, N, c]``: the points each codebook codes."""
    b, h, t, d = y.shape
    g = y.reshape(b, h, t, d // spec.channels, spec.channels)
    if spec.scope == "layer":
        return g.reshape(1, -1, spec.channels)
    if spec.scope == "group":
        return g.permute(3, 0, 1, 2, 4).reshape(d // spec.channels, -1, spec.channels)
    return g.permute(1, 3, 0, 2, 4).reshape(h * d // spec.channels, b * t, spec.channels)


def _index_points(codes: torch.Tensor, spec: CoupledSpec) -> torch.Tensor:
    """Indices ``[B, H, T, D / c]`` -> ``[num_codebooks, N]``, in ``_as_points``' order."""
    b, h, t, groups = codes.shape
    if spec.scope == "layer":
        return codes.reshape(1, -1)
    if spec.scope == "group":
        return codes.permute(3, 0, 1, 2).reshape(groups, -1)
    return codes.permute(1, 3, 0, 2).reshape(h * groups, b * t)


def _from_points(p: torch.Tensor, spec: CoupledSpec, shape) -> torch.Tensor:
    """Inverse of ``_as_points`` (``p`` ``[num_codebooks, N, c']``, ``c'`` any width)."""
    b, h, t, d = shape
    groups, last = d // spec.channels, p.shape[-1]
    if spec.scope == "layer":
        return p.reshape(b, h, t, groups, last)
    if spec.scope == "group":
        return p.reshape(groups, b, h, t, last).permute(1, 2, 3, 0, 4)
    return p.reshape(h, groups, b, t, last).permute(2, 0, 3, 1, 4)


def query_weights(q: torch.Tensor, num_kv_heads: int, spec: CoupledSpec,
                  permutation=None) -> torch.Tensor:
    """float32 ``[Hkv, D]``: ``mean(q_d²)`` in the grouping's basis over batch, tokens and the
    query heads reading each KV head (GQA: query head ``h`` reads KV head ``h // groups``),
    normalised to mean 1 per KV head, and kept within float16's positive normal range (what the
    config stores: a channel the queries never read, as on Gemma3's layers, would round to 0)."""
    _check(q, "query tensor")
    b, hq, t, d = q.shape
    if hq % num_kv_heads:
        raise InputError(f"{hq} query heads are not a multiple of {num_kv_heads} KV heads.")
    if spec.grouping == "hadamard":
        q = rotate(q, hadamard_rotation(d, None, q.device))
    w = q.double().pow(2).mean(dim=(0, 2)).reshape(num_kv_heads, hq // num_kv_heads, d).mean(1)
    if spec.grouping == "correlation":
        w = torch.gather(w, -1, permutation.to(w.device))
    w = w / w.mean(-1, keepdim=True).clamp_min(1e-300)
    return w.clamp(float(torch.finfo(torch.float16).tiny),
                   float(torch.finfo(torch.float16).max)).float()


def _point_weights(books: CoupledCodebooks, shape) -> torch.Tensor | None:
    if books.channel_weights is None:
        return None
    b, h, t, d = shape
    w = books.channel_weights[None, :, None, :].expand(b, h, t, d)
    return _as_points(w.contiguous(), books.spec)


def fit_coupled(x: torch.Tensor, spec: CoupledSpec, q: torch.Tensor | None = None
                ) -> CoupledCodebooks:
    """Fit one layer's codebooks on ``x`` ``[B, H, T, D]`` (keys or values; calibration data).
    ``spec.weighted`` needs the layer's queries ``q`` ``[B, Hq, T, D]`` of the same tokens."""
    _check(x)
    b, h, t, d = x.shape
    spec.check_fits(d)
    perm = correlation_permutation(x, spec.channels) if spec.grouping == "correlation" else None
    weights = None
    if spec.weighted:
        if q is None:
            raise InputError("A weighted coupled fit weights channels by the layer's queries; "
                             "pass q (or drop +weighted).")
        weights = query_weights(q, h, spec, perm).half().float()  # what is stored
    y = to_group_basis(x, spec, perm)
    books = CoupledCodebooks(spec, torch.empty(0), h, d, perm, weights)
    pw = _point_weights(books, y.shape)
    c = kmeans(_as_points(y, spec), spec.levels, spec.iters, spec.seed, pw)
    return CoupledCodebooks(spec, c.half().float(), h, d, perm, weights)


def _check_books(x: torch.Tensor, books: CoupledCodebooks) -> None:
    _check(x)
    if (x.shape[1], x.shape[3]) != (books.kv_heads, books.head_dim):
        raise InputError(f"Codebooks fitted for {books.kv_heads} heads x head_dim "
                         f"{books.head_dim} cannot code a tensor of shape {tuple(x.shape)}.")


def encode_coupled(x: torch.Tensor, books: CoupledCodebooks) -> torch.Tensor:
    """int32 indices ``[B, H, T, D / c]``: each channel group's nearest centroid (weighted
    distance for ``weighted``), in the grouping's basis."""
    _check_books(x, books)
    y = to_group_basis(x, books.spec, books.permutation)
    idx = nearest(_as_points(y, books.spec), books.centroids, _point_weights(books, y.shape))
    return _from_points(idx[..., None], books.spec, y.shape)[..., 0].to(torch.int32)


def decode_coupled(codes: torch.Tensor, books: CoupledCodebooks) -> torch.Tensor:
    """``[B, H, T, D]`` float32 in the original basis from indices ``[B, H, T, D / c]``."""
    spec = books.spec
    b, h, t, groups = codes.shape
    shape = (b, h, t, groups * spec.channels)
    if (h, groups * spec.channels) != (books.kv_heads, books.head_dim):
        raise InputError(f"Indices of shape {tuple(codes.shape)} do not fit codebooks for "
                         f"{books.kv_heads} heads x head_dim {books.head_dim}.")
    idx = _index_points(codes.long(), spec)  # [K, N]: one index per point
    k = torch.arange(idx.shape[0], device=idx.device)[:, None]
    c = books.centroids.to(codes.device)[k, idx]  # [K, N, c]
    y = _from_points(c, spec, shape).reshape(shape)
    return from_group_basis(y, spec, books.permutation)


def fake_quantize_coupled(x: torch.Tensor, spec: CoupledSpec | None = None,
                          books: CoupledCodebooks | None = None,
                          q: torch.Tensor | None = None) -> torch.Tensor:
    """Encode and decode ``x`` ``[B, H, T, D]``: float32 in ``x``'s basis. Without ``books``
    they are fitted on ``x`` itself (in-sample) with ``spec`` (and ``q`` for ``weighted``)."""
    if books is None:
        if spec is None:
            raise InputError("Pass a CoupledSpec to fit, or fitted CoupledCodebooks.")
        books = fit_coupled(x, spec, q)
    return decode_coupled(encode_coupled(x, books), books)


def held_out_coupled(x: torch.Tensor, spec: CoupledSpec, q: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` coded out of sample (two-fold cross-fitting): each half of the
    samples (of the tokens, with one sample) is coded with codebooks fitted on the other half
    (``q``'s matching half for ``weighted``). The error this gives is what codebooks fitted on
    *other* tokens of the same text cost; coding ``x`` with codebooks fitted on ``x`` itself
    flatters settings with few fitting points per centroid (``c4b8`` on 128 points is exact).
    Raises ``InputError`` with fewer than 2 samples and 2 tokens."""
    _check(x)
    dim = 0 if x.shape[0] >= 2 else 2
    n = x.shape[dim]
    if n < 2:
        raise InputError(f"Cross-fitting needs 2 samples or 2 tokens; got {tuple(x.shape)}.")
    half = n // 2
    xs = (x.narrow(dim, 0, half), x.narrow(dim, half, n - half))
    qs = (None, None) if q is None else (q.narrow(dim, 0, half), q.narrow(dim, half, n - half))
    return torch.cat([fake_quantize_coupled(xs[i], books=fit_coupled(xs[1 - i], spec, qs[1 - i]))
                      for i in (0, 1)], dim)


def scalar_bits_per_element(bits: int, group_size: int, metadata_bits: int = 32) -> float:
    """Held bits per element of a uniform layout with one ``(scale, zero)`` per group of
    ``group_size``: ``bits + metadata_bits / G`` (32: float16 pair; 16: 8-bit metadata,
    ``kvlens.quant.meta8``). For tables that put coupled and scalar layouts side by side."""
    if not is_int(group_size, 1) or not is_int(bits, 1):
        raise ConfigError(f"Invalid bits {bits!r} / group size {group_size!r}.")
    return bits + metadata_bits / group_size

