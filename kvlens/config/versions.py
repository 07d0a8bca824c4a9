"""The KV config's JSON identity: the ``format`` string every config file carries and the one
``version`` this kvlens reads and writes (``kvlens.config.io`` parses, ``kvlens.config.schema``
writes; files of other versions are refused there).
"""

from __future__ import annotations

# The file-format identifier written into every config; it names the module that first
# defined the format and is kept as is so that existing files stay readable.
FORMAT = "kvlens.kvconfig"
VERSION = 1
