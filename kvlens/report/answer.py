"""Section 1 of the report, the answer: the recommended config and what it costs, in a few lines
and one picture, before the diagnosis that explains it (what it shows: docs/report.md). Read
from the artifacts only: nothing is computed anew but sums and choices among what the commands
recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvlens.evaluation.frontier import setting_kind
from kvlens.plots.frontier import KIND_STYLE, frontier_png
from kvlens.report.figures import compact_png, png_figure
from kvlens.report.sections import MEMORY_CONTEXTS, Missing, Section, Table, _rel, latest
from kvlens.units import format_bytes, format_interval

COMPARED_PRESET = "kivi-2"  # the published baseline the recommendation is set against
EXAMPLE_ENGINES = ("llamacpp:q8_0/q4_0", "vllm:fp8_e4m3")  # named when no deploy chose any
FRONTIER_WIDTH = 800  # px the frontier chart is drawn and shown at


@dataclass(frozen=True)
class Scored:
    """One config that a run scored with ``--eval kld``."""

    name: str
    kind: str
    result: dict  # the run's result entry (bits_per_element, kld)
    source: str  # the artifact, relative to the run folder
    protocol: dict  # the run's kld protocol (tokens, text_source, ...)

    @property
    def kld(self) -> float:
        return self.result["kld"]["mean_kld"]["value"]


def answer_section(artifacts: dict, run_dir: Path, capture_hint: str) -> Section:
    sec = Section("answer", "The answer")
    rec_path, rec = latest(artifacts, "recommend")
    scored = _scored(artifacts, run_dir)
    if rec is None:
        sec.missing.append(Missing("a per-layer recommendation with its KL divergence",
                                   f"kvlens recommend {capture_hint} --budget-bits 3.0 -o "
                                   f"{run_dir / 'recommended.json'} --validate"))
        if not scored:
            sec.lead = ("Nothing to conclude yet: this run holds no recommendation and no "
                        "scored comparison. Run the two commands below, then kvlens report "
                        "again.")
            _frontier(sec, artifacts, run_dir, None, None)
            return sec
        sec.lead = "No recommendation in this run; the settings it scored are compared below."
    rec_name = None if rec is None else ((rec.get("config") or {}).get("name")
                                         or Path(rec.get("config_file", "")).stem)
    mine = _mine(scored, rec_name)
    presets = [s for s in scored if s.name == COMPARED_PRESET]  # from mine's run when it has it
    preset = next((s for s in presets if mine and s.source == mine.source),
                  presets[0] if presets else None)
    engines = [s for s in scored if s.kind == "engine"]
    engine = min(engines, key=lambda s: s.kld) if engines else None
    if rec is not None:
        sec.source = _rel(rec_path, run_dir)
        sec.lead = _headline(rec, mine)
        if mine is None:
            sec.missing.append(Missing(
                "the recommendation's KL divergence against the exact model",
                f"kvlens recommend {capture_hint} ... -o {run_dir / rec.get('config_file', '')} "
                "--validate"))
    rows = [(mine, "recommended"), (preset, "published baseline"),
            (engine, "lowest KLD of the engine settings measured")]
    if rec is None:  # no recommendation: the front of the newest frontier stands in
        rows = [(s, "on the Pareto front") for s in _front(artifacts, scored, run_dir)] \
            + rows[1:]
    sec.tables.append(_table([(s, why) for s, why in rows if s is not None], mine))
    if preset is None:
        sec.paragraphs.append(f"{COMPARED_PRESET} was not scored in this run.")
    if engine is None:
        sec.paragraphs.append("No engine setting was measured (llama.cpp, vLLM, SGLang or "
                              "transformers cache types, scored with --eval kld).")
    if rec is not None:
        sec.paragraphs.append(_memory(rec))
    _deploy_table(sec, rec, artifacts)
    _frontier(sec, artifacts, run_dir, rec_path, rec)
    return sec


# -- what was scored ----------------------------------------------------------------------------

def _scored(artifacts: dict, run_dir: Path) -> list[Scored]:
    """Every config scored with kld: recommend's validation first, then each generate run,
    the newest first."""
    out = []
    path, rec = latest(artifacts, "recommend")
    if rec and rec.get("validation"):
        proto = (rec.get("validation_evaluation") or {}).get("kld") or {}
        out += [Scored(r["name"], setting_kind(r["name"]), r, _rel(path, run_dir), proto)
                for r in rec["validation"] if _has_kld(r)]
    for gpath, gdoc in artifacts.get("generate") or []:
        proto = (gdoc.get("evaluation") or {}).get("kld")
        if not proto:
            continue
        kinds = {p["name"]: p["kind"] for p in (gdoc.get("frontier") or {}).get("points", [])}
        out += [Scored(r["name"], kinds.get(r["name"]) or setting_kind(r["name"]), r,
                       _rel(gpath, run_dir), proto)
                for r in gdoc.get("results") or [] if _has_kld(r)]
    return out


def _has_kld(r: dict) -> bool:
    return isinstance((r.get("kld") or {}).get("mean_kld"), dict)


def _mine(scored: list[Scored], name: str | None) -> Scored | None:
    """The recommendation's scores: from the run that also scored kivi-2 and engine settings
    beside it (then the paired differences apply), else from recommend's validation."""
    def others(s: Scored) -> int:
        peers = [t for t in scored if t.source == s.source]
        return (any(t.name == COMPARED_PRESET for t in peers)
                + any(t.kind == "engine" for t in peers))

    mine = [s for s in scored if s.name == name]
    return max(mine, key=others) if mine else None  # max keeps the first of equals


