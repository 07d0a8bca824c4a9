"""Configs for the codebook-key ablation (docs/codebooks.md, issue 36 item 4): what
``recommend``'s codebook keys change, chosen from one measurement.

    python benchmarks/codebook_key_configs.py run.h5 --window-dtype float8_e4m3fn --out cbk/
    kvlens generate --eval kld --json --compare cbk/plain-3.0.json,cbk/keys-3.0.json,cbk/all-3.0.json

One ``measure`` at ``kvlens recommend``'s defaults with ``--codebooks --centering`` (pickled to
``OUT/measurement.pkl`` and reused when present), then per budget (``--bits``) three configs
allocated from it:

- ``plain-B.json``: without either option (what ``kvlens recommend -b B`` chooses);
- ``keys-B.json``: plus the codebook keys only (centred, as ``--codebooks --centering``
  offers them; no codebook values, per-token keys plain);
- ``all-B.json``: everything ``--codebooks --centering`` offers.

Allocating from one measurement is what separate runs choose: the other candidates'
measurements are the same (docs/codebooks.md, the codebook-value ablation). Prints each config's
held bits and the layers whose key or value layout differs from ``plain``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from fisher_rates import cached_measurement
from recommend_ablation import cli_options

from kvlens.config import save_config
from kvlens.recommend import choose


def only_codebook_keys(m):
    """``m`` without codebook values and without centred uniform keys."""
    return replace(m, tables=[{cs: e for cs, e in t.items()
                               if not (cs[0].codebook and cs[0].tensor == "value")
                               and not (cs[0].center and not cs[0].codebook)}
                              for t in m.tables])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture")
    ap.add_argument("--model", default=None)
    ap.add_argument("--window-dtype", default="float16")
    ap.add_argument("--bits", default="3.0,2.5")
    ap.add_argument("--out", default="cbk")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = replace(cli_options(3.0, args.model), fp_dtype=args.window_dtype, codebooks=True,
                   centering=True)
    m = cached_measurement(args.capture, opts, out)
    print(f"measured in {sum(m.profile.stages.values()):.0f} s")
    for b in (float(x) for x in args.bits.split(",")):
        o = replace(opts, budget_bits=b)
        recs = {"plain": choose(m, replace(o, codebooks=False, centering=False)),
                "keys": choose(only_codebook_keys(m), o),
                "all": choose(m, o)}
        base = {(ch.layer, ch.tensor): ch.candidate for ch in recs["plain"].choices}
        for name, rec in recs.items():
            save_config(rec.config, out / f"{name}-{b:g}.json")
            changed = sorted({f"{ch.layer}{ch.tensor[0]}:{ch.candidate.short}"
                              for ch in rec.choices if base[ch.layer, ch.tensor] != ch.candidate},
                             key=lambda s: int(s.split(":")[0][:-1]))
            cb = sum(ch.candidate.codebook for ch in rec.choices if ch.tensor == "key")
            print(f"{b:g} {name}: {rec.mean_bits:.3f} bits, {cb} codebook-key layers, "
                  f"changed vs plain: {' '.join(changed) or 'none'}")


if __name__ == "__main__":
    main()
