"""Errors kvlens raises for bad input or failed work.

Every error a user can cause is a ``KvlensError`` subclass with a message that says what was
wrong and how to fix it. The CLI turns these into one red line and exit code 1 (in one place:
``kvlens.cli.common.run_library_call``); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import re

_FIELD = re.compile(r"\{([a-z][a-z0-9_]*)\}")  # an option named by its field in a message


class KvlensError(Exception):
    """Base class: a user-facing problem with a message that explains the fix. The message
    names each option by its field as ``{field}`` (e.g. ``"Unknown {dtype} 'x'; allowed:
    ..."``): the library's text says the field (``dtype``), the CLI's says the flag it was given
    as (``render(name)``: ``--dtype``)."""

    def __init__(self, template: str = "", *args):
        self.template = str(template)
        self.fields = tuple(dict.fromkeys(_FIELD.findall(self.template)))
        super().__init__(self.render(), *args)

    def render(self, name=lambda field: field) -> str:
        """The message with each ``{field}`` written as ``name(field)``."""
        return _FIELD.sub(lambda m: name(m.group(1)), self.template)

    def __reduce__(self):  # from a worker process with its fields intact
        return type(self), (self.template, *self.args[1:])


class ModelLoadError(KvlensError):
    """The model could not be found, loaded, or is not supported."""


class InputError(KvlensError):
    """Bad options or input data (text, layer spec, paths, group sizes...)."""


class OptionError(InputError):
    """A bad option value, named by its field (``{field}``, ``KvlensError``)."""


class PlacementError(OptionError):
    """A device map, memory limit or offload folder that cannot place the model."""


class CaptureFileError(KvlensError):
    """A capture file is missing, foreign, incomplete, corrupt or of a newer schema."""


class ConfigError(KvlensError):
    """A quantization/generation config is malformed or does not fit the model."""


class NumericalError(KvlensError):
    """Activations contained NaN or Inf."""


class BackendError(KvlensError):
    """A requested compute backend (e.g. Triton) is unavailable here."""


def is_int(value: object, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is a whole number (not a bool) in ``[low, high]`` (``high`` None: no
    upper bound): the check behind every count, size and index option."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))
