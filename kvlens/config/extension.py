"""The config's extension point: a research set policy's own top-level key.

The stable ``protect`` section (``kvlens.config.schema.ProtectSettings``) holds the knobs of the
default run: attention sinks and the key-channel balancer. A research set policy (which held
tokens keep a copy, ``kvlens.cache.sets``) reads its own top-level key of a config: a frozen
settings class implementing ``SetSettings`` registers it with ``register`` (``kvlens.research``
does when it is imported), and ``ProtectSettings.importance`` holds one. A config that names a
key no registered class reads is refused, saying to import ``kvlens.research`` (the CLI does);
a key whose value is ``null`` asks for nothing and reads as absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from kvlens.errors import ConfigError


class SetSettings(Protocol):
    """A research set policy's settings: the object under its top-level key of a config."""

    #: its top-level JSON key
    key: ClassVar[str]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SetSettings | None:
        """Read its object (``None``: it asks for nothing; a ``ConfigError`` for a bad value)."""

    def to_dict(self) -> dict[str, Any]:
        """Its object as a config file stores it."""

    def applies_to(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps this set (the others keep the sinks alone)."""

    def check_model(self, num_layers: int) -> None:
        """A ``ConfigError`` unless it fits a model of ``num_layers`` layers."""

    def policy(self, sink_tokens: int):
        """The ``kvlens.cache.sets.SetPolicy`` a cache layer keeps its set with."""


_REGISTRY: dict[str, type] = {}  # top-level JSON key -> settings class


def register(cls: type) -> type:
    """Make ``cls`` (a ``SetSettings``) read its top-level key of a config."""
    if _REGISTRY.get(cls.key, cls) is not cls:
        raise ValueError(f"config key {cls.key!r} is registered twice")
    _REGISTRY[cls.key] = cls
    return cls


def read_settings(data: Mapping[str, Any], stable: tuple[str, ...]) -> Any:
    """The registered settings named by the top-level keys of config ``data`` outside
    ``stable`` (``None``: none asks for anything); a ``ConfigError`` for keys nothing reads."""
    extra = {k: v for k, v in data.items() if k not in stable}
    unknown = sorted((k for k in extra if k not in _REGISTRY), key=str)
    if unknown:
        allowed = ", ".join((*stable, *_REGISTRY))
        raise ConfigError(f"Unknown KV config keys {unknown}; allowed: {allowed} (the key of a "
                          "research set policy is read once kvlens.research is imported; the "
                          "kvlens CLI imports it).")
    found = [s for s in (_REGISTRY[k].from_dict(v) for k, v in extra.items() if v is not None)
             if s is not None]
    if len(found) > 1:
        raise ConfigError(f"Keys {sorted(extra)} belong to different set policies; give one.")
    return found[0] if found else None
