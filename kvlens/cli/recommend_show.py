"""``kvlens recommend``'s answer (``kvlens.deploy.answer.recommend_run``) shown: the result
documents written beside the configs for ``kvlens report``, then JSON on stdout or the tables;
``show_layers`` for the per-layer target, ``show_target`` for an engine target."""

from __future__ import annotations

from kvlens.cli.common import (
    console,
    err_console,
    escape,
    format_seconds,
    new_table,
    print_json,
    write_config_doc,
    write_output,
    write_text_output,
)
from kvlens.units import format_bytes, format_interval


def show_layers(answer, outputs, as_json: bool) -> None:
    """The per-layer target's answer (``kvlens.recommend.answer.LayerAnswer``): where the time
    went (stderr), each document beside its config in ``outputs``, then JSON or the tables."""
    _print_profile(answer.recommendations[0].profile, answer.predicted)
    for doc, out in zip(answer.documents, outputs):
        write_config_doc("recommend", doc, out)
    from kvlens.config import save_config

    for path, config in answer.files.items():  # what the engine exports run, their files
        if isinstance(config, str):
            write_text_output(path, config)
        else:
            write_output(path, lambda tmp, c=config: save_config(c, tmp))
        err_console.print(f"written: {escape(str(path))}", highlight=False)
    if as_json:
        docs = answer.documents
        print_json(docs[0] if len(docs) == 1 else {"recommendations": docs})
        return
    if answer.search is not None:
        _render_search(answer.search)
    if len(answer.recommendations) > 1:
        _render_budgets(answer.recommendations)
    else:
        _render(answer.recommendations[0])
    if answer.validation is not None:
        from kvlens.cli.generate import _render_long

        _render_long(answer.validation)
    for ex in answer.documents[-1].get("exports", ()):  # the engines' forms of the config
        if ex["command"]:
            _render_export(ex)


def show_target(answer, output, as_json: bool) -> None:
    """An engine target's answer (``kvlens.deploy.answer.EngineAnswer``): its document beside
    ``output`` for ``kvlens report``, then JSON or the tables."""
    if output is not None:
        write_config_doc("deploy", answer.document, output)
    if as_json:
        print_json(answer.document)
        return
    _render_target(answer.recommendation, answer.validation)


def _render_target(rec, validation) -> None:
    c = rec.chosen
    console.print(f"[bold]Deploy on {rec.target}:[/] {escape(c.deploy['command'])}", highlight=False)
    for name, text in rec.files.items():
        if name == c.deploy.get("cache_file"):  # a per-layer cache: how to load it, not its JSON
            console.print(escape(f"or, one transformers layer per layer from {name} (written "
                                 "beside the config; models with sliding-window layers too):"),
                          highlight=False)
            console.print(c.deploy["snippet"], highlight=False, markup=False)
            continue
        console.print(escape(f"file {name} ({c.deploy.get('docs', '')}):"), highlight=False)
        console.print(text.rstrip(), highlight=False, markup=False)
    for ex in c.deploy.get("exports", ()):
        _render_export(ex)
    kld = ""
    if rec.measured_kld is not None:  # --max-kld measured the choice
        kld = (f", measured KLD {format_interval(rec.measured_kld, '.4f', key='mean_kld')} on "
               f"{rec.measured_kld['eval_tokens']} held-out tokens (" + (
                   "an anchor of the predictor" if rec.predicted_kld is None
                   else f"predicted {rec.predicted_kld:.4f} before it was measured") + ")")
    console.print(f"simulated as {escape(c.setting)}: {c.bits:.3f} held bits/element at "
                  f"{rec.context} tokens, error score S = {c.score:.4g}{kld}", highlight=False)
    t = new_table("Where it hurts (chosen setting): relative attention-output error per layer, "
                  "share of S", ("layer", "K out", "V out", "share of S"), left=())
    for r in rec.where_it_hurts():
        t.add_row(str(r["layer"]), f"{r['e_key']:.4f}", f"{r['e_value']:.4f}",
                  f"{100 * r['share']:.1f}%")
    console.print(t)
    f = new_table(f"{rec.target} settings on the cost/error front ({rec.candidates} candidates)",
                  ("setting", "bits/elem", "S", "pred. KLD", "meas. KLD"))
    measured = {a["setting"]: a["mean_kld"] for a in rec.anchors}
    for cand in rec.front:
        p = "-" if rec.kld_model is None else f"{rec.kld_model.predict(cand.score):.4f}"
        m = f"{measured[cand.setting]:.4f}" if cand.setting in measured else "-"
        mark = " <" if cand is c else ""
        f.add_row(escape(cand.setting + mark), f"{cand.bits:.3f}", f"{cand.score:.4g}", p, m)
    console.print(f)
    if rec.kld_model is not None:
        m = rec.kld_model
        console.print(f"KLD model: KLD = {m.c:.4g} * S^{m.alpha:.3f} (log RMSE {m.log_rmse:.3f}) "
                      f"fitted on {len(rec.anchors)} measured settings, predictions passing "
                      "through each:", highlight=False)
        for a in rec.anchors:  # a check: a choice measured before it was answered
            why = "" if a.get("predicted_kld") is None else \
                f" (checked: predicted {a['predicted_kld']:.4f} before it was measured)"
            console.print(f"  {escape(a['setting'])}: S {a['score']:.4g}, measured KLD "
                          f"{format_interval(a, '.4f', key='mean_kld')}{why}", highlight=False)
    if validation is not None:
        console.print(f"validation ({escape(c.setting)}, held-out text): measured KLD "
                      f"{format_interval(validation, '.4f', key='mean_kld')}, top-1 "
                      f"{validation['top1_agreement']:.3f}" + (
                          "" if rec.predicted_kld is None
                          else f"; predicted {rec.predicted_kld:.4f}") + (
                          f" ({validation['reused']}, not repeated)"
                          if validation.get("reused") else ""), highlight=False)
    for note in rec.notes:
        console.print(f"note: {escape(note)}", highlight=False)


