"""Hadamard rotation along ``head_dim``: spread outlier channels over all channels before
quantizing (QuaRot arXiv 2404.00456, SpinQuant arXiv 2405.16406, TurboQuant arXiv 2504.19874,
RotateKV; what the cache does with it: docs/rotation.md).

``R`` is an orthonormal ``[D, D]`` matrix applied on the right of ``[B, H, T, D]`` tensors, the
same for every head: the Sylvester Hadamard ``H_2n = [[H_n, H_n], [H_n, -H_n]]`` scaled by
``1/sqrt(b)``, one block for a power-of-two ``D``, else ``D / b`` blocks on the diagonal with
``b`` the largest power of two dividing ``D``; an odd ``D`` is refused. ``seed``: random sign
flips ``R = diag(s) H`` drawn from a CPU generator (identical on every device). Keys are stored
as ``k R`` with queries ``q R``; values as ``v R`` with the output un-rotated by ``Rᵀ``; pre-RoPE
keys are un-rotated before RoPE, which does not commute with ``R``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvlens.errors import ConfigError, InputError, is_int
from kvlens.quant.meta8 import fake_quantize
from kvlens.quant.spec import check_versioned_dict

ROTATION_VERSION = 1
_FIELDS = ("seed",)


def hadamard_block_size(head_dim: int) -> int:
    """Size ``b`` of the Sylvester blocks used for ``head_dim``: the largest power of two
    dividing it (``b = head_dim`` for a power of two). Raises ``ConfigError`` listing the
    supported sizes when there is none (odd or non-positive ``head_dim``)."""
    if not is_int(head_dim, 2):
        raise ConfigError(_unsupported(head_dim, "it is not an integer >= 2"))
    block = head_dim & -head_dim  # lowest set bit = largest power of two dividing head_dim
    if block == 1:
        raise ConfigError(_unsupported(head_dim, "it is odd, so no power-of-two block divides it"))
    return block


def _unsupported(head_dim: object, why: str) -> str:
    return (f"No Hadamard rotation for head_dim {head_dim!r}: {why}. Supported: even head_dim; "
            "powers of two (2, 4, 8, 16, 32, 64, 128, 256, ...) use one Sylvester Hadamard matrix, "
            "other even sizes a block-diagonal of the largest power-of-two block dividing them "
            "(e.g. 80 -> 5 blocks of 16, 96 -> 3 blocks of 32).")


def _check_seed(seed: object) -> None:
    if seed is not None and not is_int(seed, 0):
        raise ConfigError(f"Invalid rotation seed {seed!r}; allowed: None (no sign flips) or an "
                          "integer >= 0.")


def _sylvester(n: int) -> torch.Tensor:
    """Unnormalised ``n x n`` Sylvester Hadamard matrix (``n`` a power of two), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def hadamard_rotation(head_dim: int, seed: int | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal ``[head_dim, head_dim]`` float32 rotation ``R`` (module docstring):
    Sylvester Hadamard (block-diagonal for even non-powers of two), rows sign-flipped by a
    seeded ``{-1, +1}`` vector when ``seed`` is not None. Built in float64, so ``R Rᵀ = I`` to
    float32 rounding. Raises ``ConfigError`` for an unsupported ``head_dim`` or seed."""
    block = hadamard_block_size(head_dim)
    _check_seed(seed)
    h = _sylvester(block) / block**0.5
    r = torch.block_diag(*([h] * (head_dim // block)))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64) * 2 - 1
        r = signs.to(torch.float64)[:, None] * r  # diag(s) H: flip the sign of input channels
    return r.to(device=device, dtype=torch.float32)


def _check_pair(x: torch.Tensor, r: torch.Tensor) -> None:
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    d = x.shape[-1]
    if r.dim() != 2 or tuple(r.shape) != (d, d):
        raise InputError(f"Rotation of shape {tuple(r.shape)} does not fit head_dim {d}; expected "
                         f"({d}, {d}).")


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x R`` for ``x`` ``[B, H, T, D]`` and ``R`` ``[D, D]`` (the stored basis), float32."""
    _check_pair(x, r)
    return x.float() @ r.float().to(x.device)


def unrotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x Rᵀ``: back from the rotated basis (the inverse of ``rotate``), float32."""
    _check_pair(x, r)
    return x.float() @ r.float().to(x.device).T


def quantize_rotated(x: torch.Tensor, spec, r: torch.Tensor) -> torch.Tensor:
    """``fake_quantize(x R, spec) Rᵀ``: ``[B, H, T, D]`` float32 in the original basis, the key a
    plain query sees (``q · k_hat = (q R) · deq(k R)``) or the values whose attention equals the
    un-rotated output. ``spec`` may be a function ``x -> x_hat`` (a layout's reference): the
    rotation composes around any layout."""
    return unrotate(quantizer(spec)(rotate(x, r)), r)


def quantizer(spec):
    """``x -> x_hat``: ``spec`` itself when it is such a function, else ``fake_quantize`` with
    this ``QuantSpec``."""
    if callable(spec):
        return spec
    return lambda x: fake_quantize(x, spec)


@dataclass(frozen=True)
class RotationSpec:
    """A Hadamard rotation setting (frozen, versioned, JSON-serialisable): ``seed`` ``None`` =
    plain (block) Sylvester Hadamard, an integer >= 0 = random sign flips drawn with it."""

    seed: int | None = None

    def __post_init__(self) -> None:
        _check_seed(self.seed)

    def matrix(self, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``hadamard_rotation(head_dim, self.seed, device)``."""
        return hadamard_rotation(head_dim, self.seed, device)

    @property
    def label(self) -> str:
        return "hadamard" if self.seed is None else f"hadamard seed {self.seed}"

    def to_dict(self) -> dict[str, Any]:
        return {"version": ROTATION_VERSION, "seed": self.seed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RotationSpec:
        """Inverse of ``to_dict``; rejects unknown keys and other versions with ``ConfigError``."""
        check_versioned_dict(data, "rotation", ROTATION_VERSION, _FIELDS)
        return cls(**{k: data[k] for k in _FIELDS if k in data})
