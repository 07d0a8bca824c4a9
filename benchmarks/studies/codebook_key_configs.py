"""Configs for the codebook-key ablation (docs/lab-notes/codebooks.md, issue 36 item 4): what
``recommend``'s codebook keys change, chosen from one measurement.

    kvlens recommend run.h5 -b 3.0 --window-dtype float8_e4m3fn -o today-3.json
    python benchmarks/studies/codebook_key_configs.py run.h5 --window-dtype float8_e4m3fn --out cbk/
    kvlens generate --eval kld --json --compare today-3.json,cbk/ctr+keys-3.json,cbk/all-3.json

One ``measure`` at the library's defaults (``RecommendOptions(budget_bits=...)``, what ``kvlens
recommend`` runs) with ``--codebooks --centering`` (pickled to ``OUT/measurement.pkl`` and reused
when present), then per budget (``--bits``) three configs
allocated from it:

- ``ctr-B.json``: what ``--centering`` alone chooses (centred per-token keys);
- ``ctr+keys-B.json``: plus the codebook keys (centred, as ``--codebooks --centering`` offers
  them), no codebook values;
- ``all-B.json``: everything ``--codebooks --centering`` offers.

Allocating from one measurement is what separate runs choose: the other candidates'
measurements are the same (docs/lab-notes/codebooks.md, the codebook-value ablation). ``--centering``
offers the per-token keys centred *instead of* plain, so today's config (no option) cannot be
chosen from this measurement where it takes plain per-token keys: make it with ``kvlens
recommend`` as above. Prints each config's held bits and the layers whose key or value layout
differs from ``ctr``.
"""

from __future__ import annotations

import argparse
import pickle
from dataclasses import replace
from pathlib import Path

from kvlens.config import save_config
from kvlens.recommend import RecommendOptions, choose, measure


def cached_measurement(capture, opts, out: Path):
    """``measure(capture, opts)``, pickled to ``out/measurement.pkl`` and read from there when
    present (its profile kept, unlike ``recommend``'s kept measurements)."""
    cached = out / "measurement.pkl"
    if cached.exists():
        return pickle.loads(cached.read_bytes())
    m = measure(capture, opts)
    cached.write_bytes(pickle.dumps(m))
    return m


def without_codebook_values(m):
    """``m`` without the codebook value candidates."""
    return replace(m, tables=[{cs: e for cs, e in t.items()
                               if not (cs[0].codebook and cs[0].tensor == "value")}
                              for t in m.tables])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture")
    ap.add_argument("--model", default=None)
    ap.add_argument("--window-dtype", default="float16")
    ap.add_argument("--bits", default="3.0,2.5")
    ap.add_argument("--out", default="cbk")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = RecommendOptions(budget_bits=3.0, model=args.model, fp_dtype=args.window_dtype,
                            codebooks=True, centering=True)
    m = cached_measurement(args.capture, opts, out)
    print(f"measured in {sum(m.profile.stages.values()):.0f} s")
    for b in (float(x) for x in args.bits.split(",")):
        o = replace(opts, budget_bits=b)
        recs = {"ctr": choose(m, replace(o, codebooks=False)),
                "ctr+keys": choose(without_codebook_values(m), o),
                "all": choose(m, o)}
        base = {(ch.layer, ch.tensor): ch.candidate for ch in recs["ctr"].choices}
        for name, rec in recs.items():
            save_config(rec.config, out / f"{name}-{b:g}.json")
            changed = sorted({f"{ch.layer}{ch.tensor[0]}:{ch.candidate.short}"
                              for ch in rec.choices if base[ch.layer, ch.tensor] != ch.candidate},
                             key=lambda s: int(s.split(":")[0][:-1]))
            cb = sum(ch.candidate.codebook for ch in rec.choices if ch.tensor == "key")
            print(f"{b:g} {name}: {rec.mean_bits:.3f} bits, {cb} codebook-key layers, "
                  f"changed vs ctr: {' '.join(changed) or 'none'}")


if __name__ == "__main__":
    main()
