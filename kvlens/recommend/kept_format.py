"""The file format of a kept measurement (``kvlens.recommend.reuse``): ``encode`` writes a
``kvlens.recommend.pipeline.Measurements`` as bytes, ``decode`` reads them back, exactly.

The format holds data only; nothing in it names code to run, and nothing reads it with a
general-purpose deserializer (no pickle, no ``eval``). A file is an uncompressed zip (a numpy
``.npz``; ``numpy.load(f, allow_pickle=False)`` opens it) of ``.npy`` members:

- ``document.npy``: a uint8 array, the UTF-8 JSON document ``{"format": FORMAT, "version":
  VERSION, ...}`` that holds the structure (below);
- ``a0.npy``, ``a1.npy``, ...: the arrays the document refers to by index (``{"array": i,
  "dtype": ..., "shape": [...]}``): numeric and boolean dtypes only, never objects.

The document, one key per ``Measurements`` field:

- ``meta``: ``{field: value}`` of ``kvlens.capture.store.CaptureMeta``, each value checked
  against the field's type; dicts, lists and tuples as tagged values (``{"dict": [[k, v],
  ...]}``, ``{"list": [...]}``, ``{"tuple": [...]}``, ``{"ndarray": array}``), scalars as
  JSON scalars (Python floats print and read back exactly);
- ``candidates``: every ``Candidate`` in the tables, once, ``{field: value}``; ``streams``:
  every ``Stream``, once, ``[residual, flush]``;
- ``tables``: per layer ``{"keys": int64 [n, 2], "errors": float64 [n, 3], "scored": bool [n]}``
  in the table's order: the candidate's and the stream's index (-1: None) and
  ``(output, score, reconstruction)`` errors (``scored`` False: the score error is None);
- ``balancers``: ``[[layer, tensor], ...]``; ``weights``: the layer weights; ``notes``;
  ``windows`` (int or null); ``factors``: per layer ``[[family, factor], ...]`` (a family is a
  tuple of scalars, ``kvlens.recommend.catalog.family``); ``profile``: ``[[stage, seconds], ...]``.

A tensor is ``{"array": i, "dtype": torch dtype, "shape": [...]}`` (bfloat16 stored as its int16
bits). ``decode`` checks everything: the zip members (stored, not compressed, named as above),
each ``.npy`` header (a plain numeric dtype whose size matches the member's bytes), the format
name and version, every field's type and every index; any failure raises ``KeptFormatError``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import struct
import zipfile

import numpy as np
import torch

from kvlens.capture.store import CaptureMeta
from kvlens.errors import ConfigError, InputError
from kvlens.recommend.options import Candidate, Stream
from kvlens.recommend.pipeline import Measurements
from kvlens.recommend.profile import Profile

FORMAT = "kvlens.measurements"
# 2: coupled candidates and their codebooks; 3: the capture's KV layers; 4: coupled removed
# (issue #57: ``Candidate`` lost its ``coupled`` field); 5: codebook and centred-key candidates
# removed (issue #57: ``Candidate`` lost ``codebook`` and ``center``, the document its
# ``codebooks``, a family its centring flag)
VERSION = 5
#: what starts every file (a zip's local file header); anything else is refused unread
ZIP_MAGIC = b"PK\x03\x04"
DOCUMENT = "document.npy"
_ARRAY_NAME = re.compile(r"a(0|[1-9][0-9]*)\.npy")
_MAX_DEPTH = 16  # nesting of tagged values in the capture's metadata
_SCALARS = (type(None), bool, int, float, str)
#: torch dtypes a tensor may have, and the numpy dtype its bytes are stored as
_TENSOR_DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"),
                  "float64": np.dtype("<f8"), "bfloat16": np.dtype("<i2")}
#: CaptureMeta's fields and the check each value must pass
_META_TYPES = {
    "model": str, "architecture": str, "model_type": str, "num_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int, "has_rope": bool,
    "rope": dict, "rope_layout": str, "rotary_dim": int, "compute_dtype": str,
    "storage_dtype": str, "num_samples": int, "num_tokens": int, "layers": "ints",
    "created": str, "model_source": str, "text_source": str, "kvlens_version": str,
    "schema_version": int, "extra": dict, "kv_layers": "ints", "kv_shared": bool,
}
#: Candidate's fields and their types (``mikv_set``: None or ``(set bits, heavy fraction)``)
_CANDIDATE_TYPES = {
    "tensor": str, "bits": int, "granularity": str, "group_size": int, "stage": str,
    "balancer": bool, "rotate": bool, "gear": bool, "mikv_set": "mikv", "fit": str,
}


class KeptFormatError(ValueError):
    """A measurement that this format cannot write, or bytes that are not one it wrote."""


# -- encoding -----------------------------------------------------------------------------------


def encode(m: Measurements) -> bytes:
    """``m`` as the bytes of a kept-measurement file (module docstring); ``KeptFormatError``
    where ``m`` holds a value of a type this format does not know."""
    arrays: list[np.ndarray] = []
    cands: dict[Candidate, int] = {}
    streams: dict[Stream, int] = {}
    doc = {
        "format": FORMAT, "version": VERSION,
        "meta": _encode_meta(m.meta, arrays),
        "tables": [_encode_table(t, cands, streams, arrays) for t in m.tables],
        "balancers": [[_int(i), _put_tensor(b, arrays)] for i, b in m.balancers.items()],
        "weights": [_number(w) for w in m.weights],
        "notes": [_str(n) for n in m.notes],
        "windows": [None if w is None else _int(w) for w in m.windows],
        "factors": [[[_scalar_tuple(f), _number(x)] for f, x in row.items()]
                    for row in m.factors],
        "profile": [[_str(s), _number(x)] for s, x in m.profile.stages.items()],
    }
    doc["candidates"] = [_encode_candidate(c) for c in cands]
    doc["streams"] = [[_int(s.residual), _int(s.flush)] for s in streams]
    text = json.dumps(doc, allow_nan=True).encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, a in [(DOCUMENT, np.frombuffer(text, np.uint8)),
                        *((f"a{i}.npy", a) for i, a in enumerate(arrays))]:
            with z.open(name, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
    return out.getvalue()


def _refuse_encode(what: str, value) -> KeptFormatError:
    return KeptFormatError(f"A kept measurement cannot hold {what} {value!r} "
                           f"(type {type(value).__name__}).")


def _int(x) -> int:
    if type(x) is not int:
        raise _refuse_encode("the integer", x)
    return x


def _str(x) -> str:
    if type(x) is not str:
        raise _refuse_encode("the string", x)
    return x


def _number(x) -> int | float:
    if type(x) not in (int, float):
        raise _refuse_encode("the number", x)
    return x


def _scalar_tuple(x) -> list:
    if type(x) is not tuple or any(type(e) not in _SCALARS for e in x):
        raise _refuse_encode("the tuple of scalars", x)
    return list(x)


def _put_array(a: np.ndarray, arrays: list) -> int:
    arrays.append(a)
    return len(arrays) - 1


def _put_tensor(t, arrays: list) -> dict:
    name = str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None
    if name not in _TENSOR_DTYPES:
        raise _refuse_encode(f"the tensor ({', '.join(_TENSOR_DTYPES)} only)", t)
    x = t.detach().cpu().contiguous()
    a = (x.view(torch.int16) if name == "bfloat16" else x).numpy()
    return {"array": _put_array(a, arrays), "dtype": name, "shape": list(x.shape)}


def _plain(x, arrays: list, depth: int = 0):
    """A value of the capture's metadata as a JSON value (scalars as themselves, the rest
    tagged, so that a tuple reads back as a tuple)."""
    if depth > _MAX_DEPTH:
        raise _refuse_encode("the value nested this deep", x)
    if type(x) in _SCALARS:
        return x
    if type(x) in (list, tuple):
        return {type(x).__name__: [_plain(e, arrays, depth + 1) for e in x]}
    if type(x) is dict:
        return {"dict": [[_str(k), _plain(v, arrays, depth + 1)] for k, v in x.items()]}
    if type(x) is np.ndarray and x.dtype.kind in "biuf" and x.dtype.fields is None:
        return {"ndarray": _put_array(x, arrays)}
    raise _refuse_encode("the value", x)


def _check_fields(cls, known: dict) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    if names != set(known):
        raise KeptFormatError(f"{cls.__name__}'s fields {sorted(names)} are not the ones this "
                              f"format knows, {sorted(known)}: kvlens.recommend.kept_format "
                              "needs updating.")


def _encode_meta(meta, arrays: list) -> dict:
    if type(meta) is not CaptureMeta:
        raise _refuse_encode("the capture metadata", meta)
    _check_fields(CaptureMeta, _META_TYPES)
    out = {}
    for name, kind in _META_TYPES.items():
        value = getattr(meta, name)
        if not _is_kind(value, kind):
            raise _refuse_encode(f"CaptureMeta.{name}", value)
        out[name] = _plain(value, arrays)
    return out


def _encode_candidate(c: Candidate) -> dict:
    _check_fields(Candidate, _CANDIDATE_TYPES)
    out = {}
    for name, kind in _CANDIDATE_TYPES.items():
        value = getattr(c, name)
        if not _is_kind(value, kind):
            raise _refuse_encode(f"Candidate.{name}", value)
        out[name] = list(value) if type(value) is tuple else value
    return out


def _encode_table(table: dict, cands: dict, streams: dict, arrays: list) -> dict:
    keys, errors, scored = [], [], []
    for key, errs in table.items():
        if type(key) is not tuple or len(key) != 2 or type(key[0]) is not Candidate \
                or not (key[1] is None or type(key[1]) is Stream):
            raise _refuse_encode("the table key", key)
        if type(errs) is not tuple or len(errs) != 3 or type(errs[0]) is not float \
                or type(errs[2]) is not float or type(errs[1]) not in (float, type(None)):
            raise _refuse_encode("the table errors", errs)
        c, s = key
        keys.append((cands.setdefault(c, len(cands)),
                     -1 if s is None else streams.setdefault(s, len(streams))))
        errors.append((errs[0], math.nan if errs[1] is None else errs[1], errs[2]))
        scored.append(errs[1] is not None)
    return {"keys": _put_array(np.array(keys, np.int64).reshape(-1, 2), arrays),
            "errors": _put_array(np.array(errors, np.float64).reshape(-1, 3), arrays),
            "scored": _put_array(np.array(scored, np.bool_), arrays)}


def _is_kind(value, kind) -> bool:
    if kind == "ints":
        return type(value) is tuple and all(type(e) is int for e in value)
    if kind == "mikv":
        return value is None or (type(value) is tuple and len(value) == 2
                                 and type(value[0]) is int and type(value[1]) in (int, float))
    return type(value) is kind


# -- decoding -----------------------------------------------------------------------------------


def decode(data: bytes) -> Measurements:
    """The ``Measurements`` in ``data`` (bytes ``encode`` wrote); ``KeptFormatError`` for
    anything else: another format or version, a pickle, a truncated or altered file."""
    if not data.startswith(ZIP_MAGIC):
        raise KeptFormatError("not a kept measurement (no zip header: a pickle or other file)")
    try:
        doc, arrays = _read_zip(data)
        return _decode_document(doc, arrays)
    except KeptFormatError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OSError, EOFError, RecursionError,
            zipfile.BadZipFile, struct.error, NotImplementedError, InputError,
            ConfigError) as e:
        # what numpy, zipfile, json and the constructors' own checks raise on bad input
        raise KeptFormatError(f"not a readable kept measurement ({type(e).__name__}: {e})") \
            from e


def _read_zip(data: bytes) -> tuple[dict, list[np.ndarray]]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = z.infolist()
        names = [i.filename for i in infos]
        if names.count(DOCUMENT) != 1 or len(set(names)) != len(names):
            raise KeptFormatError("not a kept measurement (no single document)")
        count = len(names) - 1
        if {n for n in names if n != DOCUMENT} != {f"a{i}.npy" for i in range(count)}:
            raise KeptFormatError(f"unexpected members {names}")
        read = {}
        for info in infos:
            # stored, never compressed: a member holds no more bytes than the file
            if info.compress_type != zipfile.ZIP_STORED:
                raise KeptFormatError(f"compressed member {info.filename}")
            with z.open(info) as f:
                read[info.filename] = _read_npy(f, info.file_size)
    text = read.pop(DOCUMENT)
    if text.dtype != np.uint8 or text.ndim != 1:
        raise KeptFormatError("the document is not a uint8 vector")
    doc = json.loads(text.tobytes().decode("utf-8"))
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise KeptFormatError("not a kept measurement (another format)")
    if doc.get("version") != VERSION:
        raise KeptFormatError(f"kept measurement of version {doc.get('version')!r}, this "
                              f"kvlens reads version {VERSION}")
    return doc, [read[f"a{i}.npy"] for i in range(count)]


def _read_npy(f, size: int) -> np.ndarray:
    """One ``.npy`` member, its header checked before any data is read: a plain numeric or
    boolean dtype (never an object array, which would need pickle) in C order, whose size is
    the member's."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise KeptFormatError(f"unsupported .npy version {version}")
    if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.hasobject or fortran:
        raise KeptFormatError(f"array of dtype {dtype} (fortran order {fortran})")
    body = f.read(size + 1)
    if len(body) != math.prod(shape) * dtype.itemsize:
        raise KeptFormatError(f"array of shape {shape} and dtype {dtype}: {len(body)} bytes")
    return np.frombuffer(body, dtype).reshape(shape).copy()


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise KeptFormatError(f"malformed kept measurement: {what}")