def _front(artifacts: dict, scored: list[Scored], run_dir: Path) -> list[Scored]:
    """The settings on the newest recorded frontier, in order of bits."""
    path, _, front = _newest_frontier(artifacts)
    if front is None:
        return []
    source = _rel(path, run_dir)
    by_name = {s.name: s for s in scored if s.source == source}
    return [by_name[n] for n in front.get("front") or [] if n in by_name]


# -- the lines ----------------------------------------------------------------------------------

def _headline(rec: dict, mine: Scored | None) -> str:
    text = (f"Use {rec.get('config_file', 'the recommended config')} (kvlens generate --config "
            f"reads it): {rec['mean_bits']:.2f} bits per element at {rec['context']:,} tokens "
            f"(budget {rec['budget_bits']:g})")
    if mine is None:
        return text + "; its KL divergence was not measured."
    k, p = mine.result["kld"], mine.protocol
    return (text + f"; over {p.get('tokens', '?')} tokens of {p.get('text_source', '?')} it "
            f"held {mine.result.get('bits_per_element', float('nan')):.2f} bits per element, "
            f"mean KL divergence {format_interval(k['mean_kld'], '.4f')} against the exact "
            f"model, perplexity change "
            f"{format_interval(k['ppl_change'], '.2f', scale=100, sign='+')} %, top-1 "
            f"agreement {format_interval(k['top1_agreement'], '.3f')} (95% intervals).")


def _table(rows: list[tuple[Scored, str]], mine: Scored | None) -> Table:
    out, seen = [], set()
    for s, why in rows:
        if (s.name, s.source) in seen:
            continue
        seen.add((s.name, s.source))
        k = s.result["kld"]
        vs = k.get("vs_first") or {}
        paired = "-"
        if mine is not None and s is not mine and s.source == mine.source \
                and vs.get("reference") == mine.name:
            d = vs["mean_kld"]
            paired = format_interval(d, ".4f", sign="+", key="diff", sep="\n") + (
                "\nnot distinguishable" if not d["distinguishable"] else "")
        out.append([s.name, f"{KIND_STYLE[s.kind][2] if s.kind in KIND_STYLE else s.kind}:\n{why}",
                    f"{s.result.get('bits_per_element', float('nan')):.2f}",
                    format_interval(k["mean_kld"], ".4f", sep="\n"),
                    format_interval(k["ppl_change"], ".2f", scale=100, sign="+", unit=" %", sep="\n") + " %",
                    format_interval(k["top1_agreement"], ".3f", sep="\n"), paired,
                    f"{s.source}\n{s.protocol.get('tokens', '?')} tokens"])
    ref = mine.name if mine else "the recommendation"
    return Table(["setting", "what", "bits / element", "mean KLD", "ppl change",
                  "top-1 agreement", f"KLD minus {ref}'s", "measured in"], out,
                 caption="Bits each cache held over the scored text, mean KL divergence "
                         "against the exact model, perplexity change and top-1 agreement with "
                         "their 95% bootstrap intervals; the paired difference where both were "
                         "scored in the same run. Rows from different runs were scored on the "
                         "texts and lengths their run names.",
                 id="answer-table", left=(0, 1, 7))


def _memory(rec: dict) -> str:
    kv = {int(k): v for k, v in (rec.get("kv_bytes") or {}).items()}
    fp16 = {int(k): v for k, v in (rec.get("kv_bytes_fp16") or {}).items()}
    both = sorted(set(kv) & set(fp16))
    absent = [c for c in MEMORY_CONTEXTS if c not in both]
    shown = both if absent else MEMORY_CONTEXTS  # what the artifact has instead, when not all
    if not shown:
        return "Memory: the recommendation records no KV bytes per context."
    parts = [f"{c:,} tokens: {format_bytes(kv[c])} instead of {format_bytes(fp16[c])}, "
             f"{format_bytes(fp16[c] - kv[c])} saved ({1 - kv[c] / fp16[c]:.0%})" for c in shown]
    text = "Memory of the KV cache (all layers, batch 1) against fp16: " + "; ".join(parts) + "."
    if absent:
        text += (f" {', '.join(f'{c:,}' for c in absent)} tokens not recorded by recommend; "
                 "the contexts it recorded are shown.")
    return text


