"""``kvlens recommend --target ENGINE``: run ``kvlens.deploy.targets`` and render its answer."""

from __future__ import annotations

from pathlib import Path

from kvlens.cli.common import (
    console,
    err_console,
    escape,
    print_json,
    progress_bar,
    run_library_call,
    write_config_doc,
    write_output,
    write_text_output,
)


def run_target(capture: Path, fields: dict, *, place: dict, output, validate: bool,
               eval_tokens, as_json: bool) -> None:
    """``fields``: the ``TargetOptions`` fields given (the rest are its defaults); ``place``:
    ``device_map``, ``max_memory``, ``offload_folder`` for the model that ``--max-kld`` and
    ``--validate`` load (the command checked every option before)."""
    from dataclasses import replace

    from kvlens.deploy.targets import TargetOptions, recommend_target
    from kvlens.deploy.targets import validate as run_validation

    def prepare():
        given = {"eval_tokens": eval_tokens} if eval_tokens is not None else {}
        return TargetOptions(**fields, **given)

    opts = run_library_call(prepare)
    bundle: list = []

    def load():
        """The model (once), before any measurement: a model that cannot load fails first."""
        if not bundle:
            from kvlens.capture.store import open_capture
            from kvlens.errors import InputError
            from kvlens.evaluation.kld import max_positions
            from kvlens.model.load import load_model
            from kvlens.recommend import model_spec_from_capture

            with open_capture(capture) as cap:
                spec = opts.model or model_spec_from_capture(cap.meta)
            if spec is None:
                raise InputError(f"{capture} does not say which model it came from; pass "
                                 "--model.")
            err_console.print(f"Loading {escape(spec)} ...")
            mdl, tok, source = load_model(spec, **place)
            bundle.extend((mdl, tok))
            if eval_tokens is None:  # the default, capped by the model's context
                bundle.append(min(opts.eval_tokens, max_positions(mdl) or opts.eval_tokens))
            else:
                bundle.append(eval_tokens)
            bundle.append(source)
        return (bundle[0], bundle[1], bundle[3])

    max_kld = opts.max_kld
    if max_kld is not None or validate:
        run_library_call(load)
        opts = replace(opts, eval_tokens=bundle[2])
    with progress_bar("measuring engine cache types") as update:
        rec = run_library_call(lambda: recommend_target(
            capture, opts, progress=update, log=lambda m: err_console.print(f"  {escape(m)}"),
            model_bundle=load() if max_kld is not None else None))
    written = []
    if output is not None:
        from kvlens.config import save_config

        def write_files():
            write_output(output, lambda tmp: save_config(rec.chosen.config, tmp))
            written.append(str(output))
            for name, text in rec.files.items():
                path = output.parent / name
                write_text_output(path, text)
                written.append(str(path))

        run_library_call(write_files)
        for w in written:
            err_console.print(f"written: {escape(w)}")
    validation = None
    if validate:
        validation = run_library_call(lambda: run_validation(
            rec, load(), opts.eval_tokens, lambda m: err_console.print(f"  {escape(m)}")))
    doc = rec.to_dict()
    doc["files"] = rec.files
    if validation is not None:
        doc["validation"] = validation
    if output is not None:
        data = run_library_call(lambda: write_config_doc("deploy", doc, output))
        err_console.print(f"results for `kvlens report` written: {escape(str(data))}")
    if as_json:
        print_json(doc)
        return
    _render(rec, validation)


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
                          f"{a['mean_kld']:.4f} [{a['ci95'][0]:.4f}, {a['ci95'][1]:.4f}]",
                          highlight=False)
    if validation is not None:
        lo, hi = validation["ci95"]
        console.print(f"validation ({escape(c.setting)}, held-out text): measured KLD "
                      f"{validation['mean_kld']:.4f} [{lo:.4f}, {hi:.4f}], top-1 "
                      f"{validation['top1_agreement']:.3f}" + (
                          "" if rec.predicted_kld is None
                          else f"; predicted {rec.predicted_kld:.4f}"), highlight=False)
    for note in rec.notes:
        console.print(f"note: {escape(note)}", highlight=False)