def _render_export(ex: dict) -> None:
    """One per-layer export (``kvlens.deploy.exports.Export.to_dict`` with its ``kld``):
    the command, what the engine cannot express and the KLD of what it will run."""
    k = ex["kld"]
    said = "as planned" if ex["expressible"] else "NOT as planned"
    console.print(f"[bold]{escape(ex['engine'])}[/] ({said}): {escape(ex['command'])}",
                  highlight=False)
    for change in ex["changes"]:
        console.print(f"  changed: {escape(change)}", highlight=False)
    kld = "-" if k["kld"] is None else format_interval(k, ".4f", key="kld") \
        if k.get("ci95") else f"{k['kld']:.4f}"
    bits = "" if k.get("bits_per_element") is None else f", {k['bits_per_element']:.3f} bits"
    what = k.get("setting") or k.get("config")
    runs = "" if what is None else f" {escape(what)}"
    console.print(f"  runs{runs}: KLD {kld} ({escape(k['source'])}){bits}", highlight=False)
    if k.get("command"):  # what measures it (with --validate: measured so)
        console.print(f"  measure it: {escape(k['command'])}", highlight=False)
    for note in ex["notes"]:
        console.print(f"  note: {escape(note)}", highlight=False)


def _print_profile(profile, predicted) -> None:
    """Where the time went (stderr), stage by stage, beside the prediction (None: nothing was
    predicted, the measurement was reused)."""
    said = predicted or {}
    parts = ", ".join(f"{name} {format_seconds(sec)}" + (
        f" (predicted {format_seconds(said[name])})" if name in said else "")
        for name, sec in sorted(profile.stages.items(), key=lambda kv: -kv[1]) if sec >= 0.05)
    err_console.print(f"time by stage ({format_seconds(profile.total)} in all): {parts}",
                      highlight=False)


def _render_search(search) -> None:
    t = new_table(f"Budgets tried for --max-kld {search.max_kld:g} (held-out text, mean KLD "
                  "with its 95% interval)",
                  ("budget", "bits held", "mean KLD", "95% interval", "top-1", ""), left=())
    for st in search.steps:
        lo, hi = st.kld["mean_kld"]["ci95"]
        mark = "chosen" if st.budget_bits == search.chosen.budget_bits else (
            "meets" if st.mean_kld <= search.max_kld else "misses")
        t.add_row(f"{st.budget_bits:g}", f"{st.mean_bits:.3f}", f"{st.mean_kld:.4f}",
                  f"[{lo:.4f}, {hi:.4f}]", f"{st.kld['top1_agreement']['value']:.3f}", mark)
    console.print(t)


