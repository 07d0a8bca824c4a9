"""``QuantSpec``: what one quantization config means (bits, what shares a scale, group size).

Tensors are ``[B, H, T, D]``. A granularity is named by *which elements share one scale and
zero*:

- ``"per-token"``: ``G`` consecutive channels of one token, ``x[b, h, t, j*G:(j+1)*G]``; ``G``
  must divide ``D``; ``group_size=None`` means ``G = D``.
- ``"per-channel"``: ``G`` consecutive tokens of one channel, ``x[b, h, i*G:(i+1)*G, c]``; a
  partial last group (``T mod G`` tokens) has its own scale and zero; ``None`` means ``G = T``.
- ``"per-tensor"``: one scale and zero per (batch, head); no group size.

Internally each is one *block shape* over ``(T, D)`` (``QuantSpec.block_shape``): per-token
``(1, G)``, per-channel ``(G, 1)``, per-tensor ``(T, D)``, so the reference has one code path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvlens.errors import ConfigError, is_int

GRANULARITIES = ("per-token", "per-channel", "per-tensor")
MIN_BITS, MAX_BITS = 1, 8
SPEC_VERSION = 2  # 2: ``fit`` (a spec with fit "minmax" is still written as version 1)
_FIELDS = ("bits", "granularity", "group_size", "symmetric", "fit")
FITS = ("minmax", "mse", "hqq")


def check_versioned_dict(data: Any, what: str, version: int, fields: Sequence[str]) -> None:
    """Refuse with ``ConfigError`` what a one-version spec's ``from_dict`` cannot read: not a
    JSON object, another ``version`` (absent means ``version``), keys outside ``fields``.
    ``what`` names the spec in the messages ("rotation", "codebook spec")."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"A {what} must be a JSON object, got {type(data).__name__}.")
    got = data.get("version", version)
    if got != version:
        raise ConfigError(f"Unsupported {what} version {got!r}; this kvlens reads version "
                          f"{version}.")
    unknown = sorted(set(data) - set(fields) - {"version"})
    if unknown:
        raise ConfigError(f"Unknown {what} keys {unknown}; allowed: "
                          f"{', '.join(('version', *fields))}.")


