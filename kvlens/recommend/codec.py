"""One generic codec between dataclasses and a data-only file: ``DataclassCodec(root, format,
version, shared)`` writes an instance of the dataclass ``root`` as bytes (``encode``) and reads
it back exactly (``decode``), driven by the dataclasses' field annotations, so a new field needs
no new serializer.

A file holds data only (no pickle, no ``eval``), so one planted in a shared directory cannot run
code: an uncompressed zip (a numpy ``.npz``) of ``document.npy``, the UTF-8 JSON document as
uint8, and ``a0.npy``, ``a1.npy``..., the numeric or boolean arrays it refers to by index. The
document is ``{"format", "version", <root's fields>, <a table per shared type>}``; a value is
written as its annotation says: scalars as JSON (``T | None`` and scalar unions as the member
the value is), lists and tuples as lists, a ``dict`` as ``[key, value]`` pairs, a dataclass or
``NamedTuple`` as ``{field: value}`` (a ``shared`` type as an index into its table, each
distinct value written once), a tensor or ndarray as ``{"array", "dtype", "shape"}``
(``TENSOR_DTYPES``; bfloat16 as its int16 bits), ``Any`` as a scalar or a value tagged with
what it is (``_PLAIN``). Values nest at most ``MAX_DEPTH`` deep.

``decode`` checks everything against the annotations (zip members, each ``.npy`` header before
its data, format, version, every field and value, every index); any failure, and any
annotation this codec does not know, raises ``CodecError``, never another exception.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import struct
import types
import typing
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from kvlens.errors import KvlensError

#: what starts every file (a zip's local file header); anything else is refused unread
ZIP_MAGIC = b"PK\x03\x04"
DOCUMENT = "document.npy"
MAX_DEPTH = 32  # nesting of a value in the document (lists, tuples, dicts, records)
#: torch dtypes a tensor may have, and the numpy dtype its bytes are stored as
TENSOR_DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"),
                 "float64": np.dtype("<f8"), "bfloat16": np.dtype("<i2")}
_SCALARS = (type(None), bool, int, float, str)
_HEADER = ("format", "version")
_ARRAY_KEYS = {"array", "dtype", "shape"}
#: a self-describing (``Any``) value that is no scalar: its tag and the annotation it is written by
_PLAIN = {"list": list[Any], "tuple": tuple[Any, ...], "dict": dict[str, Any],
          "ndarray": np.ndarray}
_PLAIN_TYPES = {tag: typing.get_origin(tp) or tp for tag, tp in _PLAIN.items()}
#: what numpy, zipfile, json and a dataclass's own checks raise on bad input: a CodecError
_READ_ERRORS = (ValueError, TypeError, KeyError, IndexError, OSError, EOFError, RecursionError,
                ArithmeticError, zipfile.BadZipFile, struct.error, NotImplementedError,
                KvlensError)


class CodecError(ValueError):
    """A value that a codec cannot write, or bytes that are not a file it wrote."""


@dataclass(frozen=True, eq=False)
class DataclassCodec:
    """Writes ``root`` instances as files named ``format`` at ``version`` and reads them back
    (module docstring); ``shared`` maps a document key to a hashable type whose values are
    written once there and referred to by index (a table's keys, repeated in every row)."""

    root: type
    format: str
    version: int
    shared: Mapping[str, type] = field(default_factory=dict)

    def check(self) -> None:
        """``CodecError`` unless every annotation under ``root`` is one this codec writes."""
        _check_types(self.root, tuple(self.shared.items()))

    def encode(self, value) -> bytes:
        """``value`` (a ``root``) as bytes; ``CodecError`` where it holds a value its
        annotations do not allow."""
        self.check()
        if type(value) is not self.root:
            raise _cannot(self.root.__name__, value, self.root)
        w = _Writer(self.shared.values())
        doc = {"format": self.format, "version": self.version,
               **w.value(value, self.root, self.root.__name__)}
        w.inline = True  # a table's entries in full
        for name, cls in self.shared.items():
            doc[name] = [w.value(v, cls, (name, i)) for i, v in enumerate(w.tables[cls])]
        return _pack(json.dumps(doc, allow_nan=True).encode(), w.arrays)

    def decode(self, data: bytes):
        """The ``root`` in ``data`` (bytes ``encode`` wrote); ``CodecError`` for anything else:
        another format or version, a pickle, a truncated or altered file."""
        if not data.startswith(ZIP_MAGIC):
            raise CodecError(f"not a {self.format} file (no zip header: a pickle or other file)")
        try:
            self.check()
            doc, arrays = _unpack(data)
            return self._read_document(doc, arrays)
        except CodecError:
            raise
        except _READ_ERRORS as e:
            raise CodecError(f"not a readable {self.format} file ({type(e).__name__}: {e})") \
                from e

    def _read_document(self, doc, arrays: list[np.ndarray]):
        if type(doc) is not dict or doc.get("format") != self.format:
            raise CodecError(f"not a {self.format} file (another format)")
        if doc.get("version") != self.version or type(doc.get("version")) is not int:
            raise CodecError(f"{self.format} file of version {doc.get('version')!r}, this "
                             f"kvlens reads version {self.version}")
        r = _Reader(arrays, self.shared.values())
        r.inline = True
        for name, cls in self.shared.items():  # a table missing: a KeyError, said
            rows = _list(doc[name], name)
            r.tables[cls] = [r.value(v, cls, (name, i)) for i, v in enumerate(rows)]
        r.inline = False
        body = {k: v for k, v in doc.items() if k not in _HEADER and k not in self.shared}
        return r.value(body, self.root, self.root.__name__)


# -- annotations --------------------------------------------------------------------------------


class _Shape(NamedTuple):
    """An annotation, classified once: what it is and its parts."""

    kind: str  # any, scalar, optional, list, vartuple, tuple, dict, tensor, ndarray, record
    args: tuple  # scalar: the types; record: the fields' (name, annotation); else annotations


@functools.cache
def _shape(tp) -> _Shape:
    if tp is Any:
        return _Shape("any", ())
    if tp is None or tp in _SCALARS:
        return _Shape("scalar", (type(None) if tp is None else tp,))
    bare = {list: _Shape("list", (Any,)), tuple: _Shape("vartuple", (Any,)),
            dict: _Shape("dict", (Any, Any))}
    if tp in bare:
        return bare[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if all(a in _SCALARS for a in args):
            return _Shape("scalar", args)
        if len(args) == 2 and type(None) in args:
            return _Shape("optional", tuple(a for a in args if a is not type(None)))
    elif origin in (list, dict) or (origin is tuple and args[-1:] != (Ellipsis,)):
        return _Shape({list: "list", dict: "dict", tuple: "tuple"}[origin], args)
    elif origin is tuple:
        return _Shape("vartuple", args[:1])
    elif tp is torch.Tensor:
        return _Shape("tensor", ())
    elif tp is np.ndarray or origin is np.ndarray:
        return _Shape("ndarray", ())
    elif isinstance(tp, type) and (dataclasses.is_dataclass(tp) or _is_namedtuple(tp)):
        return _Shape("record", _fields(tp))
    raise CodecError(f"the annotation {tp!r} is not one this codec writes (scalars, T | None, "
                     "lists, tuples, dicts, dataclasses, NamedTuples, tensors, numpy arrays, "
                     "Any: kvlens.recommend.codec)")


def _is_namedtuple(tp: type) -> bool:
    return issubclass(tp, tuple) and hasattr(tp, "_fields")


def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """``cls``'s fields its constructor takes, with their resolved annotations (a field the
    constructor does not take is state it makes, never written)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError, AttributeError) as e:
        raise CodecError(f"{cls.__name__}'s annotations do not resolve ({e}): a codec reads "
                         "them at run time, so their names must be imported") from e
    names = (cls._fields if _is_namedtuple(cls)
             else [f.name for f in dataclasses.fields(cls) if f.init])
    return tuple((name, hints[name]) for name in names)


@functools.cache
def _check_types(root: type, shared: tuple[tuple[str, type], ...]) -> None:
    if _shape(root).kind != "record" or any(_shape(c).kind != "record" for _, c in shared):
        raise CodecError("a codec's root and shared types are dataclasses or NamedTuples")
    if root in {c for _, c in shared}:
        raise CodecError(f"a codec's root {root.__name__} is not one of its shared types")
    names = [name for name, _ in _shape(root).args]
    clash = set(names) & ({*_HEADER} | {name for name, _ in shared})
    if clash:
        raise CodecError(f"{root.__name__}'s fields {sorted(clash)} clash with the document's "
                         "format, version or a shared table")
    seen: set = set()
    todo = [root, *(c for _, c in shared)]
    while todo:
        tp = todo.pop()
        s = _shape(tp)
        if s.kind == "record" and tp not in seen:
            seen.add(tp)
            todo.extend(t for _, t in s.args)
        elif s.kind not in ("record", "scalar"):
            todo.extend(s.args)


def _is_scalar(x, allowed: tuple) -> bool:
    """``x`` is of one of the scalar types ``allowed`` (an int passes for a float; a bool is
    no int)."""
    return type(x) in allowed or (type(x) is int and float in allowed)


def _name(tp) -> str:
    plain = isinstance(tp, type) and not typing.get_args(tp)
    return tp.__name__ if plain else str(tp).replace("typing.", "")


def _at(where) -> str:
    """A value's place, said: ``where`` is a name or ``(parent, step)``, a step an index or a
    ``.field`` (built as a tuple, said only in an error: a table has many rows)."""
    if type(where) is str:
        return where
    parent, step = where
    return _at(parent) + (f"[{step}]" if type(step) is int else step)


# -- writing ------------------------------------------------------------------------------------


def _cannot(where, value, tp) -> CodecError:
    """``tp``: the annotation ``value`` does not match, or what it should be, in words."""
    wanted = tp if type(tp) is str else f"of type {_name(tp)}"
    return CodecError(f"{_at(where)} cannot be written: {value!r} (type {type(value).__name__}) "
                      f"is not {wanted}")


class _Writer:
    """One ``encode``: the arrays written so far and each shared type's values by index."""

    def __init__(self, shared):
        self.arrays: list[np.ndarray] = []
        self.tables: dict[type, dict] = {cls: {} for cls in shared}
        self.inline = False  # a shared type written in full (its table's entries)

    def value(self, x, tp, where, depth: int = 0):
        if depth > MAX_DEPTH:
            raise _cannot(where, x, f"a value nested at most {MAX_DEPTH} deep")
        kind, args = _shape(tp)
        if kind == "scalar" or (kind == "any" and type(x) in _SCALARS):
            if not _is_scalar(x, args or _SCALARS):
                raise _cannot(where, x, tp)
            return x
        if kind == "optional":
            return None if x is None else self.value(x, args[0], where, depth)
        if kind in ("list", "vartuple", "tuple", "dict"):
            return self.container(x, tp, kind, args, where, depth + 1)
        if kind == "record":
            if type(x) is not tp:
                raise _cannot(where, x, tp)
            if tp in self.tables and not self.inline:
                return self.intern(x, tp, where)
            return {name: self.value(getattr(x, name), t, (where, f".{name}"), depth + 1)
                    for name, t in args}
        if kind == "tensor":
            return self.tensor(x, where)
        if kind == "ndarray":
            if type(x) is not np.ndarray or x.dtype.kind not in "biuf":  # never an object array
                raise _cannot(where, x, "a numeric or boolean numpy array")
            return self.array(x, x.dtype.str)
        # Any: tagged with what it is, so that a tuple reads back as a tuple
        tag = next((tag for tag, t in _PLAIN_TYPES.items() if type(x) is t), None)
        if tag is None:
            raise _cannot(where, x, "a plain value (scalar, list, tuple, dict, numpy array)")
        return {tag: self.value(x, _PLAIN[tag], where, depth)}

    def container(self, x, tp, kind: str, args: tuple, where, depth: int) -> list:
        want = {"list": list, "vartuple": tuple, "tuple": tuple, "dict": dict}[kind]
        if type(x) is not want or (kind == "tuple" and len(x) != len(args)):
            raise _cannot(where, x, tp)
        if kind == "dict":
            return [[self.value(k, args[0], ((where, i), ".key"), depth),
                     self.value(v, args[1], ((where, i), ".value"), depth)]
                    for i, (k, v) in enumerate(x.items())]
        items = args if kind == "tuple" else args * len(x)
        return [self.value(e, t, (where, i), depth) for i, (e, t) in enumerate(zip(x, items))]

    def intern(self, x, cls: type, where) -> int:
        table = self.tables[cls]
        try:
            return table.setdefault(x, len(table))
        except TypeError as e:  # unhashable: a field holds a list or dict
            raise CodecError(f"{_at(where)} cannot be written: {x!r} is not hashable ({e}), "
                             f"and a shared {cls.__name__} is written once per value") from e

    def array(self, a: np.ndarray, dtype: str) -> dict:
        self.arrays.append(a if a.flags.c_contiguous else a.copy(order="C"))
        return {"array": len(self.arrays) - 1, "dtype": dtype, "shape": list(a.shape)}

    def tensor(self, t, where) -> dict:
        name = str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None
        if name not in TENSOR_DTYPES:
            raise _cannot(where, t, f"a tensor of dtype {', '.join(TENSOR_DTYPES)}")
        x = t.detach().cpu().contiguous()
        return self.array((x.view(torch.int16) if name == "bfloat16" else x).numpy(), name)


def _pack(text: bytes, arrays: list[np.ndarray]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, a in [(DOCUMENT, np.frombuffer(text, np.uint8)),
                        *((f"a{i}.npy", a) for i, a in enumerate(arrays))]:
            with z.open(name, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, a, allow_pickle=False)
    return out.getvalue()


# -- reading ------------------------------------------------------------------------------------


def _unpack(data: bytes) -> tuple[Any, list[np.ndarray]]:
    """The JSON document and the arrays of a file ``_pack`` wrote."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = z.infolist()
        names, count = [i.filename for i in infos], len(infos) - 1
        if sorted(names) != sorted([DOCUMENT, *(f"a{i}.npy" for i in range(count))]):
            raise CodecError(f"not a codec file: members {names}, not one document and arrays")
        read = {}
        for info in infos:
            # stored, never compressed: a member holds no more bytes than the file
            if info.compress_type != zipfile.ZIP_STORED:
                raise CodecError(f"compressed member {info.filename}")
            with z.open(info) as f:
                read[info.filename] = _read_npy(f, info.file_size)
    text = read.pop(DOCUMENT)
    if text.dtype != np.uint8 or text.ndim != 1:
        raise CodecError("the document is not a uint8 vector")
    doc = json.loads(text.tobytes().decode("utf-8"), object_pairs_hook=_object)
    return doc, [read[f"a{i}.npy"] for i in range(count)]


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object, refused where it names a key twice (``json`` would keep the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise CodecError(f"malformed file: an object has a key twice ({[k for k, _ in pairs]})")
    return out


def _read_npy(f, size: int) -> np.ndarray:
    """One ``.npy`` member, its header checked before any data is read: a plain numeric or
    boolean dtype (never an object array, which would need pickle) in C order, whose size is
    the member's."""
    version = np.lib.format.read_magic(f)
    header = {(1, 0): np.lib.format.read_array_header_1_0,
              (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if header is None:
        raise CodecError(f"unsupported .npy version {version}")
    shape, fortran, dtype = header(f)
    if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.hasobject or fortran:
        raise CodecError(f"array of dtype {dtype} (fortran order {fortran})")
    body = f.read(size + 1)
    if len(body) != math.prod(shape) * dtype.itemsize:
        raise CodecError(f"array of shape {shape} and dtype {dtype}: {len(body)} bytes")
    return np.frombuffer(body, dtype).reshape(shape).copy()


def _malformed(where, what: str) -> CodecError:
    return CodecError(f"malformed file: {_at(where)} {what}")


def _list(x, where, length: int | None = None) -> list:
    if type(x) is not list or (length is not None and len(x) != length):
        raise _malformed(where, f"is {x!r}, not a list" + ("" if length is None
                                                           else f" of {length}"))
    return x


def _index(x, size: int, where) -> int:
    if type(x) is not int or not 0 <= x < size:
        raise _malformed(where, f"is {x!r}, not an index below {size}")
    return x


class _Reader:
    """One ``decode``: the file's arrays and each shared type's table, read first."""

    def __init__(self, arrays: list[np.ndarray], shared):
        self.arrays = arrays
        self.tables: dict[type, list] = {cls: [] for cls in shared}
        self.inline = False  # a shared type read in full (its table's entries)

    def value(self, x, tp, where, depth: int = 0):
        if depth > MAX_DEPTH:
            raise _malformed(where, f"is nested more than {MAX_DEPTH} deep")
        kind, args = _shape(tp)
        if kind == "scalar" or (kind == "any" and type(x) in _SCALARS):
            if not _is_scalar(x, args or _SCALARS):
                raise _malformed(where, f"is {x!r}, not of type {_name(tp)}")
            return x
        if kind == "optional":
            return None if x is None else self.value(x, args[0], where, depth)
        if kind in ("list", "vartuple", "tuple"):
            x = _list(x, where, len(args) if kind == "tuple" else None)
            items = [self.value(e, t, (where, i), depth + 1) for i, (e, t)
                     in enumerate(zip(x, args if kind == "tuple" else args * len(x)))]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            return self.dict(x, args, where, depth + 1)
        if kind == "record":
            return self.record(x, tp, args, where, depth + 1)
        if kind == "tensor":
            return self.tensor(x, where)
        if kind == "ndarray":
            return self.array(x, where, None)
        # Any: a value tagged with what it is
        if type(x) is not dict or len(x) != 1 or next(iter(x)) not in _PLAIN:
            raise _malformed(where, f"is {x!r}, not a value tagged {' or '.join(_PLAIN)}")
        (tag, body), = x.items()
        return self.value(body, _PLAIN[tag], where, depth)

    def dict(self, x, args: tuple, where, depth: int) -> dict:
        pairs = [_list(p, (where, i), 2) for i, p in enumerate(_list(x, where))]
        out = {self.value(k, args[0], ((where, i), ".key"), depth):
               self.value(v, args[1], ((where, i), ".value"), depth)
               for i, (k, v) in enumerate(pairs)}
        if len(out) != len(pairs):
            raise _malformed(where, "has a key twice")
        return out

    def record(self, x, tp: type, fields: tuple, where, depth: int):
        if tp in self.tables and not self.inline:
            return self.tables[tp][_index(x, len(self.tables[tp]), where)]
        names = {name for name, _ in fields}
        if type(x) is not dict or x.keys() != names:
            raise _malformed(where, f"is {x!r}, not a {tp.__name__} (fields {sorted(names)})")
        return tp(**{name: self.value(x[name], t, (where, f".{name}"), depth)
                     for name, t in fields})

    def array(self, ref, where, stored: np.dtype | None) -> np.ndarray:
        """The array ``ref`` refers to, checked against its declared dtype (``stored``: the one
        its tensor dtype is stored as) and shape."""
        if type(ref) is not dict or ref.keys() != _ARRAY_KEYS:
            raise _malformed(where, f"is {ref!r}, no array reference")
        a = self.arrays[_index(ref["array"], len(self.arrays), (where, ".array"))]
        shape = _list(ref["shape"], (where, ".shape"))
        if (a.dtype != stored if stored is not None else a.dtype.str != ref["dtype"]) \
                or list(a.shape) != shape:
            raise _malformed(where, f"declares {ref['dtype']!r} {shape}, its array is "
                             f"{a.dtype} {list(a.shape)}")
        return a.copy()

    def tensor(self, ref, where) -> torch.Tensor:
        name = ref.get("dtype") if type(ref) is dict else None
        if type(name) is not str or name not in TENSOR_DTYPES:
            raise _malformed(where, f"is {ref!r}, no tensor of dtype {', '.join(TENSOR_DTYPES)}")
        a = self.array(ref, where, TENSOR_DTYPES[name])
        t = torch.from_numpy(a.astype(a.dtype.newbyteorder("="), copy=False))
        return t.view(torch.bfloat16) if name == "bfloat16" else t
