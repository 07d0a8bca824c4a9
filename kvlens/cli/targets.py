"""``kvlens recommend --target ENGINE``: render the answer of ``kvlens.deploy.answer``."""

from __future__ import annotations

from kvlens.cli.common import (
    console,
    err_console,
    escape,
    print_json,
    run_library_call,
    write_config_doc,
)
from kvlens.units import format_interval


def show_target(answer, output, as_json: bool) -> None:
    """An engine target's answer (``kvlens.deploy.answer.EngineAnswer``): its document beside
    ``output`` for ``kvlens report``, then JSON or the tables."""
    if output is not None:
        data = run_library_call(lambda: write_config_doc("deploy", answer.document, output))
        err_console.print(f"results for `kvlens report` written: {escape(str(data))}")
    if as_json:
        print_json(answer.document)
        return
    _render(answer.recommendation, answer.validation)


def _render(rec, validation) -> None:
    from rich.table import Table

    c = rec.chosen
    console.print(f"[bold]Deploy on {rec.target}:[/] {escape(c.deploy['command'])}", highlight=False)
    for name, text in rec.files.items():
        console.print(escape(f"scale file {name} ({c.deploy.get('docs', '')}):"), highlight=False)
        console.print(text.rstrip(), highlight=False, markup=False)
    pred = "" if rec.predicted_kld is None else f", predicted KLD {rec.predicted_kld:.4f}"
    console.print(f"simulated as {escape(c.setting)}: {c.bits:.3f} held bits/element at "
                  f"{rec.context} tokens, error score S = {c.score:.4g}{pred}", highlight=False)
    t = Table(title="Where it hurts (chosen setting): relative attention-output error per "
                    "layer, share of S")
    for col in ("layer", "K out", "V out", "share of S"):
        t.add_column(col, justify="right")
    for r in rec.where_it_hurts():
        t.add_row(str(r["layer"]), f"{r['e_key']:.4f}", f"{r['e_value']:.4f}",
                  f"{100 * r['share']:.1f}%")
    console.print(t)
    f = Table(title=f"{rec.target} settings on the cost/error front ({rec.candidates} "
                    "candidates)")
    for col in ("setting", "bits/elem", "S", "pred. KLD"):
        f.add_column(col, justify="left" if col == "setting" else "right")
    for cand in rec.front:
        p = "-" if rec.kld_model is None else f"{rec.kld_model.predict(cand.score):.4f}"
        mark = " <" if cand is c else ""
        f.add_row(escape(cand.setting + mark), f"{cand.bits:.3f}", f"{cand.score:.4g}", p)
    console.print(f)
    if rec.kld_model is not None:
        m = rec.kld_model
        console.print(f"KLD model: KLD = {m.c:.4g} * S^{m.alpha:.3f} (log RMSE {m.log_rmse:.3f}) "
                      f"fitted on {len(rec.anchors)} measured settings:", highlight=False)
        for a in rec.anchors:
            console.print(f"  {escape(a['setting'])}: S {a['score']:.4g}, measured KLD "
                          f"{format_interval(a, '.4f', key='mean_kld')}", highlight=False)
    if validation is not None:
        console.print(f"validation ({escape(c.setting)}, held-out text): measured KLD "
                      f"{format_interval(validation, '.4f', key='mean_kld')}, top-1 "
                      f"{validation['top1_agreement']:.3f}" + (
                          "" if rec.predicted_kld is None
                          else f"; predicted {rec.predicted_kld:.4f}"), highlight=False)
    for note in rec.notes:
        console.print(f"note: {escape(note)}", highlight=False)