def _render_budgets(recs) -> None:
    t = new_table("Configs at each budget (one measurement)",
                  ("config", "budget", "bits held", "expected output error"))
    for rec in recs:
        t.add_row(escape(rec.config.name), f"{rec.budget_bits:g}", f"{rec.mean_bits:.3f}",
                  f"{rec.expected_output_error:.4f}")
    console.print(t)


def _render(rec) -> None:
    t = new_table(f"Recommendation: {rec.mean_bits:.3f} bits/element (budget "
                  f"{rec.budget_bits}) at {rec.context} tokens; windows "
                  f"{'/'.join(map(str, rec.windows))} offered, {rec.sink_tokens} sink tokens",
                  ("layer", "weight", "key", "bits", "K out", "value", "bits", "V out", "R",
                   "F"), left=(2, 5), no_wrap=True)
    by_layer: dict[int, dict] = {}
    for ch in rec.choices:
        by_layer.setdefault(ch.layer, {})[ch.tensor] = ch
    for j, (layer, pair) in enumerate(sorted(by_layer.items())):  # weights: in layer order
        k, v = pair["key"], pair["value"]
        t.add_row(str(layer), f"{rec.weights[j]:.2f}", escape(k.candidate.short), f"{k.bits:.2f}",
                  f"{k.output_error:.3f}", escape(v.candidate.short), f"{v.bits:.2f}",
                  f"{v.output_error:.3f}", str(k.residual_tokens),
                  str(k.flush_tokens or "R"))
    console.print(t)
    console.print("K out / V out: relative attention-output error when only that tensor is "
                  "quantized (where it is consumed), on the capture's text plus, when the "
                  "retrieval probe ran, at its answer position: the metric each choice "
                  "minimises, weighted by the layer's sensitivity (weight). Score and "
                  "reconstruction errors of every choice are in --json. ch = "
                  "per-channel (groups of G tokens), tok = per-token (groups of G channels), "
                  "pre = keys quantized before RoPE, bal = key-channel balancer, rot = Hadamard "
                  "rotation. R = the layer's full-precision window (tokens), F = tokens "
                  "quantized at a time when the window fills (R = the whole window). Errors "
                  "are measured as decoding reads the cache: the window and sink tokens "
                  "exact.")
    m = new_table("KV cache memory (all layers, batch 1)",
                  ("context", "recommended", "fp16", "ratio"), left=())
    for ctx, b in rec.kv_bytes.items():
        f = rec.kv_bytes_fp16[ctx]
        m.add_row(f"{ctx:,}", format_bytes(b), format_bytes(f), f"{f / b:.2f}x")
    console.print(m)
    _render_decode_cost(rec)
    console.print(f"expected mean attention-output error: {rec.expected_output_error:.4f}")
    for note in rec.notes:
        console.print(f"note: {escape(note)}")


def _render_decode_cost(rec) -> None:
    if not rec.decode_cost:
        return
    t = new_table(f"Decode cost at {rec.context:,} tokens (model: bytes one decode step "
                  "reads, all layers, batch 1)",
                  ("config", "read", "vs fp16", "fused kernel path", "torch-path unpack"))
    for name, c in rec.decode_cost:
        fused = "yes" if c.fused else f"no ({len(c.unfused)} layers)"
        t.add_row(escape(name), format_bytes(c.read_bytes), f"{c.ratio_fp16:.3f}", fused,
                  format_bytes(c.torch_unpack_bytes))
    console.print(t)
    console.print("read: codes, scales/zeros, the filled window, sink copies, positions "
                  "(kvlens.cache.decode_cost); a memory-bound step takes time in proportion. "
                  "fused: the Triton decode kernel reads every layer (CUDA); otherwise those "
                  "layers take the torch path. torch-path unpack: float32 codes the eager CPU "
                  "path writes and reads per step (one chunk at a time).")
    for name, c in rec.decode_cost[:1]:
        for layer, why in sorted(c.unfused.items())[:3]:
            console.print(f"  {escape(name)} layer {layer}: {escape(why)}")
