"""``kvlens recommend --target ENGINE``: run ``kvlens.deploy.targets`` and render its answer."""

from __future__ import annotations

from pathlib import Path

from kvlens.cli.common import console, err_console, print_json, progress_bar, run_library_call


def run_target(capture: Path, *, target: str, budget_bits, max_kld, anchors: int, context: int,
               samples: int, tokens: int, rotation: bool, model, output, overwrite: bool,
               validate: bool, eval_tokens, as_json: bool) -> None:
    from kvlens.deploy.targets import TargetOptions, recommend_target
    from kvlens.deploy.targets import validate as run_validation

    def prepare():
        from kvlens.errors import InputError

        if output is not None and output.exists() and not overwrite:
            raise InputError(f"{output} already exists; pass --overwrite to replace it.")
        return TargetOptions(target=target, budget_bits=budget_bits, max_kld=max_kld,
                             context=context, samples=samples, tokens=tokens,
                             rotation=rotation, eval_tokens=eval_tokens or 2048,
                             anchors=anchors, model=model)

    opts = run_library_call(prepare)
    bundle: list = []

    def load():
        if not bundle:
            from kvlens.capture.store import open_capture
            from kvlens.deploy.targets import _load

            with open_capture(capture) as cap:
                bundle.extend(_load(cap.meta, opts))
        return tuple(bundle)

    with progress_bar("measuring engine cache types") as update:
        rec = run_library_call(lambda: recommend_target(
            capture, opts, progress=update, log=lambda m: err_console.print(f"  {m}"),
            model_bundle=load() if max_kld is not None else None))
    written = []
    if output is not None:
        from kvlens.config import save_config

        save_config(rec.chosen.config, output)
        written.append(str(output))
        for name, text in rec.files.items():
            path = output.parent / name
            path.write_text(text, encoding="utf-8")
            written.append(str(path))
        for w in written:
            err_console.print(f"written: {w}")
    validation = None
    if validate:
        validation = run_library_call(lambda: run_validation(
            rec, load(), opts.eval_tokens, lambda m: err_console.print(f"  {m}")))
    doc = rec.to_dict()
    doc["files"] = rec.files
    if validation is not None:
        doc["validation"] = validation
    if output is not None:
        from kvlens.report.artifacts import write_config_doc

        data = write_config_doc("deploy", doc, output)
        err_console.print(f"results for `kvlens report` written: {data}")
    if as_json:
        print_json(doc)
        return
    _render(rec, validation)


def _render(rec, validation) -> None:
    from rich.table import Table

    c = rec.chosen
    console.print(f"[bold]Deploy on {rec.target}:[/] {c.deploy['command']}", highlight=False)
    for name, text in rec.files.items():
        console.print(f"scale file {name} ({c.deploy.get('docs', '')}):", highlight=False)
        console.print(text.rstrip(), highlight=False, markup=False)
    pred = "" if rec.predicted_kld is None else f", predicted KLD {rec.predicted_kld:.4f}"
    console.print(f"simulated as {c.setting}: {c.bits:.3f} held bits/element at "
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
        f.add_row(cand.setting + mark, f"{cand.bits:.3f}", f"{cand.score:.4g}", p)
    console.print(f)
    if rec.kld_model is not None:
        m = rec.kld_model
        console.print(f"KLD model: KLD = {m.c:.4g} * S^{m.alpha:.3f} (log RMSE {m.log_rmse:.3f}) "
                      f"fitted on {len(rec.anchors)} measured settings:", highlight=False)
        for a in rec.anchors:
            console.print(f"  {a['setting']}: S {a['score']:.4g}, measured KLD "
                          f"{a['mean_kld']:.4f} [{a['ci95'][0]:.4f}, {a['ci95'][1]:.4f}]",
                          highlight=False)
    if validation is not None:
        lo, hi = validation["ci95"]
        console.print(f"validation ({c.setting}, held-out text): measured KLD "
                      f"{validation['mean_kld']:.4f} [{lo:.4f}, {hi:.4f}], top-1 "
                      f"{validation['top1_agreement']:.3f}" + (
                          "" if rec.predicted_kld is None
                          else f"; predicted {rec.predicted_kld:.4f}"), highlight=False)
    for note in rec.notes:
        console.print(f"note: {note}", highlight=False)
