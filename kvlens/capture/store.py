"""The kvlens capture file: HDF5 layout, writer and lazy reader (the only module that knows it).

The layout (schema version 1) is documented in ``docs/reference/capture-format.md``. bfloat16
has no HDF5 type: it is stored as its raw 16-bit pattern (uint16, dataset attribute
``dtype="bfloat16"``). Writers create the file under a temporary name, set ``complete=True``
last and rename; readers refuse files without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvlens.errors import CaptureFileError, InputError
from kvlens.model.mla import MlaShape
from kvlens.model.shape import ModelShape
from kvlens.text.selection import format_index_spec

FORMAT_NAME = "kvlens-capture"
SCHEMA_VERSION = 1
TENSORS = ("q", "k", "v", "q_pre", "k_pre")
ROPE_TABLES = ("rope_cos", "rope_sin")
DIMS = ("sample", "head", "token", "channel")
STORAGE_DTYPES = ("float16", "float32", "bfloat16")
COMPRESSIONS = ("none", "gzip", "lzf")


@dataclass(frozen=True)
class CaptureMeta:
    """Root attributes of a capture file, typed: the captured model's ``shape`` (``windows`` of
    the captured layers only, dtype read as 2 bytes, one device; ``has_rope``: the file holds RoPE)
    and what was captured how."""

    model: str
    shape: ModelShape
    rope_layout: str
    rotary_dim: int
    compute_dtype: str
    storage_dtype: str
    num_samples: int
    num_tokens: int
    layers: tuple[int, ...]
    created: str = ""
    model_source: str = ""
    text_source: str = ""
    kvlens_version: str = ""
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerAttrs:
    layer_index: int
    scaling: float
    sliding_window: int  # 0 = full causal attention
    logit_softcap: float  # 0 = none
    #: learned attention-sink logit per query head (gpt-oss's ``s_aux``); () = none
    sinks: tuple[float, ...] = ()


def layer_key(layer: int) -> str:
    return f"layers/{layer:03d}"


class CaptureWriter:
    """Creates a capture file atomically: writes ``<path>.partial-<pid>``, renames on ``finish``;
    leaving the context with an exception deletes it, so no file looks complete that is not."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False,
                 storage_dtype: str = "float16", compression: str = "none"):
        import h5py  # noqa: F401  (fail early if missing)

        self.path = Path(path)
        for what, value, allowed in (("storage dtype", storage_dtype, STORAGE_DTYPES),
                                     ("compression", compression, COMPRESSIONS)):
            if value not in allowed:
                raise InputError(f"Unknown {what} {value!r}; allowed: {', '.join(allowed)}.")
        if self.path.exists() and not overwrite:
            raise InputError(f"{self.path} already exists; pass {{overwrite}} to replace it.")
        if self.path.is_dir():
            raise InputError(f"{self.path} is a directory; give a file name such as run.h5.")
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if not parent.is_dir():
            raise InputError(f"Output directory {parent} does not exist; create it first.")
        if not os.access(parent, os.W_OK):
            raise InputError(f"Output directory {parent} is not writable.")
        self.storage_dtype = storage_dtype
        self.compression = None if compression == "none" else compression
        self.tmp_path = parent / f".{self.path.name}.partial-{os.getpid()}"
        self._file = None
        self._datasets: dict[tuple[int, str], Any] = {}

    def __enter__(self) -> CaptureWriter:
        import h5py

        try:
            self._file = h5py.File(self.tmp_path, "w")
        except OSError as exc:
            raise InputError(f"Cannot write {self.tmp_path}: {exc}") from exc
        self._file.attrs["kvlens_format"] = FORMAT_NAME
        self._file.attrs["kvlens_schema_version"] = SCHEMA_VERSION
        self._file.attrs["complete"] = False
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if exc_type is not None:
            self.tmp_path.unlink(missing_ok=True)

    # -- layout -------------------------------------------------------------------------
    def begin(self, meta: CaptureMeta) -> None:
        """Write root attributes and create every dataset (empty, chunked per sample and head)."""
        import numpy as np

        f = self._file
        f.attrs.update(_meta_to_attrs(meta))
        s, t, d = meta.num_samples, meta.num_tokens, meta.shape.head_dim
        tok = f.create_dataset("tokens", shape=(s, t), dtype="int32")
        _label(tok, ("sample", "token"))
        store_dtype = np.uint16 if self.storage_dtype == "bfloat16" else self.storage_dtype
        for layer in meta.layers:
            g = f.create_group(layer_key(layer))
            self.set_layer_attrs(LayerAttrs(layer, 0.0, 0, 0.0))
            for name in TENSORS:
                heads = meta.shape.num_attention_heads if name.startswith("q") else \
                    meta.shape.num_key_value_heads
                ds = g.create_dataset(name, shape=(s, heads, t, d), dtype=store_dtype,
                                      chunks=(1, 1, t, d),
                                      compression=self.compression)
                ds.attrs["dtype"] = self.storage_dtype
                _label(ds, DIMS)
                self._datasets[(layer, name)] = ds

    def set_layer_attrs(self, la: LayerAttrs) -> None:
        import numpy as np

        attrs = self._file[layer_key(la.layer_index)].attrs
        attrs.update({
            "layer_index": la.layer_index, "scaling": la.scaling,
            "sliding_window": la.sliding_window, "logit_softcap": la.logit_softcap})
        if la.sinks:  # absent = none (as in files written before sinks were recorded)
            attrs["attention_sinks"] = np.asarray(la.sinks, dtype=np.float32)
        elif "attention_sinks" in attrs:
            del attrs["attention_sinks"]

    def write_tokens(self, sample: int, token_ids) -> None:
        self._file["tokens"][sample] = token_ids

    def write(self, layer: int, name: str, sample: int, tensor) -> None:
        """Store ``tensor`` ``[H, T, D]`` (torch) for one layer, tensor name and sample."""
        import torch

        if self.storage_dtype == "bfloat16":  # its raw 16 bits (module docstring)
            bits16 = tensor.detach().to(torch.bfloat16).view(torch.int16)
            array = bits16.cpu().numpy().view("uint16")
        else:
            array = tensor.detach().to(getattr(torch, self.storage_dtype)).cpu().numpy()
        self._datasets[(layer, name)][sample] = array

    def write_rope(self, layer: int, layout: str, cos, sin) -> None:
        """Store a layer's normalised RoPE tables ``cos``, ``sin`` ``[T, R]`` (torch; positions
        ``0..T-1``), or mark a layer that applies no RoPE (``cos`` None)."""
        g = self._file[layer_key(layer)]
        g.attrs["applies_rope"] = cos is not None
        if cos is None:
            return
        for name, table in zip(ROPE_TABLES, (cos, sin)):
            ds = g.create_dataset(name, data=table.detach().float().cpu().numpy())
            ds.attrs["dtype"] = "float32"
            ds.attrs["layout"] = layout
            _label(ds, ("token", "channel"))

    def set_attr(self, key: str, value: Any) -> None:
        self._file.attrs[key] = value

    def finish(self) -> Path:
        """Mark complete, close and atomically rename to the final path."""
        self._file.attrs["complete"] = True
        self._file.close()
        self._file = None
        os.replace(self.tmp_path, self.path)
        return self.path


