"""The versioned ``KVConfig`` a recommendation writes (``build_config``): per-layer settings
from the chosen candidates and windows, the most common one as the default, the config-wide
sinks-and-balancer section (``protect``) and what the chosen research twins add to it
(``CandidateExtension.write``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from kvlens.config import KVConfig, ProtectSettings
from kvlens.errors import ConfigError
from kvlens.recommend.extension import extension_class
from kvlens.recommend.options import Candidate, RecommendOptions, Stream, listed


def build_config(meta, opts: RecommendOptions,
                 chosen: Mapping[int, tuple[Candidate, Candidate, Stream]], balancers):
    """The versioned ``kvlens.config`` config that ``kvlens generate --config`` consumes, from
    each layer's chosen ``(key, value, stream)``."""
    settings = {i: s.setting(k, v) for i, (k, v, s) in chosen.items()}
    default = Counter(settings.values()).most_common(1)[0][0]
    overrides = {i: s for i, s in settings.items() if s != default}
    used = {i: balancers[i] for i, (k, _, _) in chosen.items() if k.balancer}
    if any(settings[i].pre_rope_keys for i in used):
        raise ConfigError("internal: balancer chosen together with pre-RoPE keys")
    protect = None
    if used or opts.sink_tokens:
        protect = ProtectSettings(sink_tokens=opts.sink_tokens,
                            balancer="fixed" if used else "off",
                            balancer_exponent=opts.balancer_exponent)
    twins: dict[str, dict[int, tuple]] = {}
    for i, (k, _, _) in chosen.items():
        if k.twin is not None:
            twins.setdefault(k.twin.extension, {})[i] = k.twin.setting
    for name, picked in twins.items():  # what the research twins chosen add to the config
        protect = extension_class(name)().write(protect, picked, opts)
    return KVConfig(
        name=opts.name, default=default, layers=overrides, protect=protect,
        balancers={i: tuple(tuple(float(x) for x in row) for row in b.tolist())
                   for i, b in used.items()},
        fp_dtype=opts.fp_dtype, scale_dtype=opts.scale_dtype,
        description=(f"kvlens recommend for {meta.model}: budget {opts.budget_bits} bits/element "
                     f"at {opts.context} tokens (residual window "
                     f"{listed(sorted({s.residual for _, _, s in chosen.values()}), '/')}, "
                     f"{opts.sink_tokens} sink tokens)"),
        model={"num_layers": meta.shape.num_layers, "head_dim": meta.shape.head_dim,
               "num_key_value_heads": meta.shape.num_key_value_heads})
