"""Candidate extensions: research that adds *twins* of the stable candidates (a base candidate
with something kept beside its codes, ``Candidate.twin``), behind one declared protocol
(``CandidateExtension``) and a registry. Stable recommend names no extension: ``kvlens.research``
registers them when imported, and ``RecommendOptions(extensions=...)`` switches one on by object
or by name (``resolve``; an unregistered name says what to import). The research door's flat
levers reach an extension as ``NAME`` (its switch) and ``NAME_FIELD`` (``fold_levers``).
docs/internals/architecture.md (how to add a recommend candidate) says what each method does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from kvlens.errors import InputError

#: the package whose import registers the research extensions
RESEARCH_PACKAGE = "kvlens.research"


class Twin(NamedTuple):
    """A twin's extension ``name`` and config-wide ``setting`` (one of its ``settings``)."""

    extension: str
    setting: tuple[Any, ...]


class TwinMeasurer(Protocol):
    """An extension's measurement of its twins on one capture layer (``q``, ``k``, ``v``)."""

    #: the profile stage its work is counted under (``kvlens.recommend.profile.stage``)
    stage: str
    #: the first tokens a query reads exact beside a twin (the sinks the cache keeps apart)
    exact_sinks: int

    def variant(self, c, base, stream, rows: slice):
        """Twin ``c``'s ``Variant`` with the layer's window moving as ``stream`` (a
        ``Stream``), for the query ``rows`` measured; ``base`` is its base candidate's."""


@runtime_checkable
class CandidateExtension(Protocol):
    """A research extension of recommend's candidates: a frozen (hashable) settings object,
    registered by class (``register``)."""

    #: its name: ``Twin.extension``, ``extensions=(name,)`` and its switch lever
    name: ClassVar[str]

    def settings(self, opts) -> list[tuple[Any, ...]]:
        """The config-wide settings the allocation solves for separately (``[]``: none)."""

    def twins(self, cands: Sequence, opts) -> list:
        """The twins of the stable ``cands`` it offers (``Candidate`` s with ``twin`` set)."""

    def words(self, setting: tuple[Any, ...]) -> tuple[str, str]:
        """``(short, label)`` suffixes of a twin at ``setting`` (``Candidate.short``,
        ``Candidate.label``)."""

    def offered_on(self, attrs) -> bool:
        """Whether a capture layer with these attributes can keep its twins."""

    def measurer(self, q, k, v, attrs, opts) -> TwinMeasurer:
        """What measures its twins on one capture layer."""

    def held(self, setting: tuple[Any, ...], opts):
        """The config's sinks-and-balancer section (``kvlens.config.ProtectSettings``) a layer
        storing a twin at ``setting`` keeps (what ``kvlens.cache.layout`` prices)."""

    def write(self, section, chosen: Mapping[int, tuple[Any, ...]], opts):
        """The config's section with the twins ``chosen`` (layer -> setting) added; ``section``
        is the stable one (None: no sinks and no balancer)."""

    def note(self, settings: Sequence[tuple[Any, ...]], best: float, plain: float) -> str:
        """What the allocation says about its settings: the best ``objective`` and the best
        one without a twin (``plain``)."""


_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Register extension class ``cls`` (its defaults are what ``resolve(cls.name)`` gives);
    usable as a class decorator."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"candidate extension {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type]:
    """The registered extension classes by name."""
    return dict(_REGISTRY)


def extension_class(name: str) -> type:
    """The extension class registered as ``name`` (its defaults say what it says of a twin,
    which depends on the twin's setting only); an ``InputError`` that says what to import when
    none is (it is research: ``kvlens.research`` registers it)."""
    if name not in _REGISTRY:
        known = ", ".join(_REGISTRY) or "none registered"
        raise InputError(f"The candidate extension {name!r} is not registered ({known}): it is "
                         f"research, registered when {RESEARCH_PACKAGE} is imported; "
                         f"`import {RESEARCH_PACKAGE}` first.")
    return _REGISTRY[name]


def resolve(items: Sequence[Any]) -> tuple[CandidateExtension, ...]:
    """``RecommendOptions.extensions`` as settings objects: a name becomes its registered
    class's defaults; each extension at most once."""
    out = []
    for item in items:
        ext = extension_class(item)() if isinstance(item, str) else item
        if not isinstance(ext, CandidateExtension):
            raise InputError(f"extensions: {item!r} is no candidate extension (a registered "
                             "one's name or settings object).")
        if any(e.name == ext.name for e in out):
            raise InputError(f"extensions: {ext.name!r} is given twice; give it once.")
        out.append(ext)
    return tuple(out)


def lever_fields() -> dict[str, tuple[str, str | None]]:
    """The flat lever fields of the registered extensions: ``NAME`` (its switch) and
    ``NAME_FIELD`` (a settings field) -> ``(extension name, settings field or None)``."""
    out: dict[str, tuple[str, str | None]] = {}
    for name, cls in _REGISTRY.items():
        out[name] = (name, None)
        for f in dataclasses.fields(cls):
            out[f"{name}_{f.name}"] = (name, f.name)
    return out


def fold_levers(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` by ``RecommendOptions`` field, with the extensions' flat lever fields
    (``lever_fields``) folded into ``extensions``: an extension's settings given are applied
    (and checked) even with its switch off; the switch, where given, says whether it is on."""
    flat = lever_fields()
    out = {k: v for k, v in options.items() if k not in flat}
    chosen = list(resolve(out.pop("extensions", ())))
    for name in dict.fromkeys(flat[k][0] for k in options if k in flat):
        sub = {flat[k][1]: v for k, v in options.items()
               if k in flat and flat[k][0] == name and flat[k][1] is not None}
        was = next((e for e in chosen if e.name == name), None)
        settings = dataclasses.replace(was, **sub) if was else _REGISTRY[name](**sub)
        chosen = [e for e in chosen if e.name != name] + \
            ([settings] if options.get(name, was is not None) else [])
    return out | ({"extensions": tuple(chosen)} if chosen else {})

