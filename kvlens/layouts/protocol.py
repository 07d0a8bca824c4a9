"""The storage-layout protocol (``Layout`` and its ``Store``: what a way of storing one tensor's
history must provide) and the registry that finds the layout of a spec (how to add one:
docs/internals/architecture.md). The residual window, Hadamard rotation, pre-RoPE keys and the
balancer compose around every layout (``kvlens.cache.layer``, ``kvlens.recommend.layer_errors``).

``register`` makes a spec class a layout: the class implements ``Layout`` itself, or an adapter
wraps a spec defined lower down (``kvlens.layouts.uniform`` and ``kvlens.layouts.codebook``
adapt ``QuantSpec`` and ``CodebookSpec``); ``layout_of(spec)`` returns the ``Layout`` either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

from kvlens.errors import ConfigError

#: the JSON key naming a registered layout (absent: the uniform integer layout, ``QuantSpec``)
LAYOUT_KEY = "layout"


@runtime_checkable
class Store(Protocol):
    """One tensor's stored history ``[B, H, length, D]`` in a cache layer (positions
    ``[q_start, q_end)`` of the layer; blocks are immutable once appended)."""

    @property
    def length(self) -> int:
        """Tokens stored."""

    def append(self, x) -> None:
        """Store ``x`` ``[B, H, n * F, D]`` (whole blocks, float32) after what is held."""

    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens (whole blocks); buffers shrink to what stays."""

    def dequantize_range(self, t0: int, t1: int):
        """Tokens ``[t0, t1)`` as float32 ``[B, H, t1 - t0, D]``, as ``reconstruct`` gives
        them."""

    def named_tensors(self) -> dict:
        """Every tensor held, by part name (``kvlens.cache.layout.PARTS``)."""

    def select_batch(self, index) -> None:
        """Keep the batch rows ``index``."""


class TensorStore:
    """A ``Store`` whose history is a few tensors ``[B, H, length, *]`` that hold exactly what
    is held (a flush concatenates, a drop copies what stays): ``BUFFERS`` maps each attribute
    (``None`` until something is stored) to its part name."""

    BUFFERS: dict[str, str] = {}

    @property
    def length(self) -> int:
        first = getattr(self, next(iter(self.BUFFERS)))
        return 0 if first is None else first.shape[2]

    def extend(self, *new: torch.Tensor | None) -> None:
        """Append ``new`` (one tensor, or ``None``, per attribute of ``BUFFERS``) along tokens."""
        for name, t in zip(self.BUFFERS, new):
            if t is not None:
                old = getattr(self, name)
                setattr(self, name, t if old is None else torch.cat((old, t), dim=2))

    def _map(self, fn: Callable) -> None:
        for name in self.BUFFERS:
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def drop_front(self, n: int) -> None:
        if n:
            self._map(lambda t: t[:, :, n:].clone())

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {part: getattr(self, name) for name, part in self.BUFFERS.items()
                if getattr(self, name) is not None}

    def select_batch(self, index: torch.Tensor) -> None:
        self._map(lambda t: t[index])


@runtime_checkable
class Layout(Protocol):
    """How the cache keeps the quantized history ``[B, H, T, D]`` of one tensor: a frozen,
    JSON-serialisable spec owning its reference semantics (``reconstruct``: what recommend and
    compare-axes measure, and the store is tested equal to), its store, its held bytes (tested
    equal to what the store holds), its JSON form and its streaming rules."""

    #: its name in JSON (``{"layout": kind, ...}``) and in messages
    kind: str

    @property
    def bits(self) -> int:
        """Code bits per element (what labels and the bit-width vocabulary show)."""

    @property
    def label(self) -> str:
        """A short human label, e.g. ``2-bit per-channel G32``."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``layout_from_dict`` reads it back)."""

    def flush_block(self, residual_tokens: int, flush_tokens: int = 0) -> int:
        """``F``: tokens quantized together as one block."""

    def check(self, residual_tokens: int, head_dim: int, what: str = "",
              flush_tokens: int = 0) -> None:
        """Raise ``ConfigError`` (prefixed ``what``) unless it can be stored for ``head_dim``
        with this window."""

    def reconstruct(self, x, block: int, scale_dtype: str = "float16"):
        """The reference: float32 ``x_hat`` of ``x`` stored block by block (``block`` tokens;
        a partial tail block as the store would hold it once complete)."""

    def new_store(self, head_dim: int, block: int, scale_dtype: str = "float16") -> Store:
        """An empty store for a cache layer with flush block ``block``."""

    def part_bytes(self, tokens: int, head_dim: int, block: int,
                   scale_dtype: str = "float16") -> dict[str, int]:
        """Bytes a store holding ``tokens`` tokens (a multiple of ``block``) of one (batch row,
        KV head) holds, by part."""


