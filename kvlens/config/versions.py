"""The KV config's JSON identity and versions: the ``format`` string every config file carries,
the newest ``version`` this kvlens reads, and the oldest version that can express a given
config (``oldest_version``), so that a config using no newer feature stays readable by older
kvlens releases.

Versions:

- 1: quantization specs, residual window and flush block, pre-RoPE keys, rotation, MiKV sets
  and balancers, ``scale_dtype`` float16/float32, ``fp_dtype`` float16/bfloat16/float32/exact.
- 2: engine cache types (``key_format`` / ``value_format``), ``kv_scales``, ``mikv.set_bits``,
  ``mikv.layers``, a spec's ``fit`` (``QuantSpec`` version 2), ``fp_dtype`` ``float8_e4m3fn``.
  Version 2 also had GEAR (``gear``). Removed by issue #57 (a negative result,
  docs/lab-notes/gear-mikv.md): a file that uses it is refused with that reason.
- 3: ``scale_dtype`` ``"8bit"``.
- 4: ``engine_attention`` (the engine arithmetic engine-format layers attend with).
- 5: codebook key specs (``CodebookSpec`` as ``key``, ``"lloyd-max"`` or
  ``"lloyd-max-normal"``: vLLM TurboQuant's keys); ``write_before_attention``.
- 4 and 5 also had codebook value specs, fitted codebooks and their centroids (``codebooks``)
  and centred keys (``center_keys``, ``key_means``). Removed by issue #57 (negative results,
  docs/lab-notes/codebooks.md): a file that uses them is refused with that reason.
- 6: coupled (CQ) key and value specs and their codebooks in ``coupled_codebooks`` (research).
  Removed by issue #57 (a negative result, docs/lab-notes/coupled.md): a file that uses them is
  refused with that reason; a version-6 file without them still reads, and nothing is written
  at version 6 any more.

The parser that enforces these (``kvlens.config.io``) and the dataclasses that write them
(``kvlens.config.schema``) both read them from here.
"""

from __future__ import annotations

# The file-format identifier written into every config; it names the module that first
# defined the format and is kept as is so that existing files stay readable.
FORMAT = "kvlens.kvconfig"
VERSION = 6


def oldest_version(config) -> int:
    """The oldest version that can express ``config`` (a ``kvlens.config.schema.KVConfig``):
    1 unless it uses a version-2 feature (engine cache types, ``kv_scales``,
    ``mikv.set_bits``, ``mikv.layers``, a spec's ``fit``, fp8 full-precision parts),
    3 with ``scale_dtype`` ``"8bit"``, 4 with ``engine_attention``, 5 with a codebook key spec
    or ``write_before_attention``."""
    layers = (config.default, *config.layers.values())
    if any(lk.key_codebook is not None for lk in layers) or getattr(
            config, "write_before_attention", False):
        return 5
    if getattr(config, "engine_attention", None):
        return 4
    if config.scale_dtype == "8bit":
        return 3
    specs = [s for lk in layers for s in (lk.key, lk.value)]
    mikv = config.mikv
    uses_v2 = (bool(config.kv_scales)
               or any(lk.engine for lk in layers)
               or any(s is not None and s.fit != "minmax" for s in specs)
               or config.fp_dtype == "float8_e4m3fn"
               or (mikv is not None and (mikv.set_bits is not None or mikv.layers is not None)))
    return 2 if uses_v2 else 1
