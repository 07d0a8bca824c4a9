"""The candidates ``recommend`` measures, and the storage families they fall into.

Per tensor: granularity x bits x group size x scale fit; keys also pre-RoPE (KVQuant) and, per
token, with the key-channel balancer fitted on the capture; per-token keys and values also
Hadamard-rotated. Research extensions (``kvlens.recommend.extension``) add twins of these.
Only what ``kvlens generate`` can run is offered. ``family`` groups candidates by storage
layout for the layout sensitivity, ``family_probes`` picks the one measured per family.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlens.errors import ConfigError
from kvlens.quant import hadamard_block_size
from kvlens.recommend.options import OFFERED_GRANULARITIES, Candidate, RecommendOptions


def candidates(head_dim: int, opts: RecommendOptions, has_rope: bool) -> list[Candidate]:
    """Every storable candidate; per-token groups larger than head_dim are skipped. Rotated
    candidates are per-token only (docs/rotation.md) and need a head_dim with a Hadamard
    construction."""

    rotation = opts.rotation
    if rotation:
        try:
            hadamard_block_size(head_dim)
        except ConfigError:
            rotation = False
    out = []
    for tensor in ("key", "value"):
        for gran in OFFERED_GRANULARITIES:
            for g in opts.group_sizes:
                if gran == "per-token" and (g > head_dim or head_dim % g):
                    continue
                fits = opts.fits_for(tensor)
                for b, fit in ((b, f) for b in opts.bits for f in fits):
                    out.append(Candidate(tensor, b, gran, g, fit=fit))
                    if tensor == "key" and has_rope and opts.pre_rope != "off" \
                            and not opts.prefer_fast:
                        out.append(Candidate(tensor, b, gran, g, stage="pre", fit=fit))
                    if tensor == "key" and gran == "per-token" and opts.balancer:
                        out.append(Candidate(tensor, b, gran, g, balancer=True, fit=fit))
                    if gran == "per-token" and rotation:
                        out.append(Candidate(tensor, b, gran, g, rotate=True, fit=fit))
    # the research extensions' twins of these (kvlens.recommend.extension)
    return out + [t for ext in opts.extensions for t in ext.twins(out, opts)]


def family(c: Candidate) -> tuple:
    """The storage family ``--set sensitivity=layout`` measures one factor for: tensor, axis,
    transforms and the scale fit (bits, group size and a twin share their base's factor).
    The fit has its own: a least-squares fit clips a group's extremes, so its output error need
    not turn into KL at the rate of min/max groups (docs/recommend.md#the-scale-fit)."""
    return (c.tensor, c.granularity, c.stage, c.balancer, c.rotate, c.fit)


def family_probes(cands: Sequence[Candidate]) -> list[Candidate]:
    """One candidate per storage family, at its fewest bits (where layouts differ most):
    per-channel at the smallest group (KIVI's), per-token at the largest (cheapest scales)."""
    out = []
    for fam in dict.fromkeys(family(c) for c in cands):
        members = [c for c in cands if family(c) == fam and c.twin is None]
        if not members:
            continue
        bits = min(c.bits for c in members)
        at = [c for c in members if c.bits == bits]
        pick = min if fam[1] == "per-channel" else max
        out.append(pick(at, key=lambda c: c.group_size))
    return out