def _list(x, what: str, length: int | None = None) -> list:
    _need(type(x) is list and (length is None or len(x) == length), f"{what} is not a list"
          + ("" if length is None else f" of {length}"))
    return x


def _get_int(x, what: str) -> int:
    _need(type(x) is int, f"{what} is not an integer")
    return x


def _get_number(x, what: str) -> int | float:
    _need(type(x) in (int, float), f"{what} is not a number")
    return x


def _get_str(x, what: str) -> str:
    _need(type(x) is str, f"{what} is not a string")
    return x


def _get_tuple(x, what: str) -> tuple:
    _need(type(x) is list and all(type(e) in _SCALARS for e in x),
          f"{what} is not a list of scalars")
    return tuple(x)


def _get_array(ref, arrays: list, what: str) -> np.ndarray:
    i = _get_int(ref, what)
    _need(0 <= i < len(arrays), f"{what} refers to no array")
    return arrays[i]


def _get_tensor(ref, arrays: list, what: str) -> torch.Tensor:
    _need(type(ref) is dict and set(ref) == {"array", "dtype", "shape"}, f"{what} is no tensor")
    name = _get_str(ref["dtype"], what)
    _need(name in _TENSOR_DTYPES, f"{what} has dtype {name!r}")
    a = _get_array(ref["array"], arrays, what)
    shape = [_get_int(n, what) for n in _list(ref["shape"], what)]
    _need(a.dtype == _TENSOR_DTYPES[name] and list(a.shape) == shape,
          f"{what}: stored {a.dtype} {list(a.shape)}, declared {name} {shape}")
    t = torch.from_numpy(a.astype(a.dtype.newbyteorder("="), copy=True))
    return t.view(torch.bfloat16) if name == "bfloat16" else t


