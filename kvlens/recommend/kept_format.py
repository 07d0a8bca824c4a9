"""The file format of a kept measurement (``kvlens.recommend.reuse``): ``encode`` writes a
``kvlens.recommend.pipeline.Measurements`` as bytes, ``decode`` reads them back, exactly.

The generic codec (``kvlens.recommend.codec``: the container, the layout of the document and
every check on reading; no pickle) writes it by ``Measurements``' field annotations. The
document holds one key per field, and the candidates and streams of the error tables once each,
under ``candidates`` and ``streams``: a table's keys refer to them by index. A version-6 file
is read too (``_from_6``).
"""

from __future__ import annotations

import json

from kvlens.recommend.codec import CodecError, DataclassCodec
from kvlens.recommend.options import Candidate, Stream
from kvlens.recommend.pipeline import Measurements

FORMAT = "kvlens.measurements"
# 2: coupled candidates and their codebooks; 3: the capture's KV layers; 4: coupled removed
# (issue #57: ``Candidate`` lost its ``coupled`` field); 5: codebook and centred-key candidates
# removed (issue #57: ``Candidate`` lost ``codebook`` and ``center``, the document its
# ``codebooks``, a family its centring flag); 6: written by the generic codec (the tables as
# JSON pairs, streams as records, the profile's spans kept); 7: the capture's model shape one
# record (issue #57: ``CaptureMeta.shape``, holding the windows that were ``Measurements.windows``)
VERSION = 7
#: a measurement that this format cannot write, or bytes that are not one it wrote
KeptFormatError = CodecError
#: the fields of a version-6 capture metadata that ``ModelShape`` holds, by the same names
_SHAPE_FIELDS = ("num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "kv_layers", "architecture", "model_type", "has_rope", "rope")


def _from_6(doc: dict) -> dict:
    """A version-6 document as version 7 writes it: the shape fields of the capture metadata in
    one record, with the windows (per captured layer there, per model layer here) and an MLA
    model's latent row (the capture's ``mla`` attribute, in its extra metadata there)."""
    meta = dict(doc["meta"])
    shape = {name: meta.pop(name) for name in _SHAPE_FIELDS}
    n, kv_shared = shape["num_layers"], meta.pop("kv_shared")
    if type(n) is not int or not 0 < n <= 1 << 16:
        raise ValueError(f"num_layers {n!r}")
    mla = [json.loads(v) for k, v in meta["extra"] if k == "mla"]
    if bool(mla) != kv_shared:
        raise ValueError("kv_shared without the latent row's shape")
    windows = dict(zip(meta["layers"], doc["windows"]))
    shape |= {"windows": [windows.get(i) for i in range(n)], "mla": mla[0] if mla else None,
              "dtype_bytes": 2, "devices": [], "layer_kinds": [], "state_layers": []}
    meta["extra"] = [[k, v] for k, v in meta["extra"] if k != "mla"]
    return {k: v for k, v in doc.items() if k != "windows"} | {"meta": meta | {"shape": shape}}


CODEC = DataclassCodec(Measurements, FORMAT, VERSION,
                       shared={"candidates": Candidate, "streams": Stream},
                       upgrades={6: _from_6})


def encode(m: Measurements) -> bytes:
    """``m`` as the bytes of a kept-measurement file; ``KeptFormatError`` where ``m`` holds a
    value its annotations do not allow."""
    return CODEC.encode(m)


def decode(data: bytes) -> Measurements:
    """The ``Measurements`` in ``data`` (bytes ``encode`` wrote); ``KeptFormatError`` for
    anything else: another format or version, a pickle, a truncated or altered file."""
    return CODEC.decode(data)
