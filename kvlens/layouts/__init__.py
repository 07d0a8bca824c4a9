"""Storage layouts: how the cache stores one tensor's history, behind one protocol
(``protocol``). The modules outside ``_BUILT_IN`` are layouts that register themselves, imported
here when the package loads."""

import importlib
import pkgutil

from kvlens.layouts import codebook, uniform
from kvlens.layouts.dense import DenseTensor
from kvlens.layouts.protocol import (
    LAYOUT_KEY,
    Layout,
    Store,
    check_layout,
    is_layout_spec,
    kinds,
    layout_from_dict,
    layout_of,
    reference,
    register,
)

_BUILT_IN = {"protocol", "dense", "packed", "uniform", "codebook"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _BUILT_IN:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LAYOUT_KEY", "DenseTensor", "Layout", "Store", "check_layout", "codebook",
           "is_layout_spec", "kinds", "layout_from_dict",
           "layout_of", "reference", "register", "uniform"]
