"""Codebook (non-uniform scalar) quantization of head vectors with one norm per vector (vLLM
TurboQuant's keys).

Each ``[D]`` vector ``x`` is stored as its norm ``n = ||x||`` (float16) and ``bits``-bit codes
of ``z = sqrt(D) * (x R) / n`` (``R``: ``kvlens.quant.rotation``; ``n = 0`` gives ``z = 0``),
each the nearest of ``2^bits`` centroids (``Codebook``); decoded ``y_hat = n16 * c[codes] /
sqrt(D)`` (``renormalize``: ``n16 * c / ||c||``), ``x_hat = y_hat Rᵀ``. After the rotation a
coordinate of ``x / n`` behaves like one of a uniform point on the sphere (close to ``N(0,
1/D)``: HIGGS arXiv 2411.17525, TurboQuant arXiv 2504.19874), so one codebook form serves every
head_dim. ``CODEBOOKS``: ``"lloyd-max"`` (Lloyd-Max of that density for ``D``) and
``"lloyd-max-normal"`` (of the standard normal, vLLM's ``turboquant_*`` centroids), computed,
not stored; its layout (``kvlens.layouts.codebook``) counts the packed codes and norms.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlens.errors import ConfigError, InputError, is_int
from kvlens.quant.packing import pack_codes, unpack_codes
from kvlens.quant.reference import check_tensor
from kvlens.quant.rotation import RotationSpec, rotate, unrotate
from kvlens.quant.spec import check_versioned_dict

CODEBOOKS = ("lloyd-max", "lloyd-max-normal")  # functions of bits (and D): nothing stored
CODEBOOK_SPEC_VERSION = 1
MIN_CODEBOOK_BITS, MAX_CODEBOOK_BITS = 1, 8
NORM_BYTES = 2  # float16 norm per vector
LLOYD_GRID = 200_001
LLOYD_ITERS = 2000
_FIELDS = ("bits", "codebook", "rotation", "renormalize")


@dataclass(frozen=True)
class CodebookSpec:
    """A codebook quantization config for ``[B, H, T, D]`` tensors (frozen, versioned JSON).

    bits: 1-8; codebook: one of ``CODEBOOKS`` (module docstring); rotation: the Hadamard rotation
    before coding (``None`` codes the raw channels, for ablations); renormalize: rescale each
    decoded vector to its stored norm."""

    bits: int
    codebook: str = "lloyd-max"
    rotation: RotationSpec | None = field(default_factory=RotationSpec)
    renormalize: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.bits, MIN_CODEBOOK_BITS, MAX_CODEBOOK_BITS):
            raise ConfigError(f"Invalid codebook bits {self.bits!r}; allowed: integers "
                              f"{MIN_CODEBOOK_BITS}-{MAX_CODEBOOK_BITS}.")
        if self.codebook not in CODEBOOKS:
            raise ConfigError(f"Unknown codebook {self.codebook!r}; allowed: "
                              f"{', '.join(CODEBOOKS)}.")
        if self.rotation is not None and not isinstance(self.rotation, RotationSpec):
            raise ConfigError(f"Invalid codebook rotation {self.rotation!r}; allowed: a "
                              "RotationSpec or None.")
        if not isinstance(self.renormalize, bool):
            raise ConfigError(f"Invalid renormalize {self.renormalize!r}; allowed: true, false.")

    @property
    def label(self) -> str:
        rot = "" if self.rotation is None else f" {self.rotation.label}"
        return f"{self.bits}b codebook {self.codebook}{rot}{' renorm' if self.renormalize else ''}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": CODEBOOK_SPEC_VERSION,
            "bits": self.bits,
            "codebook": self.codebook,
            "rotation": None if self.rotation is None else self.rotation.to_dict(),
            "renormalize": self.renormalize,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CodebookSpec:
        """Inverse of ``to_dict``; rejects unknown keys and other versions with ``ConfigError``."""
        check_versioned_dict(data, "codebook spec", CODEBOOK_SPEC_VERSION, _FIELDS)
        if "bits" not in data:
            raise ConfigError("Codebook spec is missing 'bits'.")
        kwargs = {k: data[k] for k in _FIELDS if k in data}
        if kwargs.get("rotation") is not None:
            kwargs["rotation"] = RotationSpec.from_dict(kwargs["rotation"])
        return cls(**kwargs)


@dataclass(frozen=True)
class Codebook:
    """``2^bits`` ascending centroids (float32 ``[levels]``) in unit-variance coordinates
    ``z = sqrt(D) * (x R)_c / ||x||``. A coordinate codes to its nearest centroid."""

    centroids: torch.Tensor

    def __post_init__(self) -> None:
        c = self.centroids
        if c.dim() != 1 or c.numel() < 2 or c.numel() & (c.numel() - 1):
            raise InputError(
                f"A codebook needs a power-of-two number (>= 2) of centroids, got shape "
                f"{tuple(c.shape)}."
            )
        if not bool((c[1:] >= c[:-1]).all()):
            raise InputError("Codebook centroids must be sorted ascending.")

    @property
    def bits(self) -> int:
        return self.centroids.numel().bit_length() - 1

    @property
    def boundaries(self) -> torch.Tensor:
        """The ``levels - 1`` cell boundaries, midpoints of neighbouring centroids."""
        c = self.centroids
        return (c[1:] + c[:-1]) / 2

    def encode(self, z: torch.Tensor) -> torch.Tensor:
        """uint8 code of the nearest centroid for each element of ``z``."""
        b = self.boundaries.to(z.device)
        return torch.bucketize(z.float().contiguous(), b).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.centroids.to(codes.device)[codes.long()]


# -- codebooks ----------------------------------------------------------------------------------


def sphere_coordinate_density(z: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """Unnormalised density of ``sqrt(D) * t`` for ``t`` a coordinate of a uniform point on the
    unit sphere of ``R^D``: ``(1 - z²/D)^((D-3)/2)`` on ``|z| < sqrt(D)``; ``head_dim=None`` gives
    the standard normal (its limit as ``D`` grows)."""
    z = z.double()
    if head_dim is None:
        return torch.exp(-0.5 * z * z)
    if not is_int(head_dim, 3):
        raise ConfigError(f"Invalid head_dim {head_dim!r} for the sphere density; allowed: >= 3.")
    inside = (1 - z * z / head_dim).clamp_min(0)
    return inside.pow((head_dim - 3) / 2)


def weighted_lloyd(points: torch.Tensor, weights: torch.Tensor, levels: int,
                   iters: int, tol: float = 1e-12) -> torch.Tensor:
    """1-D Lloyd (weighted k-means) on ascending ``points`` with ``weights`` (float64 ``[N]``),
    from ``levels`` equal-mass cells until no centroid moves more than ``tol`` or ``iters``
    rounds (an empty cell keeps its centroid; prefix sums: ``O(levels log N)`` a round)."""
    cw = torch.cat((weights.new_zeros(1), weights.cumsum(0)))
    cs = torch.cat((weights.new_zeros(1), (weights * points).cumsum(0)))
    total = float(cw[-1])
    if total <= 0:
        raise InputError("Cannot fit a codebook: all weights are zero.")
    cuts = torch.searchsorted(cw, torch.linspace(0, total, levels + 1, dtype=cw.dtype)[1:-1])
    c = None  # the first round's cells have equal mass
    for _ in range(iters + 1):
        edges = torch.cat((cuts.new_zeros(1), cuts, cuts.new_full((1,), points.numel())))
        mass = cw[edges[1:]] - cw[edges[:-1]]
        # an empty cell keeps its centroid (an initial one: its first point)
        keep = points[edges[:-1].clamp_max(points.numel() - 1)] if c is None else c
        new = torch.where(mass > 0, (cs[edges[1:]] - cs[edges[:-1]]) / mass.clamp_min(1e-300),
                          keep)
        moved = None if c is None else float((new - c).abs().max())
        c = new
        if moved is not None and moved <= tol:
            break
        cuts = torch.searchsorted(points, (c[1:] + c[:-1]) / 2)  # points < mid go left
    return c


def lloyd_max(bits: int, head_dim: int | None) -> Codebook:
    """The Lloyd-Max codebook of ``sphere_coordinate_density`` for ``head_dim`` (None: the
    standard normal) on a ``LLOYD_GRID``-point grid, symmetrised exactly about 0."""
    if not is_int(bits, MIN_CODEBOOK_BITS, MAX_CODEBOOK_BITS):
        raise ConfigError(f"Invalid codebook bits {bits!r}; allowed: integers 1-8.")
    return _lloyd_max_cached(bits, head_dim)


@functools.cache
def _lloyd_max_cached(bits: int, head_dim: int | None) -> Codebook:
    reach = 12.0 if head_dim is None else min(12.0, math.sqrt(head_dim))
    z = torch.linspace(-reach, reach, LLOYD_GRID, dtype=torch.float64)
    c = weighted_lloyd(z, sphere_coordinate_density(z, head_dim), 1 << bits, LLOYD_ITERS)
    return Codebook(((c - c.flip(0)) / 2).float())  # exact symmetry


def computed_codebook(spec: CodebookSpec, head_dim: int) -> Codebook:
    """The codebook of ``spec`` for ``head_dim``: Lloyd-Max of the sphere-coordinate density
    (below ``D = 3``, and for ``"lloyd-max-normal"``: of the standard normal)."""
    exact = spec.codebook == "lloyd-max" and head_dim >= 3
    return lloyd_max(spec.bits, head_dim if exact else None)


# -- quantize / dequantize ----------------------------------------------------------------------


@dataclass(frozen=True)
class CodebookTensor:
    """A codebook-quantized ``[B, H, T, D]`` tensor: ``codes`` uint8 ``[B, H, T, D]`` unpacked
    (``packed()``: the stored form), ``norms`` float16 ``[B, H, T]``, ``codebook``, ``spec``."""

    codes: torch.Tensor
    norms: torch.Tensor
    codebook: Codebook
    spec: CodebookSpec
    shape: tuple[int, int, int, int]

    def packed(self) -> torch.Tensor:
        """Codes packed densely along ``D``: uint8 ``[B, H, T, packed_length(D, bits)]``."""
        return pack_codes(self.codes, self.spec.bits, dim=-1)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, norms: torch.Tensor, codebook: Codebook,
                    spec: CodebookSpec, head_dim: int) -> CodebookTensor:
        codes = unpack_codes(packed, spec.bits, head_dim, dim=-1)
        return cls(codes, norms, codebook, spec, tuple(codes.shape))


def _rotation_matrix(spec: CodebookSpec, head_dim: int, device) -> torch.Tensor | None:
    return None if spec.rotation is None else spec.rotation.matrix(head_dim, device)


def normalized_coordinates(x: torch.Tensor, spec: CodebookSpec
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, n)``: the unit-variance rotated coordinates ``sqrt(D) * (x R) / ||x||`` ``[B, H, T,
    D]`` float32 and the norms ``[B, H, T]`` float32 (``z = 0`` where ``n = 0``)."""
    check_tensor(x)
    d = x.shape[-1]
    r = _rotation_matrix(spec, d, x.device)
    y = x.float() if r is None else rotate(x, r)
    n = y.norm(dim=-1)
    z = y * (math.sqrt(d) / n.clamp_min(torch.finfo(torch.float32).tiny))[..., None]
    return torch.where(n[..., None] > 0, z, torch.zeros_like(z)), n


