"""transformers' real quantized caches beside kvlens's simulation of them: one table.

For each ``transformers:`` setting (quanto or HQQ backend), ``kvlens generate`` scores the real
cache (``hf-quanto-4:...``, transformers' own layers; needs the ``hf-caches`` extra) and the
simulation (``transformers:quanto-4:...``) in lockstep on the same held-out tokens, then this
prints mean KLD with the 95% intervals generate printed, held bits, the ratio simulated / real
and whether it is within ``--within`` (default 1.5x)::

    python benchmarks/transformers_vs_sim.py --json out.json                 # defaults
    python benchmarks/transformers_vs_sim.py --settings menu --json out.json  # recommend's menu
    python benchmarks/transformers_vs_sim.py --model gemma-3-270m-Q4_K_M.gguf --json g3.json
    python benchmarks/transformers_vs_sim.py --table out.json                 # table only

``--settings``: comma list of settings without the ``transformers:`` engine (``quanto-4``,
``hqq-4:axis_key=1``), ``defaults`` (quanto-4, quanto-2, hqq-4: transformers' defaults) or
``menu`` (every quanto setting ``recommend --target transformers`` searches, and hqq-4 and
hqq-2 on both axes), or ``none``. ``--layers-config CFG --num-layers N``: a per-layer kvlens
config, exported for transformers (``kvlens.deploy.hf_cache``, beside it as
``CFG.transformers_cache.json``) and scored as ``hf-layers:EXPORT`` beside the config itself.
``--also NAME``: more generate items scored in the same run; a pair is matched by name
(``hf-X`` <-> ``transformers:X``) or given with ``--pair REAL=SIM``. CPU, slow: about a minute
per setting per 512 tokens on SmolLM2 on a shared 2-core machine; Ctrl-C keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEFAULTS = ("quanto-4", "quanto-2", "hqq-4")


def menu() -> list[str]:
    from kvlens.deploy.targets import QUANTO

    out = [f"quanto-{b}:axis_key={ak}:axis_value={av}:group={g}" for b, ak, av, g in QUANTO]
    out += [f"hqq-{b}:axis_key={a}:axis_value={a}" for b in (4, 2) for a in (0, 1)]
    return out


def settings_of(text: str) -> list[str]:
    if text == "defaults":
        return list(DEFAULTS)
    if text == "menu":
        return menu()
    if text == "none":
        return []
    return [s.strip() for s in text.split(",") if s.strip()]


def export_layers(config_path: str, num_layers: int) -> tuple[str, str, str]:
    """Export the kvlens config at ``config_path`` for transformers -> (the ``generate`` item
    of the export, the config's path, the pair ``REAL=SIM`` of their result names)."""
    from pathlib import Path

    from kvlens.config import load_config
    from kvlens.deploy.exports import export_path
    from kvlens.deploy.hf_cache import FILE_NAME, compare_name, export

    config = load_config(config_path)
    got = export(config, num_layers)
    if got.document is None:
        sys.exit(f"{config_path} does not map to transformers' layers: "
                 + "; ".join(got.problems))
    path = export_path(Path(config_path), FILE_NAME)
    path.write_text(got.text())
    real = compare_name(str(path))
    return real, config_path, f"{real}={config.name}"


def run(settings: list[str], also: list[str], model: str | None, tokens: int,
        out: str) -> None:
    items = [x for s in settings for x in (f"hf-{s}", f"transformers:{s}")] + also
    cmd = [sys.executable, "-m", "kvlens", "generate", "--compare", ",".join(items),
           "--eval", "kld", "--eval-tokens", str(tokens), "--report-json", out, "--overwrite"]
    if model:
        cmd += ["--model", model]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS":
                                         os.environ.get("OMP_NUM_THREADS", "2")})


def pairs(doc: dict, extra: list[str]) -> list[tuple[dict, dict]]:
    by = {r["name"]: r for r in doc["results"] if "kld" in r}
    out = []
    for name, r in by.items():
        if name.startswith("hf-") and not name.startswith("hf-layers:"):
            sim = by.get("transformers:" + name[3:])
            if sim:
                out.append((r, sim))
    for p in extra:
        real, _, sim = p.partition("=")
        if real in by and sim in by:
            out.append((by[real], by[sim]))
    return out


def table(doc: dict, extra: list[str], within: float) -> list[str]:
    lines = [f"| setting | n | real KLD [95%] | simulated [95%] | sim / real | within {within}x"
             " | real bits | sim bits |", "|---|---:|---:|---:|---:|:---:|---:|---:|"]
    for real, sim in sorted(pairs(doc, extra), key=lambda p: p[0]["kld"]["mean_kld"]["value"]):
        r, s = real["kld"]["mean_kld"], sim["kld"]["mean_kld"]
        ratio = s["value"] / r["value"] if r["value"] else float("inf")
        ok = 1 / within <= ratio <= within
        lines.append(f"| {real['name']} | {real['kld']['scored']} | {r['value']:.4f} "
                     f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] | {s['value']:.4f} "
                     f"[{s['ci95'][0]:.4f}, {s['ci95'][1]:.4f}] | {ratio:.2f} | "
                     f"{'yes' if ok else 'no'} | {real['bits_per_element']:.2f} | "
                     f"{sim['bits_per_element']:.2f} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="defaults")
    ap.add_argument("--also", action="append", default=[])
    ap.add_argument("--pair", action="append", default=[], help="REAL=SIM result names")
    ap.add_argument("--layers-config", default=None)
    ap.add_argument("--num-layers", type=int, default=30)
    ap.add_argument("--model", default=None)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--json", default="transformers_vs_sim.json")
    ap.add_argument("--table", default=None, help="only tabulate this generate --report-json")
    ap.add_argument("--within", type=float, default=1.5)
    args = ap.parse_args(argv)
    path = args.table
    if args.layers_config:
        real, config, pair = export_layers(args.layers_config, args.num_layers)
        args.also += [real, config]
        args.pair.append(pair)
    if path is None:
        run(settings_of(args.settings), args.also, args.model, args.eval_tokens, args.json)
        path = args.json
    with open(path) as f:
        doc = json.load(f)
    print("\n".join(table(doc, args.pair, args.within)))


if __name__ == "__main__":
    main()
