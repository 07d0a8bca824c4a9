"""The KV config's JSON identity: the ``format`` string every config file carries and the one
``version`` this kvlens reads and writes.

kvlens 0.1.0 is the first release, so the versions development builds wrote before it (2-6,
each adding fields to version 1) collapse into version 1, which holds every field they could
write. Issue #57 removed research layouts those builds could store (codebook values, fitted
codebooks, centred keys, coupled layouts, GEAR); a file that stores one is refused naming the
removal whatever version it says (``kvlens.config.io``), any other file whose version is not 1
naming the version. The parser (``kvlens.config.io``) and the dataclasses that write configs
(``kvlens.config.schema``) both read these from here.
"""

from __future__ import annotations

# The file-format identifier written into every config; it names the module that first
# defined the format and is kept as is so that existing files stay readable.
FORMAT = "kvlens.kvconfig"
VERSION = 1