def quantize_codebook(x: torch.Tensor, spec: CodebookSpec, codebook: Codebook) -> CodebookTensor:
    """Code ``x`` ``[B, H, T, D]`` with ``codebook`` (module docstring)."""
    if codebook.bits != spec.bits:
        raise InputError(f"A {codebook.bits}-bit codebook cannot code a {spec.bits}-bit spec.")
    z, n = normalized_coordinates(x, spec)
    norms = n.clamp_max(torch.finfo(torch.float16).max).half()
    return CodebookTensor(codebook.encode(z), norms, codebook, spec, tuple(x.shape))


def dequantize_codebook(qt: CodebookTensor) -> torch.Tensor:
    """``[B, H, T, D]`` float32 in the original basis (un-rotated)."""
    c = qt.codebook.decode(qt.codes)
    d = qt.shape[-1]
    if qt.spec.renormalize:
        scale = 1.0 / c.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        scale = 1.0 / math.sqrt(d)
    y = c * scale * qt.norms.float()[..., None]
    r = _rotation_matrix(qt.spec, d, y.device)
    return y if r is None else unrotate(y, r)


def fake_quantize_codebook(x: torch.Tensor, spec: CodebookSpec) -> torch.Tensor:
    """Quantize and dequantize ``x`` ``[B, H, T, D]`` with the spec's codebook for its head_dim:
    float32 in ``x``'s basis."""
    book = computed_codebook(spec, x.shape[-1])
    return dequantize_codebook(quantize_codebook(x, spec, book))