def _unplain(x, arrays: list, what: str, depth: int = 0):
    _need(depth <= _MAX_DEPTH, f"{what} is nested too deep")
    if type(x) in _SCALARS:
        return x
    _need(type(x) is dict and len(x) == 1, f"{what} is not a tagged value")
    (tag, body), = x.items()
    if tag in ("list", "tuple"):
        items = [_unplain(e, arrays, what, depth + 1) for e in _list(body, what)]
        return items if tag == "list" else tuple(items)
    if tag == "dict":
        pairs = [_list(p, what, 2) for p in _list(body, what)]
        return {_get_str(k, what): _unplain(v, arrays, what, depth + 1) for k, v in pairs}
    _need(tag == "ndarray", f"{what} has the unknown tag {tag!r}")
    return _get_array(body, arrays, what).copy()


def _decode_document(doc: dict, arrays: list) -> Measurements:
    known = {"format", "version", "meta", "candidates", "streams", "tables", "balancers",
             "weights", "notes", "windows", "factors", "profile"}
    _need(set(doc) == known, f"keys {sorted(doc)}")
    cands = [_decode_candidate(c) for c in _list(doc["candidates"], "candidates")]
    streams = [Stream(*(_get_int(n, "stream") for n in _list(s, "stream", 2)))
               for s in _list(doc["streams"], "streams")]
    factors = tuple({_get_tuple(f, "family"): _get_number(x, "factor")
                     for f, x in (_list(p, "factor", 2) for p in _list(row, "factors"))}
                    for row in _list(doc["factors"], "factors"))
    return Measurements(
        meta=_decode_meta(doc["meta"], arrays),
        tables=[_decode_table(t, cands, streams, arrays)
                for t in _list(doc["tables"], "tables")],
        balancers={_get_int(i, "layer"): _get_tensor(b, arrays, "balancer")
                   for i, b in (_list(p, "balancer", 2)
                                for p in _list(doc["balancers"], "balancers"))},
        weights=tuple(_get_number(w, "weight") for w in _list(doc["weights"], "weights")),
        notes=[_get_str(n, "note") for n in _list(doc["notes"], "notes")],
        windows=tuple(None if w is None else _get_int(w, "window")
                      for w in _list(doc["windows"], "windows")),
        factors=factors,
        profile=Profile({_get_str(s, "stage"): _get_number(x, "seconds")
                         for s, x in (_list(p, "stage", 2)
                                      for p in _list(doc["profile"], "profile"))}),
    )


