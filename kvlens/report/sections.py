"""The report's sections, in the reader's order, built from the artifacts a run folder holds:
one function per section of the page, in the page's order, with the helpers it uses beside it.

Each ``*_section`` function takes the artifacts (``kvlens.report.artifacts.find_artifacts``)
and returns a ``Section``: its tables, figures and sentences, or, for the parts no command has
written yet, ``missing`` entries naming the command that writes them. Nothing here computes a
new measurement; it only selects, aggregates and words what the commands recorded.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvlens.report.figures import Figure, compare_caption, load_figure, outlier_caption
from kvlens.text.selection import format_index_spec
from kvlens.units import format_bytes, format_interval

MEMORY_CONTEXTS = (4096, 32768, 131072)
STABLE_TOKEN_SHARE = 0.9  # token stability at or above which an outlier counts as stable
TOP_CHANNELS = 12


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    caption: str = ""
    id: str = ""  # the element id tests and readers link to
    left: tuple[int, ...] = (0,)  # columns of text (left-aligned); the others are numbers


@dataclass
class Missing:
    what: str
    command: str  # the command that writes it


@dataclass
class Section:
    id: str
    title: str
    source: str = ""  # artifact file(s) the section was read from
    lead: str = ""  # the section's conclusion, first and set apart
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    more_figures: list[Figure] = field(default_factory=list)  # folded away
    missing: list[Missing] = field(default_factory=list)
    verdict: str = ""
    notes: list[str] = field(default_factory=list)  # for "what was not measured"


def latest(artifacts: dict, kind: str) -> tuple[Path, dict] | tuple[None, None]:
    docs = artifacts.get(kind) or []
    return docs[0] if docs else (None, None)


def _rel(path: Path | None, run_dir: Path) -> str:
    if path is None:
        return ""
    try:
        return path.resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return str(path)


def _start(sec: Section, artifacts: dict, run_dir: Path, kind: str, what: str,
           command: str) -> tuple[Path | None, dict | None]:
    """The newest ``kind`` artifact; when there is none, ``sec`` says what and which command."""
    path, doc = latest(artifacts, kind)
    if doc is None:
        sec.missing.append(Missing(what, command))
    else:
        sec.source = _rel(path, run_dir)
    return path, doc


def _f(v: float | None, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


# -- 1. model and capture -------------------------------------------------------------------

def model_section(artifacts: dict, run_dir: Path, capture_hint: str) -> Section:
    sec = Section("model", "Model and capture")
    path, doc = _start(sec, artifacts, run_dir, "capture",
                       "the capture summary (architecture, text source, versions)",
                       f"kvlens capture -o {capture_hint}")
    if doc is None:
        src = next(iter(capture_records(artifacts)), None)
        if src:  # outliers.json writes num_samples, compare-axes samples
            samples, tokens = (src.get(f"num_{k}", src.get(k)) for k in ("samples", "tokens"))
            sec.paragraphs.append("From the other commands' records (the capture summary is "
                                  "missing):")
            sec.tables.append(Table(["", ""], [
                ["model", str(src.get("model"))],
                ["heads", f"{src.get('num_attention_heads')} query / "
                          f"{src.get('num_key_value_heads')} KV, head_dim {src.get('head_dim')}"],
                ["tokens", f"{samples} samples x {tokens} tokens"]], id="model-table"))
        return sec
    rope = doc.get("rope") or {}
    theta = rope.get("rope_theta") or rope.get("theta")
    rope_text = "none" if not doc.get("has_rope") else (
        f"{doc.get('rope_layout')} layout, rotary_dim {doc.get('rotary_dim')}"
        + (f", theta {theta:g}" if isinstance(theta, (int, float)) else ""))
    v = doc.get("versions") or {}
    rows = [
        ["model", f"{doc.get('model')} ({doc.get('model_source') or 'source not recorded'})"],
        ["architecture", f"{doc.get('architecture')} (model_type {doc.get('model_type')})"],
        ["layers", f"{doc.get('num_layers')} "
                   f"(captured: {format_index_spec(doc.get('layers') or [])})"],
        ["heads", f"{doc.get('num_attention_heads')} query / {doc.get('num_key_value_heads')} "
                  f"KV, head_dim {doc.get('head_dim')}"],
        ["RoPE", rope_text],
        ["tokens", f"{doc.get('samples')} samples x {doc.get('tokens')} tokens"],
        ["text source", str(doc.get("text_source") or "not recorded")],
        ["dtypes", f"compute {doc.get('compute_dtype')}, stored {doc.get('storage_dtype')}"],
        ["versions", f"kvlens {v.get('kvlens') or '?'}, transformers "
                     f"{v.get('transformers') or '?'}, torch {v.get('torch') or '?'}"],
        ["captured", f"{doc.get('created') or '?'} into {doc.get('capture_file')}"],
    ]
    sec.tables.append(Table(["", ""], rows, id="model-table"))
    sec.notes.extend(f"capture: {n}" for n in doc.get("notes") or [])
    return sec


def capture_records(artifacts: dict) -> list[dict]:
    """What the other commands recorded of the capture: outliers.json's, then compare-axes'."""
    _, out = latest(artifacts, "outliers")
    _, cmp = latest(artifacts, "compare-axes")
    return [d for d in (out, ((cmp or {}).get("summary") or {}).get("capture")) if d]


# -- 2. outliers ----------------------------------------------------------------------------

def outliers_section(artifacts: dict, run_dir: Path, capture_hint: str) -> Section:
    sec = Section("outliers", "Outlier channels before and after RoPE")
    path, doc = _start(sec, artifacts, run_dir, "outliers", "outlier statistics and figures",
                       f"kvlens plot-outliers {capture_hint} --out {run_dir / 'outliers'}")
    if doc is None:
        return sec
    threshold = float((doc.get("rule") or {}).get("threshold", 4.0))
    heads = doc.get("heads") or []
    sec.paragraphs.extend(_outlier_sentences(heads, threshold))
    for tensor, what in (("k_pre", "keys, before RoPE"), ("v", "values"),
                         ("q_pre", "queries, before RoPE")):
        table = _channel_table(heads, tensor, what, threshold)
        if table is not None:
            sec.tables.append(table)
    folder = path.parent
    names = doc.get("figures") or []
    for n in names:  # the overview, key profiles and heatmaps shown; the others folded
        stem = Path(n).stem
        fig = load_figure(folder, n, outlier_caption(n, threshold))
        shown = stem == "overview" or stem.endswith("_k") or stem.startswith("heatmap")
        (sec.figures if shown else sec.more_figures).append(fig)
    layers = doc.get("layers") or []
    sec.notes.append(f"outliers: {len(layers)} layers analysed ({format_index_spec(layers)}), "
                     f"{doc.get('num_samples')} samples x {doc.get('num_tokens')} tokens; "
                     "stability over longer contexts was not measured.")
    return sec


def _outlier_sentences(heads: list[dict], threshold: float) -> list[str]:
    out = [f"Rule: a channel is an outlier when its abs-max over tokens is at least "
           f"{threshold:g} x the median channel abs-max of its head. Stable: flagged on at "
           f"least {STABLE_TOKEN_SHARE:.0%} of tokens and in every sample."]
    k_pre = [h for h in heads if h["tensor"] == "k_pre"]
    if k_pre:
        flagged = [h for h in k_pre if h["outliers"]]
        chans = [o for h in k_pre for o in h["outliers"]]
        stable = [o for o in chans if _stable(o)]
        rope = [r for h in k_pre for r in h.get("rope") or []]
        still = sum(1 for r in rope if r.get("outlier_post"))
        text = (f"Keys before RoPE: {len(flagged)} of {len(k_pre)} (layer, KV head) pairs have "
                f"outlier channels, {len(chans)} in all, {len(stable)} of them stable.")
        if rope:
            shift = max(abs(r["partner_share_post"] - r["partner_share_pre"]) for r in rope)
            text += (f" After RoPE, {still} of {len(rope)} are still flagged; the largest "
                     f"change of a partner's energy share is {shift:.2f} (0.5 = fully smeared "
                     "into the RoPE partner).")
        out.append(text)
    v = [h for h in heads if h["tensor"] == "v"]
    if v:
        n = sum(len(h["outliers"]) for h in v)
        worst = max(h["max_ratio"] for h in v)
        out.append(f"Values: {n} outlier channels in {len(v)} heads; the worst head's "
                   f"max/median ratio is {worst:.1f}.")
    return out


def _stable(o: dict) -> bool:
    return o["token_stability"] >= STABLE_TOKEN_SHARE and o["sample_stability"] >= 1.0


def _channel_table(heads: list[dict], tensor: str, what: str, threshold: float) -> Table | None:
    """Channels flagged in ``tensor``, aggregated over (layer, head): the recurring ones first."""
    hs = [h for h in heads if h["tensor"] == tensor]
    if not hs:
        return None
    by: dict[int, list[tuple[dict, dict, dict | None]]] = defaultdict(list)
    for h in hs:
        rope = {r["channel"]: r for r in h.get("rope") or []}
        for o in h["outliers"]:
            by[o["channel"]].append((h, o, rope.get(o["channel"])))
    if not by:
        return Table(["channel"], [], caption=f"No {what} channel passes the rule.",
                     id=f"channels-{tensor}")
    order = sorted(by, key=lambda c: (-sum(_stable(o) for _, o, _ in by[c]), -len(by[c]), c))
    rows = []
    for c in order[:TOP_CHANNELS]:
        items = by[c]
        where = sorted({(h["layer"], h["head"]) for h, _, _ in items})
        ropes = [r for _, _, r in items if r]
        partner = {r["partner"] for r in ropes}
        rows.append([
            str(c),
            f"{len(items)} / {len(hs)}",
            str(sum(_stable(o) for _, o, _ in items)),
            f"{statistics.median(o['ratio'] for _, o, _ in items):.1f}",
            f"{statistics.median(o['token_stability'] for _, o, _ in items):.2f}",
            ", ".join(f"{layer}:{head}" for layer, head in where[:8])
            + (f" (+{len(where) - 8})" if len(where) > 8 else ""),
            "-" if not ropes else ", ".join("none" if p is None else str(p)
                                            for p in sorted(partner, key=lambda p: p or -1)),
            "-" if not ropes else
            f"{statistics.median(r['partner_share_pre'] for r in ropes):.2f} -> "
            f"{statistics.median(r['partner_share_post'] for r in ropes):.2f}",
            "-" if not ropes else
            f"{statistics.median(r['token_stability_post'] for r in ropes):.2f}",
        ])
    extra = len(order) - len(rows)
    caption = (f"Outlier channels of the {what}, the most often stable first"
               + (f" ({extra} more channels not shown)" if extra > 0 else "")
               + f". heads: (layer, head) pairs flagging the channel / all analysed. ratio: "
               f"median abs-max / median channel abs-max (rule: >= {threshold:g}). tok: median "
               "share of tokens on which it is among the largest. partner share: median energy "
               "share of its RoPE partner before -> after RoPE. tok after: token share after "
               "RoPE.")
    return Table(["channel", "heads", "stable", "ratio", "tok", "where (layer:head)",
                  "RoPE partner", "partner share", "tok after"], rows, caption,
                 id=f"channels-{tensor}", left=(0, 5))


# -- 3. per-axis errors ---------------------------------------------------------------------

#: compare-axes' error metrics, in the order tables show them, and their column labels
METRIC_LABELS = {"reconstruction": "recon", "score": "score", "attention_weights": "weights",
                "attention_output": "output"}


def config_label(r: dict, bit: str = "-bit", stage: str = "-RoPE") -> str:
    """A compare-axes configuration as ``K 2-bit G32 pre-RoPE rotate`` (the terminal's
    shorter ``K 2b G32 pre rotate``: ``bit="b", stage=""``)."""
    parts = ["K" if r["tensor"] == "key" else "V", f"{r['bits']}{bit}", f"G{r['group_size']}"]
    if r.get("stage"):
        parts.append(f"{r['stage']}{stage}")
    if r.get("variant", "plain") != "plain":
        parts.append(r["variant"])
    return " ".join(parts)


def _ckey(r: dict) -> tuple:
    return (r["tensor"], r["bits"], r["group_size"], r.get("stage"), r.get("variant"))


def axis_rows(summary: dict):
    """compare-axes' summary, a row per configuration (its ranking) and axis: ``(ranking,
    axis, cells)``, a cell per metric of ``METRIC_LABELS``: ``(mean or None, whether this axis
    is the better one under that metric)``."""
    means = {(*_ckey(m), m["axis"], m["metric"]): m["mean"] for m in summary.get("means", [])}
    winners = {(*_ckey(w), w["metric"]): w["winner"] for w in summary.get("winners", [])}
    for r in summary.get("rankings", []):
        for axis in ("per-token", "per-channel"):
            yield r, axis, [(means.get((*_ckey(r), axis, m)), winners.get((*_ckey(r), m)) == axis)
                            for m in METRIC_LABELS]


def axes_section(artifacts: dict, run_dir: Path, capture_hint: str) -> Section:
    sec = Section("axes", "Per-axis errors: reconstruction vs score vs attention output")
    path, doc = _start(sec, artifacts, run_dir, "compare-axes",
                       "per-axis errors and their figures",
                       f"kvlens compare-axes {capture_hint} --plots {run_dir / 'compare'}")
    if doc is None:
        return sec
    summary = doc.get("summary") or {}
    rows = [[config_label(r) if axis == "per-token" else "", axis,
             *("-" if v is None else f"{v:.4f}{'*' if best else ''}" for v, best in cells)]
            for r, axis, cells in axis_rows(summary)]
    cap = summary.get("capture") or {}
    sec.tables.append(Table(
        ["config", "axis", *METRIC_LABELS.values()], rows, left=(0, 1),
        caption="Relative Frobenius error ||X - X_hat|| / ||X||, mean over layers and heads; "
                "* marks the better axis under that metric. recon: the stored tensor; score: "
                "pre-softmax logits; weights: post-softmax; output: the attention output. "
                f"{cap.get('samples', '?')} sample(s) x {cap.get('tokens', '?')} tokens.",
        id="axes-table"))
    sec.tables.append(_disagreement_table(doc, summary))
    for d in summary.get("disagreements", []):
        sec.paragraphs.append(
            f"{config_label(d)}: reconstruction favours {d['reconstruction']}, attention "
            f"output favours {d['attention_output']} (mean over layers).")
    for k in summary.get("kivi_pattern", []):
        failed = [n for n, c in (k.get("checks") or {}).items() if not c.get("holds")]
        sec.paragraphs.append(
            f"KIVI pattern (keys per-channel, values per-token) at {k['bits']}-bit "
            f"G{k['group_size']}: {'holds' if k['holds'] else 'does not hold'}"
            + (f" (fails: {', '.join(failed)})" if failed else "") + ".")
    folder = path.parent
    for n in doc.get("figures") or []:
        fig = load_figure(folder, n, compare_caption(n))
        (sec.figures if Path(n).stem.startswith("layers_") else sec.more_figures).append(fig)
    cfg = summary.get("config") or {}
    if not cfg.get("formats"):
        sec.notes.append("compare-axes: engine formats (q8_0, q4_0, fp8...) were not swept "
                         "(add --formats).")
    sec.notes.append(f"compare-axes: bits {cfg.get('bits')}, group sizes "
                     f"{cfg.get('group_sizes')}, key stages {cfg.get('stages')}; other "
                     "settings were not measured.")
    return sec


def _layer_list(layers: list[int]) -> str:
    return f"{len(layers)}: {format_index_spec(layers)}" if layers else "none"


def _side(cells: dict, metric: str, layer: int) -> int:
    """The better axis under ``metric`` in ``layer``: 1 per-token, -1 per-channel, 0 a tie or
    not measured."""
    v = cells.get((metric, layer), {})
    if "per-token" not in v or "per-channel" not in v:
        return 0
    return (v["per-token"] < v["per-channel"]) - (v["per-channel"] < v["per-token"])


def _disagreement_table(doc: dict, summary: dict) -> Table:
    """Per configuration: the layers where reconstruction and attention output (and score, for
    keys) pick different axes, from the per-layer means."""
    by: dict[tuple, dict[tuple[str, int], dict[str, float]]] = defaultdict(
        lambda: defaultdict(dict))
    for m in doc.get("layer_means") or []:
        by[_ckey(m)][(m["metric"], m["layer"])][m["axis"]] = m["mean"]
    rows = []
    for r in summary.get("rankings", []):
        cells = by.get(_ckey(r))
        if not cells:
            continue
        layers = sorted({layer for _, layer in cells})

        out = {n: _side(cells, "attention_output", n) for n in layers}
        apart = {m: [n for n in layers if _side(cells, m, n) * out[n] < 0]  # picked otherwise
                 for m in ("reconstruction", "score")}
        rows.append([config_label(r), f"{sum(s < 0 for s in out.values())} / {len(layers)}",
                     _layer_list(apart["reconstruction"]),
                     "-" if r["tensor"] != "key" else _layer_list(apart["score"])])
    if not rows:
        return Table(["config"], [], caption="No per-layer means recorded (compare-axes.json "
                                             "from an older kvlens): re-run compare-axes.",
                     id="disagree-table")
    return Table(["config", "layers per-channel wins output", "layers recon vs output disagree",
                  "layers score vs output disagree"], rows,
                 caption="Per layer (mean over heads): the better axis under each metric. A "
                         "listed layer is one where choosing by the stored tensor's error (or "
                         "the scores') would pick the other axis than the attention output "
                         "needs.", id="disagree-table", left=(0, 2, 3))


# -- 4. recommendation ----------------------------------------------------------------------

def _windows_text(doc: dict) -> str:
    """``128-token``, or ``per-layer (32: 4 layers, 64: 26 layers)`` when layers differ."""
    per_layer = {ch["layer"]: ch.get("residual_tokens") for ch in doc.get("choices") or []}
    sizes = sorted({r for r in per_layer.values() if r})
    if len(sizes) <= 1:
        return f"{sizes[0] if sizes else doc.get('residual_tokens')}-token"
    counts = [sum(r == w for r in per_layer.values()) for w in sizes]
    return "per-layer (" + ", ".join(f"{w} tokens: {c} layers" for w, c in zip(sizes, counts)) \
        + ")"


def recommend_section(artifacts: dict, run_dir: Path, capture_hint: str) -> Section:
    sec = Section("recommend", "Recommendation")
    path, doc = _start(sec, artifacts, run_dir, "recommend",
                       "the per-layer recommendation, its memory and deploy settings",
                       f"kvlens recommend {capture_hint} --budget-bits 3.0 -o "
                       f"{run_dir / 'recommended.json'} --validate")
    if doc is None:
        _deploy(sec, {}, artifacts)
        return sec
    sec.paragraphs.append(
        f"Config {doc.get('config_file', '?')} (`kvlens generate --config` reads it): "
        f"{doc['mean_bits']:.3f} bits per cached element at {doc['context']:,} tokens, budget "
        f"{doc['budget_bits']:g}, every part counted (codes, scales, the "
        f"{_windows_text(doc)} full-precision window, "
        f"{doc.get('sink_tokens')} sink tokens). Expected mean attention-output error "
        f"{doc.get('expected_output_error', float('nan')):.4f}.")
    weights = doc.get("layer_weights") or []
    by_layer: dict[int, dict[str, dict]] = defaultdict(dict)
    for ch in doc.get("choices") or []:
        by_layer[ch["layer"]][ch["tensor"]] = ch
    rows = []
    for j, layer in enumerate(sorted(by_layer)):  # weights: per layer with a KV cache, in order
        k, v = by_layer[layer].get("key"), by_layer[layer].get("value")
        rows.append([str(layer), _f(weights[j], ".2f") if j < len(weights) else "-",
                     *_choice_cells(k), *_choice_cells(v)])
    sec.tables.append(Table(
        ["layer", "weight", "key", "K bits", "K out err", "value", "V bits", "V out err"], rows,
        caption="Per layer: the layout chosen for keys and values (bits, per-token / "
                "per-channel grouping, group size G; pre-RoPE, +bal = MiKV balancer, "
                "+rotation = Hadamard), the bits each holds per element at the reference "
                "context, and the relative attention-output error it was chosen by; weight: "
                "the layer's measured sensitivity.", id="recommend-table", left=(2, 5)))
    sec.tables.append(_memory_table(doc))
    _deploy(sec, doc, artifacts)
    sec.notes.extend(f"recommend: {n}" for n in doc.get("notes") or [])
    sec.notes.append("memory: bytes the cache's layout holds (kvlens.cache.layout), computed "
                     "for each context, not measured in a running process here.")
    return sec


def _choice_cells(ch: dict | None) -> list[str]:
    if ch is None:
        return ["-", "-", "-"]
    return [ch["candidate"].get("label", "?"), f"{ch['bits']:.2f}", f"{ch['output_error']:.4f}"]


def _memory_table(doc: dict) -> Table:
    kv = {int(k): v for k, v in (doc.get("kv_bytes") or {}).items()}
    fp16 = {int(k): v for k, v in (doc.get("kv_bytes_fp16") or {}).items()}
    rows = []
    for ctx in MEMORY_CONTEXTS:
        if ctx in kv and ctx in fp16:
            rows.append([f"{ctx:,}", format_bytes(kv[ctx]), format_bytes(fp16[ctx]), f"{kv[ctx] / fp16[ctx]:.3f}",
                         f"{16 * kv[ctx] / fp16[ctx]:.2f}"])
        else:
            rows.append([f"{ctx:,}", "not recorded", "-", "-", "-"])
    return Table(["context (tokens)", "recommended", "fp16", "vs fp16", "bits / element"], rows,
                 caption="KV cache of all layers, batch 1.", id="memory-table")


def _deploy(sec: Section, doc: dict, artifacts: dict) -> None:
    """Deploy settings: ``doc["deploy"]``, with ``target`` and ``command`` (other keys are
    shown as they are), then every engine setting ``recommend --target ENGINE -o X.json``
    recorded (``X.deploy.json``)."""
    items = [doc["deploy"]] if doc.get("deploy") else []
    for _, ddoc in artifacts.get("deploy") or []:
        entry = dict(ddoc.get("deploy") or {"target": ddoc.get("target")})
        entry["bits per element"] = _f(ddoc.get("bits_per_element"), ".2f")
        if ddoc.get("predicted_kld") is not None:
            entry["predicted KLD"] = _f(ddoc["predicted_kld"], ".4f")
        val, by = ddoc.get("validation"), "--validate"  # what recommend --target measured
        if not (isinstance(val, dict) and val.get("mean_kld") is not None) \
                and ddoc.get("measured_kld") is not None:  # the --max-kld search measured it
            val = {"mean_kld": ddoc["measured_kld"], "ci95": ddoc.get("measured_kld_ci95")}
            by = "--max-kld"
        if isinstance(val, dict) and val.get("mean_kld") is not None:
            entry[f"measured KLD ({by})"] = format_interval(
                {**val, "ci95": val.get("ci95") or (float("nan"),) * 2}, ".4f", key="mean_kld")
        items.append(entry)
    if not items:
        sec.missing.append(Missing("deploy settings for an inference engine",
                                   "kvlens recommend ... --target llama.cpp|vllm|sglang|"
                                   "transformers|trtllm -o CONFIG.json"))
        return
    rows = []
    for d in items:
        others = "; ".join(f"{k}: {v}" for k, v in d.items()
                           if k not in ("target", "command", "exports"))
        rows.append([str(d.get("target", "?")), str(d.get("command", "-")), others])
        for ex in d.get("exports") or []:  # what each engine runs of the plan (answer's table)
            k = ex.get("kld") or {}
            kld = "KLD not measured" if k.get("kld") is None else \
                f"KLD {k['kld']:.4g} ({k.get('source')})"
            rows.append([f"{ex.get('engine')} (export)", str(ex.get("command", "-")),
                         "; ".join([*(ex.get("changes") or ["as planned"]), kld])])
    sec.tables.append(Table(["target", "command", "details"], rows,
                            caption="Deploy settings recorded by recommend (engine targets: "
                                    "bits held by the engine's cache types, KLD predicted by "
                                    "the fitted error model and, with --max-kld or --validate, "
                                    "measured).",
                            id="deploy-table", left=(0, 1, 2)))


# -- 5. validation --------------------------------------------------------------------------

def validation_section(artifacts: dict, run_dir: Path) -> Section:
    sec = Section("validation", "Validation against the exact model")
    sources = []
    path, doc = latest(artifacts, "recommend")
    if doc and doc.get("validation"):
        sources.append((path, doc["validation"], doc.get("validation_evaluation") or {}))
    for gpath, gdoc in artifacts.get("generate") or []:
        if gdoc.get("evaluation", {}).get("kld") or gdoc.get("evaluation", {}).get("retrieval"):
            sources.append((gpath, gdoc.get("results") or [], gdoc.get("evaluation") or {}))
    if not sources:
        sec.missing.append(Missing(
            "KL divergence of the recommendation beside the presets, with intervals",
            f"kvlens recommend ... -o {run_dir / 'recommended.json'} --validate (or kvlens "
            f"generate --compare {run_dir / 'recommended.json'},kivi-2,kivi-4 --eval kld "
            f"--report-json {run_dir / 'eval.generate.json'})"))
        return sec
    sec.source = ", ".join(_rel(p, run_dir) for p, _, _ in sources)
    best = 0
    for i, (p, results, ev) in enumerate(sources):
        if "kld" in ev:
            table, verdict = _kld_table(results, ev["kld"], f"kld-table-{i}")
            table.caption = f"From {_rel(p, run_dir)}. " + table.caption
            sec.tables.append(table)
            # the verdict of the widest comparison (recommend --validate may have skipped
            # presets that do not fit the model; generate --compare may hold more)
            if verdict and len(table.rows) > best:
                sec.verdict, best = verdict, len(table.rows)
            proto = ev["kld"]
            sec.notes.append(f"validation: KL divergence on {proto.get('tokens')} tokens of "
                             f"{proto.get('text_source')}; longer contexts were not scored.")
        if "retrieval" in ev:
            sec.tables.append(_retrieval_table(results, ev["retrieval"], f"retrieval-table-{i}"))
        else:
            sec.notes.append(f"validation ({_rel(p, run_dir)}): retrieval (passkey, key-value) "
                             "was not run; add --retrieval-prompts N to recommend --validate, "
                             "or generate --eval retrieval.")
    return sec


def _kld_table(results: list[dict], proto: dict, table_id: str) -> tuple[Table, str]:
    rows = []
    exact = proto.get("exact")
    if exact:
        rows.append(["exact", "16", "0", "1", format_interval(exact["ppl"], ".3f", sep="\n"),
                     "0", "-"])
    scored = [r for r in results if r.get("kld")]
    for r in scored:
        k = r["kld"]
        vs = k.get("vs_first")
        paired = "-" if not vs else (
            format_interval(vs["mean_kld"], ".4f", sign="+", key="diff", sep="\n")
            + ("" if vs["mean_kld"]["distinguishable"] else "\nnot distinguishable"))
        rows.append([r["name"], f"{r.get('bits_per_element', float('nan')):.2f}",
                     format_interval(k["mean_kld"], ".4f", sep="\n"),
                     format_interval(k["top1_agreement"], ".3f", sep="\n"), format_interval(k["ppl"], ".3f", sep="\n"),
                     format_interval(k["ppl_change"], ".2f", scale=100, sign="+", unit=" %", sep="\n") + " %", paired])
    boot = proto.get("bootstrap") or {}
    caption = (f"{proto.get('scored')} predictions over {proto.get('tokens')} tokens of "
               f"{proto.get('text_source')}, {proto.get('chunk')} tokens per forward"
               + (" (INTERRUPTED: partial)" if proto.get("interrupted") else "")
               + ". bits / element: what each cache held at the end of the scored text (a "
               "short text weighs the full-precision window more than the long contexts the "
               "recommendation is sized for). Brackets: 95% bootstrap intervals over blocks "
               f"of {boot.get('unit_tokens')} tokens ({boot.get('resamples')} resamples). Last "
               f"column: the config's mean KLD minus that of {_reference(scored)} (the first "
               "compressed config), paired over the same blocks.")
    table = Table(["config", "bits / element", "mean KLD", "top-1 agreement", "perplexity",
                   "ppl change", f"KLD minus {_reference(scored)}'s"], rows, caption,
                  id=table_id)
    return table, _verdict(scored, proto.get("tokens"))


def _reference(scored: list[dict], default: str | None = "-") -> str | None:
    return next((r["kld"]["vs_first"]["reference"] for r in scored
                 if r["kld"].get("vs_first")), default)


def _verdict(scored: list[dict], tokens: int | None = None) -> str:
    """One sentence: the first config against each other one, by paired mean-KLD difference."""
    if len(scored) < 2:
        if scored:
            k = scored[0]["kld"]
            return (f"{scored[0]['name']} has a mean KL divergence of "
                    f"{format_interval(k['mean_kld'], '.4f')} against the exact model (no other config "
                    "was scored beside it).")
        return ""
    ref = _reference(scored, None)
    first = next((r for r in scored if r["name"] == ref), scored[0])
    groups: dict[str, list[str]] = {"lower than": [], "higher than": [],
                                     "not distinguishable from": []}
    for r in scored:
        vs = r["kld"].get("vs_first")
        if not vs or r is first:
            continue
        d = vs["mean_kld"]  # diff > 0: the other config has the higher KLD
        groups["not distinguishable from" if not d["distinguishable"] else
               "lower than" if d["diff"] > 0 else "higher than"].append(
            f"{r['name']} ({r.get('bits_per_element', float('nan')):.2f} bits)")
    parts = [f"{how} {_join(labels)}" for how, labels in groups.items() if labels]
    return (f"At {first.get('bits_per_element', float('nan')):.2f} bits per element held "
            f"over {tokens or 'the scored'} tokens, "
            f"{first['name']}'s mean KL divergence against the exact model, "
            f"{format_interval(first['kld']['mean_kld'], '.4f')}, is " + "; ".join(parts)
            + " (paired 95% intervals).")


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _retrieval_table(results: list[dict], proto: dict, table_id: str) -> Table:
    rows = []
    entries = ([("exact", proto["exact"])] if proto.get("exact") else []) + \
        [(r["name"], r["retrieval"]) for r in results if r.get("retrieval")]
    for name, doc in entries:
        cells = [f"{c['correct']}/{c['total']} [{c['wilson95'][0]:.2f}-{c['wilson95'][1]:.2f}]"
                 for c in doc.get("by_length", [])]
        rows.append([name, *cells, f"{doc['correct']}/{doc['total']}"])
    return Table(["config", *(f"{n} tokens" for n in proto.get("lengths", [])), "all"], rows,
                 caption=f"Retrieval (passkey and key-value lookup), {proto.get('prompts')} "
                         f"prompt(s) per task, length and depth {proto.get('depths')}: correct "
                         "/ total [Wilson 95% interval].", id=table_id)


# -- 6. what was not measured ---------------------------------------------------------------

def not_measured_section(sections: list[Section]) -> Section:
    sec = Section("not-measured", "What was not measured")
    for s in sections:
        for m in s.missing:
            sec.paragraphs.append(f"{s.title}: {m.what} (missing).")
        sec.paragraphs.extend(s.notes)
    sec.paragraphs.append("Speed: no decode timing is part of this report (kvlens generate "
                          "and make bench measure it).")
    return sec