def _label(ds, names: Iterable[str]) -> None:
    for i, n in enumerate(names):
        ds.dims[i].label = n


#: root attributes in the order they are written, those read from ``meta.shape`` first
_SHAPE_ATTRS = ("architecture", "model_type", "num_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "has_rope")
_ATTR_ORDER = ("kvlens_version", "model", "model_source", *_SHAPE_ATTRS, "rope", "rope_layout",
               "rotary_dim", "compute_dtype", "storage_dtype", "created", "num_samples",
               "num_tokens", "layers", "attention_layers", "kv_shared", "mla", "text_source")
_META_KEYS = {*_ATTR_ORDER, "kvlens_format", "kvlens_schema_version", "complete"}


def _meta_to_attrs(meta: CaptureMeta) -> dict[str, Any]:
    import numpy as np

    shape = meta.shape
    derived = {
        "rope": json.dumps(shape.rope, sort_keys=True),
        "created": meta.created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "layers": np.asarray(meta.layers, dtype=np.int32),
        "attention_layers": np.asarray(shape.attention_layers, dtype=np.int32),
        "kv_shared": shape.kv_shared,
        "mla": json.dumps(asdict(shape.mla)) if shape.mla is not None else None,  # MLA only
    }
    attrs = {k: derived[k] if k in derived else getattr(shape if k in _SHAPE_ATTRS else meta, k)
             for k in _ATTR_ORDER if k != "mla" or shape.mla is not None}
    return {**attrs, **{k: (json.dumps(v) if isinstance(v, (dict, list)) else v)
                        for k, v in meta.extra.items()}}


def _attr(value):
    """h5py attribute -> plain python."""
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    if isinstance(value, bytes):
        return value.decode()
    return value


@dataclass(frozen=True, eq=False)
class StoredRope:
    """One layer's RoPE as captured: whether it applies RoPE (``False``: a NoPE layer, ``q_pre ==
    q``) and its tables at positions ``0..T-1``, float32 ``[T, R]``, paired as ``rope_layout``."""

    applies: bool
    cos: Any = None
    sin: Any = None


class LayerData:
    """Lazy access to one captured layer; every read returns float32 torch ``[S, H, T, D]``."""

    def __init__(self, group, storage_dtype: str):
        self._group = group
        self._storage_dtype = storage_dtype
        a = group.attrs
        sinks = tuple(float(x) for x in a["attention_sinks"]) if "attention_sinks" in a else ()
        self.attrs = LayerAttrs(int(a["layer_index"]), float(a["scaling"]),
                                int(a["sliding_window"]), float(a["logit_softcap"]), sinks)

    @property
    def index(self) -> int:
        return self.attrs.layer_index

    def read(self, name: str, samples: slice | Sequence[int] | None = None,
             heads: slice | Sequence[int] | None = None):
        """Read one tensor (``q``, ``k``, ``v``, ``q_pre``, ``k_pre``), optionally a subset of
        samples and heads (index lists must be increasing)."""
        import numpy as np
        import torch

        if name not in TENSORS:
            raise InputError(f"Unknown tensor {name!r}; allowed: {', '.join(TENSORS)}.")
        ds = self._group[name]
        s = slice(None) if samples is None else samples
        h = slice(None) if heads is None else heads
        arr = np.ascontiguousarray(ds[s, h] if isinstance(s, slice) else ds[s][:, h])
        if self._storage_dtype == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).float()
        return torch.from_numpy(arr).float()

    def rope(self) -> StoredRope | None:
        """The layer's RoPE as captured (``StoredRope``), or ``None`` where the file does not
        say (files without RoPE, and captures written before the tables were stored)."""
        import torch

        if "applies_rope" not in self._group.attrs:
            return None
        if not bool(self._group.attrs["applies_rope"]):
            return StoredRope(False)
        cos, sin = (torch.from_numpy(self._group[n][...]).float() for n in ROPE_TABLES)
        return StoredRope(True, cos, sin)