@dataclass(frozen=True)
class QuantSpec:
    """A uniform integer quantization config for ``[B, H, T, D]`` tensors.

    bits: 1-8 (symmetric needs at least 2). granularity: what shares one scale (module docstring).
    group_size: ``G`` along the grouped axis; ``None`` = the whole vector; ``None`` for per-tensor.
    symmetric: a zero-centred grid instead of min/max. fit: ``"minmax"``, ``"mse"`` (asymmetric
    only: a least-squares refit of each group's ``(scale, zero)``, ``kvlens.quant.reference``) or
    ``"hqq"`` (the min/max scale with HQQ's zero-point refinement, transformers' HQQ cache);
    storage and dequantization are the same for all."""

    bits: int
    granularity: str
    group_size: int | None = None
    symmetric: bool = False
    fit: str = "minmax"

    def __post_init__(self) -> None:
        if not is_int(self.bits, MIN_BITS, MAX_BITS):
            raise ConfigError(f"Invalid bits {self.bits!r}; allowed: integers "
                              f"{MIN_BITS}-{MAX_BITS}.")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"Unknown granularity {self.granularity!r}; allowed: "
                              f"{', '.join(GRANULARITIES)}.")
        if self.group_size is not None:
            if not is_int(self.group_size, 1):
                raise ConfigError(f"Invalid group size {self.group_size!r}; allowed: a positive "
                                  f"integer, or None for the whole vector.")
            if self.granularity == "per-tensor":
                raise ConfigError(f"per-tensor quantization takes no group size (got "
                                  f"{self.group_size}); use per-token or per-channel with a "
                                  f"group size, or group_size=None.")
        if not isinstance(self.symmetric, bool):
            raise ConfigError(f"Invalid symmetric {self.symmetric!r}; allowed: true, false.")
        if self.symmetric and self.bits < 2:
            # The symmetric grid -qmax..qmax with qmax = 2^(b-1) - 1 is empty at 1 bit.
            raise ConfigError("Symmetric quantization needs bits >= 2 (allowed: 2-8); use "
                              "asymmetric for 1 bit.")
        if self.fit not in FITS:
            raise ConfigError(f"Unknown fit {self.fit!r}; allowed: {', '.join(FITS)}.")
        if self.fit != "minmax" and self.symmetric:
            raise ConfigError(f"fit {self.fit!r} is for asymmetric grids; use symmetric=false "
                              "or fit 'minmax'.")

    # -- geometry ---------------------------------------------------------------------------
    @property
    def levels(self) -> int:
        """Largest code value of the asymmetric grid, ``2^bits - 1``."""
        return (1 << self.bits) - 1

    def block_shape(self, num_tokens: int, head_dim: int) -> tuple[int, int]:
        """The ``(tokens, channels)`` extent of one group: per-token ``(1, G)``, per-channel
        ``(G, 1)``, per-tensor ``(T, D)`` (``G`` None: the whole vector). Call ``check_fits``
        first."""
        if self.granularity == "per-token":
            return 1, self.group_size or head_dim
        if self.granularity == "per-channel":
            return self.group_size or num_tokens, 1
        return num_tokens, head_dim

    def check_fits(self, shape: Sequence[int]) -> None:
        """Raise ``ConfigError`` unless this spec can quantize a tensor of ``shape`` (``[B, H,
        T, D]`` or ``(T, D)``)."""
        if len(shape) < 2:
            raise ConfigError(f"Expected a shape [B, H, T, D] or (T, D), got {tuple(shape)}.")
        num_tokens, head_dim = int(shape[-2]), int(shape[-1])
        if num_tokens < 1 or head_dim < 1:
            raise ConfigError(f"Cannot quantize an empty tensor of shape {tuple(shape)}.")
        self.check_group(head_dim)

    def check_group(self, head_dim: int, where: str = "") -> None:
        """``ConfigError`` (prefixed ``where``) unless a per-token group divides ``head_dim``."""
        if self.granularity == "per-token" and self.group_size and head_dim % self.group_size:
            allowed = ", ".join(str(g) for g in range(1, head_dim + 1) if head_dim % g == 0)
            raise ConfigError(f"{where}group size {self.group_size} does not divide head_dim "
                              f"{head_dim}; allowed group sizes: {allowed}.")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``"2b per-channel G32"`` or ``"4b per-token G=all sym"``."""
        g = "" if self.granularity == "per-tensor" else f" G{self.group_size or '=all'}"
        return (f"{self.bits}b {self.granularity}{g}{' sym' if self.symmetric else ''}"
                f"{' mse' if self.fit == 'mse' else ''}")

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with a ``version`` field (1 unless ``fit`` is set, so older kvlens
        versions still read what they can run)."""
        return {
            "version": 1 if self.fit == "minmax" else SPEC_VERSION,
            "bits": self.bits,
            "granularity": self.granularity,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            **({} if self.fit == "minmax" else {"fit": self.fit}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantSpec:
        """Inverse of ``to_dict``; rejects unknown keys and newer versions with ``ConfigError``."""
        if not isinstance(data, Mapping):
            raise ConfigError("A quantization spec must be a JSON object, got "
                              f"{type(data).__name__}.")
        version = data.get("version", SPEC_VERSION)
        if not isinstance(version, int) or version > SPEC_VERSION or version < 1:
            raise ConfigError(f"Unsupported quantization spec version {version!r}; this kvlens "
                              f"reads versions 1-{SPEC_VERSION}.")
        allowed = _FIELDS if version >= 2 else _FIELDS[:-1]
        unknown = sorted(set(data) - set(allowed) - {"version"})
        if unknown:
            raise ConfigError(f"Unknown quantization spec keys {unknown}; allowed: "
                              f"{', '.join(('version',) + allowed)}"
                              + (" ('fit' needs spec version 2)." if "fit" in unknown else "."))
        missing = [k for k in ("bits", "granularity") if k not in data]
        if missing:
            raise ConfigError(f"Quantization spec is missing {missing}; required: bits, "
                              "granularity.")
        return cls(**{k: data[k] for k in _FIELDS if k in data})
