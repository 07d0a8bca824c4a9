"""The lab (docs/internals/architecture.md, layer 11', says what each module plugs into when
this package is imported: ``mikv``, ``heavy_hitters``, ``sets``).

The door behind ``kvlens recommend --set NAME=VALUE``: a lever is an option of
``RecommendOptions`` (or of the engine targets' ``TargetOptions``) that is not a main option,
either a **knob of the default run** (every run uses it at its default) or an **experiment**
(no default uses it: the registered extensions and their settings), each ablated in
docs/lab-notes/. ``levers`` lists them, ``parse_settings`` parses ``NAME=VALUE`` and
``describe`` prints ``--set list``. A knob's code stays where its layer puts it.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, fields
from typing import Any

from kvlens.deploy.targets import TargetOptions
from kvlens.errors import InputError
from kvlens.recommend.extension import registered
from kvlens.recommend.options import RESEARCH, RecommendOptions
from kvlens.research import (
    mikv,  # noqa: F401  (registers the MiKV set twins)
    sets,  # noqa: F401  (registers MiKV's importance set and presets)
)

#: owners of a lever: the per-layer recommendation and the engine targets
RECOMMEND, TARGET = "recommend", "target"
#: levers of ``TargetOptions`` (its fields carry no metadata of their own): name -> (field, help)
TARGET_LEVERS = {
    "kld-anchors": ("anchors", "engine targets with --max-kld: settings whose KLD is measured "
                    "to fit the predictor"),
    "rotation": ("rotation", ""),  # the per-layer lever of that name (its help) sets it too
}
ON = ("on", "true", "yes", "1")
OFF = ("off", "false", "no", "0")
NONE = ("none", "default")


@dataclass(frozen=True)
class Lever:
    """One research lever: its ``name`` (``--set NAME=...``), the dataclass ``field`` it sets
    for each owner (``owners``: ``RECOMMEND`` and/or ``TARGET``), its type and default."""

    name: str
    field: str
    owners: tuple[str, ...]
    kind: Any  # the field's annotation, resolved
    default: Any
    help: str
    #: an experiment no default run uses; otherwise a knob of the default run (set at its
    #: default in every run)
    experiment: bool = False

    @property
    def syntax(self) -> str:
        """What VALUE looks like."""
        base, optional = _unwrap(self.kind)
        if base is bool:
            words = "on|off"
        elif typing.get_origin(base) is tuple:
            words = f"{typing.get_args(base)[0].__name__},..."
        else:
            words = base.__name__
        return f"{words}|none" if optional else words


def _unwrap(kind) -> tuple[Any, bool]:
    """``(type, optional)`` of an annotation such as ``int | None``."""
    args = typing.get_args(kind)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return kind, False


def levers() -> dict[str, Lever]:
    """Every lever by name: the registered extensions', those of ``RecommendOptions`` in its
    order, then the target-only ones."""
    out: dict[str, Lever] = {}
    # first each registered extension's, as when they were options' fields: its switch (``--set
    # NAME=on``, field ``NAME``) and its settings (field ``NAME_FIELD``), all experiments
    for name, cls in registered().items():
        out[name] = Lever(name, name, (RECOMMEND,), bool, False, cls.help, True)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            out[f.metadata["lever"]] = Lever(f.metadata["lever"], f"{name}_{f.name}",
                                             (RECOMMEND,), hints[f.name], f.default,
                                             f.metadata["help"], True)
    hints = typing.get_type_hints(RecommendOptions)
    target_fields = {f for f, _ in TARGET_LEVERS.values()}
    for f in fields(RecommendOptions):
        if f.metadata.get("door") != RESEARCH:
            continue
        name = f.metadata["lever"]
        owners = (RECOMMEND, TARGET) if name in TARGET_LEVERS and f.name in target_fields \
            else (RECOMMEND,)
        out[name] = Lever(name, f.name, owners, hints[f.name], f.default, f.metadata["help"])
    target_hints = typing.get_type_hints(TargetOptions)
    defaults = {f.name: f.default for f in fields(TargetOptions)}
    for name, (field_name, text) in TARGET_LEVERS.items():
        if name not in out:
            out[name] = Lever(name, field_name, (TARGET,), target_hints[field_name],
                              defaults[field_name], text)
    return out


def parse_value(lever: Lever, text: str) -> Any:
    """``text`` as a value of ``lever``'s type, or an ``InputError`` that shows the syntax."""
    base, optional = _unwrap(lever.kind)
    word = text.strip().lower()
    try:
        if optional and word in NONE:
            return None
        if base is bool:
            if word in ON or word in OFF:
                return word in ON
            raise ValueError
        if typing.get_origin(base) is tuple:
            item = typing.get_args(base)[0]
            values = tuple(item(x.strip()) for x in text.split(",") if x.strip())
            if not values:
                raise ValueError
            return values
        return base(text.strip())
    except ValueError:
        raise InputError(f"--set {lever.name}={text!r}: expected {lever.syntax} "
                         f"(e.g. --set {lever.name}={_example(lever)}).") from None


def _example(lever: Lever) -> str:
    d = lever.default
    if isinstance(d, bool):
        return "off" if d else "on"
    if isinstance(d, tuple):
        return ",".join(map(str, d))
    return "none" if d is None else str(d)


def parse_settings(items: typing.Iterable[str]) -> dict[str, dict[str, Any]]:
    """``["mikv=on", "mikv-bits=4"]`` -> ``{RECOMMEND: {field: value}, TARGET: {...}}``
    (an owner's dict holds only its own levers), refusing an unknown name (with the nearest
    names), a missing ``=``, a value of the wrong type or a lever given twice."""
    known = levers()
    out: dict[str, dict[str, Any]] = {RECOMMEND: {}, TARGET: {}}
    seen: set[str] = set()
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            raise InputError(f"--set {item!r}: expected NAME=VALUE, e.g. --set mikv=on "
                             "(--set list prints every lever).")
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise InputError(f"--set: unknown lever {name!r}; {hint}allowed: "
                             f"{', '.join(known)} (--set list describes them).")
        if name in seen:
            raise InputError(f"--set {name} is given twice; give it once.")
        seen.add(name)
        lever = known[name]
        parsed = parse_value(lever, value)
        for owner in lever.owners:
            out[owner][lever.field] = parsed
    return out


#: the two groups ``--set list`` prints, experiments last
GROUPS = ((False, "Knobs of the default run (kvlens recommend --set NAME=VALUE; every run uses "
                  "each at its default):"),
          (True, "Experiments (--set NAME=VALUE; no default uses them, each ablated in "
                 "docs/lab-notes/):"))


def describe() -> str:
    """The levers as ``--set list`` prints them, knobs of the default run apart from
    experiments: name, syntax, default and what it does."""
    known = levers().values()
    width = max(len(lv.name) + len(lv.syntax) for lv in known) + 3
    lines: list[str] = []
    for experiment, title in GROUPS:
        lines += ([""] if lines else []) + [title]
        for lv in (lv for lv in known if lv.experiment == experiment):
            default = ("on" if lv.default else "off") if isinstance(lv.default, bool) \
                else _example(lv)
            where = "" if lv.owners == (RECOMMEND,) else \
                " [engine targets]" if lv.owners == (TARGET,) else " [also engine targets]"
            lines.append(f"  {lv.name}={lv.syntax}".ljust(width + 4)
                         + f"{lv.help} (default {default}){where}")
    return "\n".join(lines)