def _deploy_table(sec: Section, rec: dict | None, artifacts: dict) -> None:
    """The command per engine target: the recommendation's own (kvlens), then the newest deploy
    artifact of each engine."""
    rows, targets = [], set()
    own = (rec or {}).get("deploy") or {}
    if own.get("command"):
        rows.append([str(own.get("target", "kvlens")), str(own["command"]), "-"])
    _export_rows(rows, (rec or {}).get("exports"), "kvlens")
    for _, ddoc in artifacts.get("deploy") or []:  # newest first
        d = ddoc.get("deploy") or {}
        target = str(d.get("target") or ddoc.get("target") or "?")
        if target in targets or not d.get("command"):
            continue
        targets.add(target)
        bits = ddoc.get("bits_per_element")
        rows.append([target, str(d["command"]),
                     f"{ddoc.get('setting', '?')}, "
                     + ("?" if bits is None else f"{bits:.2f}") + " bits"])
        _export_rows(rows, d.get("exports"), target)
    engines = ("the setting recommend --target chose for each engine (details in the "
               "recommendation section)" if targets else "no engine: recommend --target "
               "llama.cpp|vllm|sglang|transformers|trtllm -o X.json was not run")
    engines += ("; a per-layer plan of engine types runs in vLLM (skipped layers), "
                "ik_llama.cpp (first/last layers) and ModelOpt's FP8/NVFP4 map "
                "(docs/deploy/README.md#per-layer-exports)")
    if rows:
        sec.tables.append(Table(["target", "command", "setting"], rows, id="answer-deploy",
                                caption=f"How to run it: the recommendation with kvlens, and "
                                        f"{engines}.", left=(0, 1, 2)))


def _export_rows(rows: list, exports, target: str) -> None:
    """A row per engine form of the plan (``kvlens.deploy.plans``) other than ``target``'s
    own: its command, what changed and the KLD of what it runs, when known."""
    for ex in exports or []:
        if ex.get("engine") != target and ex.get("command"):
            kld = ex.get("kld") or {}
            said = "as planned" if ex.get("expressible") else "changed: " + "; ".join(
                ex.get("changes") or [])
            rows.append([f"{ex['engine']} (same plan)", str(ex["command"]),
                         said + ("" if kld.get("kld") is None else
                                 f"; KLD {kld['kld']:.4f} ({kld.get('source')})")])


def _newest_frontier(artifacts: dict):
    for path, doc in artifacts.get("generate") or []:  # newest first
        if (doc.get("frontier") or {}).get("points"):
            return path, doc, doc["frontier"]
    return None, None, None


def _frontier(sec: Section, artifacts: dict, run_dir: Path, rec_path, rec) -> None:
    path, doc, front = _newest_frontier(artifacts)
    if front is None:
        engines = [str(d.get("setting")) for _, d in artifacts.get("deploy") or []
                   if d.get("setting")]
        mine = str(rec_path.parent / rec["config_file"]) if rec and rec.get("config_file") \
            else str(run_dir / "recommended.json")
        items = ",".join(dict.fromkeys([mine, COMPARED_PRESET, *(engines or EXAMPLE_ENGINES)]))
        sec.missing.append(Missing(
            "the bits-vs-KLD frontier of the recommendation, kivi-2 and engine settings",
            f"kvlens generate --compare {items} --eval kld --frontier "
            f"{run_dir / 'frontier.png'} --report-json {run_dir / 'compare.generate.json'}"))
        return
    p = (doc.get("evaluation") or {}).get("kld") or {}
    title = f"{p.get('tokens', '?')} tokens of {p.get('text_source', '?')}"
    names = ", ".join(front.get("front") or []) or "none"
    caption = (f"Bits per element each cache held (measured) against its mean KL divergence "
               f"from the exact model (log scale; bars: 95% intervals), {title}, from "
               f"{_rel(path, run_dir)}. Marker and colour: the kind of setting. Dashed step "
               f"line: the Pareto front, the settings no other holds fewer bits with a lower "
               f"KLD than: {names}.")
    sec.figures.append(png_figure(f"frontier ({_rel(path, run_dir)})", caption,
                                  compact_png(frontier_png(front, title, FRONTIER_WIDTH))))
