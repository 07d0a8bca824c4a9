"""What transformers' two quantized cache layers share as engine settings
(``QuantizedLayerSetting``), with the quanto backend (``kvlens.config.engine.QuantoSetting``)
and the HQQ backend (``kvlens.config.hqq.HqqSetting``) as its subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlens.config.schema import KVConfig, LayerKV
from kvlens.errors import ConfigError, is_int
from kvlens.quant import QuantSpec

#: transformers' defaults for both backends (``QuantizedLayer``)
LAYER_DEFAULTS = {"axis_key": 0, "axis_value": 0, "group": 64, "residual": 128}


@dataclass(frozen=True)
class QuantizedLayerSetting:
    """transformers ``QuantizedCache(backend=B, nbits=bits, axis_key, axis_value,
    q_group_size=group, residual_length=residual)``, simulated as a kvlens layout; a backend
    sets ``backend``, the ``bit_widths`` and ``axes`` it accepts, ``granularity`` (its axis ->
    kvlens granularity) and ``fit``."""

    bits: int
    axis_key: int = LAYER_DEFAULTS["axis_key"]
    axis_value: int = LAYER_DEFAULTS["axis_value"]
    group: int = LAYER_DEFAULTS["group"]
    residual: int = LAYER_DEFAULTS["residual"]

    engine: ClassVar[str] = "transformers"
    backend: ClassVar[str]
    bit_widths: ClassVar[tuple[int, ...]]  # the nbits it accepts
    axes: ClassVar[tuple[int, ...]]  # the axis_key / axis_value it accepts
    granularity: ClassVar[dict[int, str]]
    fit: ClassVar[str] = "minmax"

    def __post_init__(self) -> None:
        if self.bits not in self.bit_widths or isinstance(self.bits, bool):
            raise ConfigError(f"{self.backend} bits are {_listed(self.bit_widths)}, got "
                              f"{self.bits!r}")
        for key in ("axis_key", "axis_value"):
            if getattr(self, key) not in self.axes:
                raise ConfigError(f"{key} for {self.backend} must be "
                                  f"{' or '.join(map(str, self.axes))}, got "
                                  f"{getattr(self, key)!r}")
        if not is_int(self.group, 1) or not is_int(self.residual, 0):
            raise ConfigError(f"group must be a positive integer and residual an integer >= 0, "
                              f"got group={self.group!r}, residual={self.residual!r}")

    @property
    def name(self) -> str:
        """Axes and group always written (what ``recommend --target`` searches), the residual
        window when it is not the default."""
        out = (f"transformers:{self.backend}-{self.bits}:axis_key={self.axis_key}:"
               f"axis_value={self.axis_value}:group={self.group}")
        return out + ("" if self.residual == LAYER_DEFAULTS["residual"]
                      else f":residual={self.residual}")

    def cache_kwargs(self) -> dict:
        """The keyword arguments of transformers' quantized layer for this setting."""
        return {"nbits": self.bits, "axis_key": self.axis_key, "axis_value": self.axis_value,
                "q_group_size": self.group, "residual_length": self.residual}

    def spec(self, axis: int) -> QuantSpec:
        return QuantSpec(self.bits, self.granularity[axis], self.group, fit=self.fit)

    def kvconfig(self, label: str) -> KVConfig:
        kwargs = ", ".join(f"{k}={v}" for k, v in self.cache_kwargs().items())
        return KVConfig(label, LayerKV(self.spec(self.axis_key), self.spec(self.axis_value),
                                       self.residual), fp_dtype="float16",
                        description=f"transformers QuantizedCache(backend='{self.backend}', "
                                    f"{kwargs})")

    @classmethod
    def parse(cls, parts: list[str]) -> QuantizedLayerSetting:
        """``BACKEND-B`` and its ``key=value`` options (already split on ``:`` and lower-cased)
        -> the setting; ``ConfigError`` saying what is wrong otherwise."""
        bits = parts[0].removeprefix(f"{cls.backend}-")
        if not (bits.isascii() and bits.isdigit()):
            raise ConfigError(f"{cls.backend} settings are {cls.backend}-B with B one of "
                              f"{_listed(cls.bit_widths)}, got {parts[0]!r}")
        out: dict[str, int] = {}
        for opt in parts[1:]:
            key, _, value = opt.partition("=")
            if key not in LAYER_DEFAULTS or key in out:
                raise ConfigError(f"unknown or repeated option {key!r}; allowed: "
                                  f"{', '.join(LAYER_DEFAULTS)}")
            try:
                out[key] = int(value)
            except ValueError:
                raise ConfigError(f"{opt!r} needs an integer value") from None
        return cls(int(bits), **out)


def _listed(xs: tuple[int, ...]) -> str:
    return ", ".join(map(str, xs))
