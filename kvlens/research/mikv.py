"""MiKV importance-set twins of recommend's candidates: a research candidate extension
(``kvlens.recommend.extension``), registered when ``kvlens.research`` is imported and switched
on with ``--set mikv=on`` (docs/lab-notes/gear-mikv.md). The G32 candidates up to 4 bits (plain
or balanced, post-RoPE, min/max fitted) get one twin per config-wide ``(set_bits,
heavy_fraction)``: heavy hitters and sinks kept at ``set_bits`` beside the base's codes,
measured by replaying the cache's H2O selection (``kvlens.research.heavy_hitters``). A layer
takes the set for both tensors or neither; sliding-window layers have no twins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from kvlens.analysis.metrics import Variant
from kvlens.config import ProtectSettings
from kvlens.errors import ConfigError, InputError
from kvlens.recommend.extension import Twin, register
from kvlens.recommend.options import Candidate, RecommendOptions, Stream
from kvlens.research.heavy_hitters import set_membership, set_reconstruction
from kvlens.research.sets import SET_BITS, ImportanceSet, mikv_settings

NAME = "mikv"
#: set twins are offered for KIVI's G32 grouping only (each is simulated while decoding:
#: measuring cost)
GROUP = 32
FRACTION_MAX = 0.5  # largest heavy fraction offered (more is no longer a small set)
MAX_BITS = 4  # a set beside 8-bit codes buys nothing


def _lever(default, lever: str, help: str):
    """A settings field behind ``--set NAME=VALUE`` (``kvlens.research``): an experiment."""
    return field(default=default, metadata={"lever": lever, "help": help, "experiment": True})


@register
@dataclass(frozen=True)
class MikvSets:
    """The MiKV set twins' settings: the set widths and heavy fractions tried (each pair a
    config-wide setting the allocation solves for)."""

    name: ClassVar[str] = NAME
    #: the switch lever's help (``--set mikv=on``)
    help: ClassVar[str] = "offer MiKV importance-set twins of the G32 candidates up to 4 bits"

    set_bits: tuple[int, ...] = _lever((4, 8), "mikv-bits", "MiKV set widths to try (4, 8); "
                                       "one width and fraction is chosen for the whole config")
    fractions: tuple[float, ...] = _lever((0.1, 0.2), "mikv-fractions",
                                          "MiKV heavy-hitter fractions to try, each in (0, 0.5]")

    def __post_init__(self) -> None:
        bad = [b for b in self.set_bits if b not in SET_BITS]
        if bad or not self.set_bits:
            raise InputError(f"Unsupported {{mikv_set_bits}}: {bad or 'none'}; allowed: "
                             f"{', '.join(map(str, SET_BITS))} (the MiKV set's integer widths).")
        bad = [f for f in self.fractions if not 0 < f <= FRACTION_MAX]
        if bad or not self.fractions:
            raise InputError(f"Unsupported {{mikv_fractions}}: {bad or 'none'}; allowed: "
                             f"fractions in (0, {FRACTION_MAX}] (MiKV's published 0.2, e.g. "
                             "0.1,0.2).")

    def settings(self, opts: RecommendOptions) -> list[tuple[int, float]]:
        """Every ``(set_bits, heavy_fraction)``; none with ``prefer_fast`` (the fused kernel
        reads no set)."""
        if opts.prefer_fast:
            return []
        return [(b, f) for b in sorted(set(self.set_bits)) for f in sorted(set(self.fractions))]

    def twins(self, cands: Sequence[Candidate], opts: RecommendOptions) -> list[Candidate]:
        return [replace(c, twin=Twin(NAME, m)) for c in cands
                if c.group_size == GROUP and c.bits <= MAX_BITS and c.stage == "post"
                and not c.rotate and c.fit == opts.fits_for(c.tensor)[0]
                for m in self.settings(opts)]

    def words(self, setting) -> tuple[str, str]:
        bits, fraction = setting
        return f" set{bits}@{fraction:g}", f" +MiKV set {fraction:g} INT{bits}"

    def offered_on(self, attrs) -> bool:
        return not attrs.sliding_window  # a sliding-window layer keeps no set

    def measurer(self, q, k, v, attrs, opts: RecommendOptions) -> SetVariants:
        return SetVariants(q, k, v, attrs, opts)

    def held(self, setting, opts: RecommendOptions) -> ProtectSettings:
        """Heavy hitters (and the sinks) at the set's codes, as ``protect_for`` gives a layer in
        ``importance.layers``."""
        bits, fraction = setting
        return mikv_settings(fraction, opts.sink_tokens, "off", set_bits=bits)

    def write(self, section: ProtectSettings | None, chosen: Mapping[int, tuple],
              opts: RecommendOptions) -> ProtectSettings:
        """The section with the set at the one setting chosen, on the layers that took it;
        the others keep only the sinks, at ``fp_dtype`` (``KVConfig.protect_for``), as their
        candidates were measured and priced."""
        if len(set(chosen.values())) > 1:
            raise ConfigError(f"internal: MiKV sets of different widths/fractions chosen: "
                              f"{dict(chosen)}")
        bits, fraction = next(iter(chosen.values()))
        base = section or ProtectSettings(sink_tokens=opts.sink_tokens, balancer="off",
                                       balancer_exponent=opts.balancer_exponent)
        return replace(base, importance=ImportanceSet(fraction, bits, sorted(chosen)))

    def note(self, settings: Sequence[tuple], best: float, plain: float) -> str:
        return (f"MiKV set candidates ({', '.join(f'INT{b} {h:g}' for b, h in settings)}): "
                f"objective {best:.4f}, {plain:.4f} without a set")


class SetVariants:
    """``Variant``s of MiKV set twins on one capture layer: each tensor measured alone, as for
    every candidate, with the set the cache would keep (``kvlens.research.heavy_hitters``): for
    keys, the H2O attention accumulated through the candidate's codes and the set's codes; for
    values (keys exact) through exact keys, so one set per (heavy fraction, stream)."""

    stage = "MiKV set simulation"
    exact_sinks = 0  # a layer with a set holds its sinks in the set (at its codes), not exact

    def __init__(self, q, k, v, attrs, opts: RecommendOptions):
        self.q, self.k, self.v, self.attrs, self.opts = q, k, v, attrs, opts
        self._recon: dict = {}
        self._members: dict = {}

    def reconstruction(self, tensor: str, bits: int):
        if (tensor, bits) not in self._recon:
            x = self.k if tensor == "key" else self.v
            self._recon[tensor, bits] = set_reconstruction(x, bits)
        return self._recon[tensor, bits]

    def membership(self, key, k_read, k_set, fraction: float, stream: Stream):
        if key not in self._members:
            mikv = mikv_settings(fraction, self.opts.sink_tokens, "off")
            self._members[key] = set_membership(
                self.q, self.k, k_read, k_set, mikv, scaling=self.attrs.scaling,
                residual_tokens=stream.residual, flush_tokens=stream.flush,
                softcap=self.attrs.logit_softcap, sinks=self.attrs.sinks)
        return self._members[key]

    def variant(self, c: Candidate, base, stream: Stream, rows: slice) -> Variant:
        bits, fraction = c.twin.setting
        x_set = self.reconstruction(c.tensor, bits)
        if c.tensor == "key":
            member = self.membership((c, stream), base.k_hat, x_set, fraction, stream)
            return Variant(k_hat=base.k_hat, in_set=member[:, :, rows], k_set=x_set)
        member = self.membership((fraction, stream), self.k, self.k, fraction, stream)
        return Variant(v_hat=base.v_hat, in_set=member[:, :, rows], v_set=x_set)
