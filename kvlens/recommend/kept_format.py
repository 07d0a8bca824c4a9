"""The file format of a kept measurement (``kvlens.recommend.reuse``): ``encode`` / ``decode``
a ``Measurements`` through the generic codec (``kvlens.recommend.codec``), with the error
tables' candidates and streams written once each (``candidates``, ``streams``).
"""

from __future__ import annotations

from kvlens.recommend.codec import CodecError, DataclassCodec
from kvlens.recommend.options import Candidate, Stream
from kvlens.recommend.pipeline import Measurements

FORMAT = "kvlens.measurements"
# raised whenever a field of Measurements (or what it holds) changes; older files are measured
# again (kvlens.recommend.reuse); this file's git history says what each version changed
VERSION = 9
#: a measurement that this format cannot write, or bytes that are not one it wrote
KeptFormatError = CodecError
CODEC = DataclassCodec(Measurements, FORMAT, VERSION,
                       shared={"candidates": Candidate, "streams": Stream})

#: ``encode(m)``: a ``Measurements`` as a kept file's bytes; ``decode(data)``: the one ``encode``
#: wrote (``KeptFormatError`` for a value the annotations do not allow, another format or
#: version, a pickle, a truncated or altered file)
encode, decode = CODEC.encode, CODEC.decode
