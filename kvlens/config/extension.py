"""The config's extension point: set settings research adds to the ``mikv`` section.

The stable section (``kvlens.config.schema.MikvSettings``) holds the knobs of the default run:
attention sinks (``sink_tokens``) and the channel balancer. A research set policy (which held
tokens keep a copy, ``kvlens.cache.sets``) adds its own keys to that section: a frozen settings
class implementing ``SetSettings`` registers itself with ``register`` (``kvlens.research`` does
when it is imported), and the section's ``importance`` holds one. A config file that names keys
no registered class reads is refused, saying to import ``kvlens.research`` (the CLI does); a key
whose value is ``null`` or ``0`` asks for nothing and reads as absent, so files written with
the section's research keys switched off load without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from kvlens.errors import ConfigError


class SetSettings(Protocol):
    """A research set policy's settings in the ``mikv`` section of a config."""

    #: its JSON keys in the section
    keys: ClassVar[tuple[str, ...]]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SetSettings:
        """Read its keys (a ``ConfigError`` for a bad value)."""

    def to_dict(self) -> dict[str, Any]:
        """Its keys as a config file stores them."""

    def applies_to(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps this set (the others keep the sinks alone)."""

    def check_model(self, num_layers: int) -> None:
        """A ``ConfigError`` unless it fits a model of ``num_layers`` layers."""

    def policy(self, sink_tokens: int):
        """The ``kvlens.cache.sets.SetPolicy`` a cache layer keeps its set with."""


_REGISTRY: dict[str, type] = {}  # JSON key -> settings class


def register(cls: type) -> type:
    """Make ``cls`` (a ``SetSettings``) read its keys of the ``mikv`` section."""
    for key in cls.keys:
        if _REGISTRY.get(key, cls) is not cls:
            raise ValueError(f"mikv key {key!r} is registered twice")
        _REGISTRY[key] = cls
    return cls


def registered_keys() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def asks(value: Any) -> bool:
    """Whether a research key's value asks for anything (``null`` and ``0`` do not)."""
    return value is not None and (isinstance(value, bool) or value != 0)


def read_settings(data: Mapping[str, Any], stable: tuple[str, ...]) -> Any:
    """The registered settings named by the keys of section ``data`` outside ``stable``
    (``None``: none asks for anything); a ``ConfigError`` for keys nothing reads."""
    extra = {k: v for k, v in data.items() if k not in stable}
    unknown = sorted((k for k in extra if k not in _REGISTRY), key=str)
    if unknown:
        asked = [k for k in unknown if asks(extra[k])]
        if not asked:
            extra = {k: v for k, v in extra.items() if k in _REGISTRY}
        else:
            allowed = ", ".join((*stable, *_REGISTRY))
            raise ConfigError(f"'mikv': unknown keys {asked}; allowed: {allowed} (the keys of a "
                              "research set policy are read once kvlens.research is imported; "
                              "the kvlens CLI imports it).")
    owners = {_REGISTRY[k] for k, v in extra.items() if asks(v)}
    if not owners:
        return None
    if len(owners) > 1:
        raise ConfigError(f"'mikv': keys {sorted(extra)} belong to different set policies; "
                          "give one.")
    cls = owners.pop()
    return cls.from_dict({k: v for k, v in extra.items() if k in cls.keys})
