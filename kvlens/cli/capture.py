"""``kvlens capture``: Q/K/V from a real model into a versioned HDF5 file."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli.app import app
from kvlens.cli.common import (
    INPUT,
    OUTPUT,
    console,
    err_console,
    escape,
    output_errors,
    print_json,
    progress_bar,
    run_library_call,
    shared_option,
    write_artifact_output,
)
from kvlens.units import format_bytes, format_bytes_by_device


@app.command()
def capture(
    text: Path = typer.Option(None, "--text", rich_help_panel=INPUT,
                              help="UTF-8 text file (default: built-in corpus)."),
    samples: int = typer.Option(4, "--samples", "-s", min=1, rich_help_panel=INPUT,
                                help="Number of token windows (samples)."),
    tokens: int = typer.Option(512, "--tokens", "-t", min=2, rich_help_panel=INPUT,
                               help="Tokens per window."),
    layers: str = typer.Option(None, "--layers", rich_help_panel=INPUT,
                               help="Layers to capture, e.g. 0,4,8-11 (default: all); "
                                    "checked against the model's layer count before it "
                                    "loads."),
    model: str = shared_option("model"),
    dtype: str = shared_option("dtype"),
    device: str = shared_option("device"),
    device_map: str = shared_option("device_map"),
    max_memory: str = shared_option("max_memory"),
    offload_folder: Path = shared_option("offload_folder"),
    output: Path = typer.Option(Path("run.h5"), "--output", "-o", rich_help_panel=OUTPUT,
                                help="HDF5 file to write (and RUN.capture.json beside it, for "
                                     "`kvlens report`)."),
    storage_dtype: str = typer.Option("float16", "--storage-dtype", rich_help_panel=OUTPUT,
                                      help="float16, float32 or bfloat16 (stored losslessly)."),
    compression: str = typer.Option("none", "--compression", rich_help_panel=OUTPUT,
                                    help="none, gzip or lzf."),
    overwrite: bool = shared_option("overwrite"),
    as_json: bool = shared_option("as_json", "a summary"),
) -> None:
    """Run a causal LM on text and store per-layer, per-head Q, K, V (pre and post RoPE).

    Examples:

      kvlens capture -o out/run.h5
      kvlens capture --layers 0-3 --samples 2 --tokens 256 -o small.h5
      kvlens capture --model my-model.gguf -o run.h5
    """
    from kvlens.capture.run import CaptureOptions, check_capture, run_capture
    from kvlens.capture.store import open_capture
    from kvlens.report.artifacts import capture_doc, capture_doc_path, check_output_file

    def prepare() -> CaptureOptions:
        # Everything that can be checked without the model, before it loads: the outputs,
        # the text, the model's options, --layers against the layer count its files declare.
        check_output_file(output, "--output", overwrite, example="run.h5")
        check_output_file(capture_doc_path(output), "--output", overwrite)
        opts = CaptureOptions(model=model, text=str(text) if text else None, samples=samples,
                              tokens=tokens, layers=layers, storage_dtype=storage_dtype,
                              compute_dtype=dtype, compression=compression, device=device,
                              device_map=device_map, max_memory=max_memory,
                              offload_folder=str(offload_folder) if offload_folder else None,
                              overwrite=overwrite)
        check_capture(opts, output)
        return opts

    opts = run_library_call(prepare)
    err_console.print(f"Capturing {samples} x {tokens} tokens from "
                      f"{escape(model or 'SmolLM2-135M-Instruct (embedded)')} ...")
    def work():
        # the model's own files are read through load_model, which names its failures; an
        # OSError left here is the capture file's write (a full disk, a vanished folder)
        with output_errors(f"the capture {output}"):
            summary = run_capture(opts, output, progress=update)
        with open_capture(output) as cap:  # RUN.capture.json beside it, for `kvlens report`
            doc = capture_doc(summary.to_dict(), cap.meta)
        write_artifact_output("capture", doc, capture_doc_path(output))
        return summary

    with progress_bar("capture") as update:
        summary = run_library_call(work)
    if as_json:
        print_json(summary.to_dict())
        return
    _render(summary)


def _render(s) -> None:
    from rich.table import Table

    from kvlens.text.selection import format_index_spec as _ranges

    table = Table(title=f"Capture written: {escape(str(s.path))}", show_header=False)
    table.add_row("model", escape(f"{s.model} ({s.architecture})"))
    table.add_row("layers", f"{_ranges(s.layers)} ({len(s.layers)} layers)")
    table.add_row("heads", f"{s.num_attention_heads} query / {s.num_key_value_heads} KV, "
                           f"head_dim {s.head_dim}")
    table.add_row("tokens", f"{s.samples} samples x {s.tokens} tokens")
    table.add_row("RoPE", s.rope_layout)
    table.add_row("storage", s.storage_dtype)
    table.add_row("file size", format_bytes(s.file_bytes))
    table.add_row("time", f"{s.seconds:.1f} s")
    table.add_row("weights", format_bytes_by_device(s.weights_by_device))
    by_dev: dict[str, list[int]] = {}
    for layer, dev in zip(s.layers, s.layer_devices):
        by_dev.setdefault(dev, []).append(layer)
    table.add_row("layers ran on", "; ".join(f"{dev}: {_ranges(ls)}" for dev, ls in by_dev.items()))
    for note in s.notes:
        table.add_row("note", escape(note))
    console.print(table)
