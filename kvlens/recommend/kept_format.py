"""The file format of a kept measurement (``kvlens.recommend.reuse``): ``encode`` writes a
``kvlens.recommend.pipeline.Measurements`` as bytes, ``decode`` reads them back, exactly.

The generic codec (``kvlens.recommend.codec``: the container, the layout of the document and
every check on reading; no pickle) writes it by ``Measurements``' field annotations. The
document holds one key per field, and the candidates and streams of the error tables once each,
under ``candidates`` and ``streams``: a table's keys refer to them by index.
"""

from __future__ import annotations

from kvlens.recommend.codec import CodecError, DataclassCodec
from kvlens.recommend.options import Candidate, Stream
from kvlens.recommend.pipeline import Measurements

FORMAT = "kvlens.measurements"
# 2: coupled candidates and their codebooks; 3: the capture's KV layers; 4: coupled removed
# (issue #57: ``Candidate`` lost its ``coupled`` field); 5: codebook and centred-key candidates
# removed (issue #57: ``Candidate`` lost ``codebook`` and ``center``, the document its
# ``codebooks``, a family its centring flag); 6: written by the generic codec (the tables as
# JSON pairs, streams as records, the profile's spans kept); 7: GEAR removed (issue #57:
# ``Candidate`` lost its ``gear`` field); 8: research twins behind the extension point (issue
# #57: ``Candidate.mikv_set`` became ``Candidate.twin``, a ``Twin``); 9: the capture's model
# shape one record (issue #57: ``CaptureMeta.shape``, holding the windows that were
# ``Measurements.windows``). Older files are measured again (``kvlens.recommend.reuse``).
VERSION = 9
#: a measurement that this format cannot write, or bytes that are not one it wrote
KeptFormatError = CodecError
CODEC = DataclassCodec(Measurements, FORMAT, VERSION,
                       shared={"candidates": Candidate, "streams": Stream})


def encode(m: Measurements) -> bytes:
    """``m`` as the bytes of a kept-measurement file; ``KeptFormatError`` where ``m`` holds a
    value its annotations do not allow."""
    return CODEC.encode(m)


def decode(data: bytes) -> Measurements:
    """The ``Measurements`` in ``data`` (bytes ``encode`` wrote); ``KeptFormatError`` for
    anything else: another format or version, a pickle, a truncated or altered file."""
    return CODEC.decode(data)