def _decode_meta(x, arrays: list) -> CaptureMeta:
    _need(type(x) is dict and set(x) == set(_META_TYPES), "meta's fields")
    fields = {}
    for name, kind in _META_TYPES.items():
        value = _unplain(x[name], arrays, f"meta.{name}")
        _need(_is_kind(value, kind), f"meta.{name} is {value!r}")
        fields[name] = value
    return CaptureMeta(**fields)


def _decode_candidate(x) -> Candidate:
    _need(type(x) is dict and set(x) == set(_CANDIDATE_TYPES), "candidate's fields")
    fields = dict(x)
    if type(fields["mikv_set"]) is list:
        fields["mikv_set"] = tuple(fields["mikv_set"])
    for name, kind in _CANDIDATE_TYPES.items():
        _need(_is_kind(fields[name], kind), f"candidate.{name} is {fields[name]!r}")
    return Candidate(**fields)


def _decode_table(x, cands: list, streams: list, arrays: list) -> dict:
    _need(type(x) is dict and set(x) == {"keys", "errors", "scored"}, "table's fields")
    keys = _get_array(x["keys"], arrays, "table keys")
    errors = _get_array(x["errors"], arrays, "table errors")
    scored = _get_array(x["scored"], arrays, "table scores")
    n = len(scored)
    _need(keys.dtype == np.int64 and keys.shape == (n, 2) and errors.dtype == np.float64
          and errors.shape == (n, 3) and scored.dtype == np.bool_ and scored.shape == (n,),
          "table arrays' shapes or dtypes")
    _need(bool(((keys[:, 0] >= 0) & (keys[:, 0] < len(cands))
                & (keys[:, 1] >= -1) & (keys[:, 1] < len(streams))).all()),
          "table refers to no candidate or stream")
    table = {}
    for (c, s), (out, score, recon), has in zip(keys.tolist(), errors.tolist(),
                                                 scored.tolist()):
        table[cands[c], None if s < 0 else streams[s]] = (out, score if has else None, recon)
    _need(len(table) == n, "table has a key twice")
    return table