class Capture:
    """An open capture file. ``with open_capture(path) as cap: cap.layer(3).read("k")``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = _open_validated(self.path)
        self.meta = _meta_from_file(self._file)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def layers(self) -> tuple[int, ...]:
        return self.meta.layers

    def tokens(self):
        import torch

        return torch.from_numpy(self._file["tokens"][...].astype("int64"))

    def layer(self, layer: int) -> LayerData:
        key = layer_key(layer)
        if layer not in self.meta.layers or key not in self._file:
            raise InputError(f"Layer {layer} is not in {self.path}; captured layers: "
                             f"{format_index_spec(self.meta.layers)}.")
        return LayerData(self._file[key], self.meta.storage_dtype)


def open_capture(path: str | os.PathLike) -> Capture:
    """Open a capture file lazily, validating that it is a complete kvlens capture."""
    return Capture(path)


def _open_validated(path: Path):
    import h5py

    if not path.exists():
        raise CaptureFileError(f"Capture file not found: {path}. Create one with `kvlens capture`.")
    if path.is_dir():
        raise CaptureFileError(f"{path} is a directory, not a capture file.")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CaptureFileError(
            f"{path} is not a readable HDF5 file ({exc}); it may be corrupt or truncated. "
            "Re-run `kvlens capture`.") from exc
    try:
        fmt = _attr(f.attrs.get("kvlens_format", ""))
        if fmt != FORMAT_NAME:
            raise CaptureFileError(f"{path} is an HDF5 file but not a kvlens capture "
                                   "(no kvlens_format attribute). Create one with `kvlens capture`.")
        version = int(_attr(f.attrs.get("kvlens_schema_version", -1)))
        if version > SCHEMA_VERSION:
            raise CaptureFileError(
                f"{path} uses capture schema version {version}, newer than this kvlens supports "
                f"({SCHEMA_VERSION}). Upgrade kvlens.")
        if version < 1:
            raise CaptureFileError(f"{path} has an invalid schema version {version}.")
        if not bool(_attr(f.attrs.get("complete", False))):
            raise CaptureFileError(
                f"{path} is an incomplete capture (the capture was interrupted or failed). "
                "Re-run `kvlens capture` to create it again.")
        missing = [k for k in ("num_layers", "head_dim", "layers", "storage_dtype")
                   if k not in f.attrs]
        if missing or "tokens" not in f:
            raise CaptureFileError(f"{path} is a damaged kvlens capture (missing "
                                   f"{', '.join(missing) or 'tokens'}).")
    except Exception:
        f.close()
        raise
    return f


def _meta_from_file(f) -> CaptureMeta:
    attrs = f.attrs
    a = {k: _attr(v) for k, v in attrs.items()}
    n, layers = int(a["num_layers"]), tuple(int(x) for x in attrs["layers"][()])
    windows = {i: int(f[layer_key(i)].attrs.get("sliding_window", 0)) or None for i in layers
               if layer_key(i) in f}
    shape = ModelShape(
        n, int(a["num_attention_heads"]), int(a["num_key_value_heads"]), int(a["head_dim"]),
        # files written before hybrid models were supported: every layer has a KV cache
        kv_layers=tuple(int(x) for x in attrs["attention_layers"][()])
        if "attention_layers" in attrs else (),
        windows=tuple(windows.get(i) for i in range(n)),
        mla=MlaShape(**json.loads(a["mla"])) if "mla" in a else None,
        architecture=str(a.get("architecture", "")), model_type=str(a.get("model_type", "")),
        has_rope=bool(a.get("has_rope", False)), rope=json.loads(a.get("rope", "{}") or "{}"))
    texts = ("model", "compute_dtype", "created", "model_source", "text_source", "kvlens_version")
    return CaptureMeta(
        shape=shape, rope_layout=str(a.get("rope_layout", "none")),
        rotary_dim=int(a.get("rotary_dim", 0)), storage_dtype=str(a["storage_dtype"]),
        num_samples=int(a["num_samples"]), num_tokens=int(a["num_tokens"]), layers=layers,
        schema_version=int(a["kvlens_schema_version"]),
        extra={k: v for k, v in a.items() if k not in _META_KEYS},
        **{k: str(a.get(k, "")) for k in texts})
