"""``QuantSpec``: what one quantization config means (bits, what shares a scale, group size).

Tensors are ``[B, H, T, D]`` (batch, head, token, channel). A granularity is named by *which
elements share one scale and zero*:

- ``"per-token"``: a group is ``G`` consecutive channels of one token, i.e. the slice
  ``x[b, h, t, j*G:(j+1)*G]``. ``G`` must divide ``D``; ``group_size=None`` means ``G = D`` (one
  scale per token vector).
- ``"per-channel"``: a group is ``G`` consecutive tokens of one channel, i.e. the slice
  ``x[b, h, i*G:(i+1)*G, c]``. ``T`` need *not* be a multiple of ``G``: the last group is
  partial (``T mod G`` tokens) and has its own scale and zero, computed from those tokens only.
  ``group_size=None`` means ``G = T`` (one scale per channel over the whole sequence).
- ``"per-tensor"``: one scale and zero per (batch, head), i.e. for the whole ``[T, D]`` matrix
  ``x[b, h]``. Takes no group size.

Internally every granularity is one *block shape* over ``(T, D)`` (see ``QuantSpec.block_shape``):
per-token ``(1, G)``, per-channel ``(G, 1)``, per-tensor ``(T, D)``, so the reference has a
single code path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvlens.errors import ConfigError

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

    bits: code width, 1-8 (symmetric needs at least 2).
    granularity: what shares one scale: ``"per-token"``, ``"per-channel"`` or ``"per-tensor"``
        (see the module docstring for the exact slices).
    group_size: ``G``, elements per group along the grouped axis; ``None`` = the whole vector
        (all ``D`` channels for per-token, all ``T`` tokens for per-channel). Must be ``None``
        for per-tensor.
    symmetric: ``False`` (default) = asymmetric min/max grid; ``True`` = zero-centred grid
        (formulas in ``kvlens.quant.reference``).
    fit: how a group's ``scale`` and ``zero`` are chosen (asymmetric only): ``"minmax"``
        (default) spans the group's range; ``"mse"`` starts there and alternately re-assigns
        codes and refits ``(scale, zero)`` by least squares, which clips the range where
        that lowers the group's squared error; ``"hqq"`` keeps the min/max scale and refines
        the zero point as HQQ does (transformers' HQQ cache; ``kvlens.quant.reference``).
        Storage and dequantization are the same for all.
    """

    bits: int
    granularity: str
    group_size: int | None = None
    symmetric: bool = False
    fit: str = "minmax"

    def __post_init__(self) -> None:
        # bool is an int subclass; True as a bit width is always a mistake.
        if (
            isinstance(self.bits, bool)
            or not isinstance(self.bits, int)
            or not MIN_BITS <= self.bits <= MAX_BITS
        ):
            raise ConfigError(
                f"Invalid bits {self.bits!r}; allowed: integers {MIN_BITS}-{MAX_BITS}."
            )
        if self.granularity not in GRANULARITIES:
            raise ConfigError(
                f"Unknown granularity {self.granularity!r}; allowed: {', '.join(GRANULARITIES)}."
            )
        if self.group_size is not None:
            if (
                isinstance(self.group_size, bool)
                or not isinstance(self.group_size, int)
                or self.group_size < 1
            ):
                raise ConfigError(
                    f"Invalid group size {self.group_size!r}; allowed: a positive "
                    f"integer, or None for the whole vector."
                )
            if self.granularity == "per-tensor":
                raise ConfigError(
                    f"per-tensor quantization takes no group size (got "
                    f"{self.group_size}); use per-token or per-channel with a "
                    f"group size, or group_size=None."
                )
        if not isinstance(self.symmetric, bool):
            raise ConfigError(f"Invalid symmetric {self.symmetric!r}; allowed: true, false.")
        if self.symmetric and self.bits < 2:
            # The symmetric grid -qmax..qmax with qmax = 2^(b-1) - 1 is empty at 1 bit.
            raise ConfigError(
                "Symmetric quantization needs bits >= 2 (allowed: 2-8); use asymmetric for 1 bit."
            )
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

    def group_length(self, num_tokens: int, head_dim: int) -> int:
        """``G`` resolved against a ``[T, D]`` matrix (``None`` -> whole vector)."""
        if self.granularity == "per-token":
            return self.group_size or head_dim
        if self.granularity == "per-channel":
            return self.group_size or num_tokens
        return num_tokens * head_dim

    def block_shape(self, num_tokens: int, head_dim: int) -> tuple[int, int]:
        """The ``(tokens, channels)`` extent of one group: per-token ``(1, G)``, per-channel
        ``(G, 1)``, per-tensor ``(T, D)``. Call ``check_fits`` first."""
        if self.granularity == "per-token":
            return 1, self.group_length(num_tokens, head_dim)
        if self.granularity == "per-channel":
            return self.group_length(num_tokens, head_dim), 1
        return num_tokens, head_dim

    def num_groups(self, num_tokens: int, head_dim: int) -> int:
        """Groups (= scales) per ``[T, D]`` matrix, counting a partial last token group."""
        bt, bd = self.block_shape(num_tokens, head_dim)
        return -(-num_tokens // bt) * (head_dim // bd)

    def check_fits(self, shape: Sequence[int]) -> None:
        """Raise ``ConfigError`` unless this spec can quantize a tensor of ``shape``.

        ``shape`` is ``[B, H, T, D]`` or just ``(T, D)`` (its last two entries are used). A
        per-token group size must divide ``D``; per-channel groups may leave a partial last
        group along ``T``.
        """
        if len(shape) < 2:
            raise ConfigError(f"Expected a shape [B, H, T, D] or (T, D), got {tuple(shape)}.")
        num_tokens, head_dim = int(shape[-2]), int(shape[-1])
        if num_tokens < 1 or head_dim < 1:
            raise ConfigError(f"Cannot quantize an empty tensor of shape {tuple(shape)}.")
        if (
            self.granularity == "per-token"
            and self.group_size is not None
            and head_dim % self.group_size
        ):
            allowed = ", ".join(str(g) for g in range(1, head_dim + 1) if head_dim % g == 0)
            raise ConfigError(
                f"group size {self.group_size} does not divide head_dim "
                f"{head_dim}; allowed group sizes: {allowed}."
            )

    @property
    def label(self) -> str:
        """Short human name, e.g. ``"2b per-channel G32"`` or ``"4b per-token G=all sym"``."""
        g = (
            ""
            if self.granularity == "per-tensor"
            else f" G{self.group_size}"
            if self.group_size
            else " G=all"
        )
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
            raise ConfigError(
                f"A quantization spec must be a JSON object, got {type(data).__name__}."
            )
        version = data.get("version", SPEC_VERSION)
        if not isinstance(version, int) or version > SPEC_VERSION or version < 1:
            raise ConfigError(
                f"Unsupported quantization spec version {version!r}; this kvlens "
                f"reads versions 1-{SPEC_VERSION}."
            )
        allowed = _FIELDS if version >= 2 else _FIELDS[:-1]
        unknown = sorted(set(data) - set(allowed) - {"version"})
        if unknown:
            raise ConfigError(
                f"Unknown quantization spec keys {unknown}; allowed: "
                f"{', '.join(('version',) + allowed)}"
                + (" ('fit' needs spec version 2)." if "fit" in unknown else ".")
            )
        missing = [k for k in ("bits", "granularity") if k not in data]
        if missing:
            raise ConfigError(
                f"Quantization spec is missing {missing}; required: bits, granularity."
            )
        return cls(**{k: data[k] for k in _FIELDS if k in data})