@dataclass(frozen=True)
class SpecLayout:
    """The base of a ``Layout`` that adapts a spec defined lower down (``QuantSpec``,
    ``CodebookSpec``): its bits, label and JSON form are the spec's."""

    spec: Any

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def label(self) -> str:
        return self.spec.label

    def to_dict(self) -> dict[str, Any]:
        return self.spec.to_dict()


class FieldsLayout:
    """The base of a layout that is its own frozen dataclass: its JSON form is ``{"layout":
    kind, ...its fields}`` (a field without a default is required), and it streams as a
    per-token spec does (``F``: the flush block, else the window, else 1)."""

    kind: str

    def to_dict(self) -> dict[str, Any]:
        return {LAYOUT_KEY: self.kind, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        names = [f.name for f in fields(cls)]
        extra = sorted(set(data) - {LAYOUT_KEY, *names})
        if extra:
            raise ConfigError(f"Unknown {cls.kind} spec keys {extra}; allowed: "
                              f"{', '.join((LAYOUT_KEY, *names))}.")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise ConfigError(f"{cls.kind} spec is missing {missing}; required: "
                              f"{', '.join(missing)}.")
        return cls(**{k: data[k] for k in names if k in data})

    def flush_block(self, residual_tokens: int, flush_tokens: int = 0) -> int:
        return flush_tokens or residual_tokens or 1


_ADAPTERS: dict[type, Callable[[Any], Layout]] = {}
_KINDS: dict[str, Callable[[Mapping[str, Any]], Any]] = {}


def register(spec_type: type, kind: str, from_dict: Callable[[Mapping[str, Any]], Any],
             adapter: Callable[[Any], Layout] | None = None) -> None:
    """Make ``spec_type`` a layout named ``kind``: ``from_dict`` reads its JSON form,
    ``adapter(spec)`` is its ``Layout`` (``None``: the spec is its own layout)."""
    if kind in _KINDS and _KINDS[kind] is not from_dict:
        raise ValueError(f"layout kind {kind!r} is registered twice")
    _KINDS[kind] = from_dict
    _ADAPTERS[spec_type] = adapter or (lambda spec: spec)


def kinds() -> tuple[str, ...]:
    """Every registered layout name."""
    return tuple(_KINDS)


def is_layout_spec(spec: Any) -> bool:
    return type(spec) in _ADAPTERS


def layout_of(spec: Any) -> Layout:
    """The ``Layout`` of a registered spec; ``ConfigError`` for anything else."""
    adapter = _ADAPTERS.get(type(spec))
    if adapter is None:
        raise ConfigError(f"Not a storage layout: {spec!r}; allowed: a spec of "
                          f"{', '.join(kinds())}.")
    return adapter(spec)


def layout_from_dict(data: Any, default: str) -> Any:
    """A spec from its JSON form: ``data["layout"]`` names it (``default`` when absent)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"A layout spec must be a JSON object, got {type(data).__name__}.")
    kind = data.get(LAYOUT_KEY, default)
    read = _KINDS.get(kind)
    if read is None:
        raise ConfigError(f"Unknown layout {kind!r}; allowed: {', '.join(kinds())} (research "
                          "layouts register when kvlens.research is imported; the CLI does).")
    return read(data)


def check_layout(spec: Any, residual_tokens: int, head_dim: int, what: str = "",
                 flush_tokens: int = 0) -> None:
    """``ConfigError`` unless ``spec`` can be stored for ``head_dim`` (``Layout.check``)."""
    layout_of(spec).check(residual_tokens, head_dim, what, flush_tokens)


def reference(spec: Any, scale_dtype: str = "float16") -> Callable:
    """``x -> x_hat``: ``spec``'s ``reconstruct`` with every token of ``x`` stored as one block
    (what recommend's candidates and compare-axes' variants are measured with; rotation and
    pre-RoPE compose around it, ``kvlens.quant.quantize_rotated``)."""
    layout = layout_of(spec)
    return lambda x: layout.reconstruct(x, x.shape[2], scale_dtype)
