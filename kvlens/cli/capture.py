"""``kvlens capture``: Q/K/V from a real model into a versioned HDF5 file."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli import app
from kvlens.cli.common import (
    console,
    device_map_option,
    err_console,
    format_bytes_by_device,
    max_memory_option,
    offload_folder_option,
    print_json,
    progress_bar,
    run_library_call,
)


@app.command()
def capture(
    output: Path = typer.Option(Path("run.h5"), "--output", "-o", help="HDF5 file to write."),
    model: str = typer.Option(None, "--model", "-m",
                              help="Model: omit for the embedded SmolLM2-135M-Instruct, or a "
                                   "local HF directory, a .gguf file, or a hub id."),
    text: Path = typer.Option(None, "--text", help="UTF-8 text file (default: built-in corpus)."),
    samples: int = typer.Option(4, "--samples", "-s", help="Number of token windows."),
    tokens: int = typer.Option(512, "--tokens", "-t", help="Tokens per window."),
    layers: str = typer.Option(None, "--layers", help="Layers to capture, e.g. 0,4,8-11 "
                                                      "(default: all)."),
    storage_dtype: str = typer.Option("float16", "--storage-dtype",
                                      help="float16, float32 or bfloat16 (stored losslessly)."),
    dtype: str = typer.Option("float32", "--dtype", help="Compute dtype of the model."),
    compression: str = typer.Option("none", "--compression", help="none, gzip or lzf."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    device_map: str = device_map_option(),
    max_memory: str = max_memory_option(),
    offload_folder: Path = offload_folder_option(),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    """Run a causal LM on text and store per-layer, per-head Q, K, V (pre and post RoPE)."""
    from kvlens.capture.run import CaptureOptions, run_capture

    opts = CaptureOptions(model=model, text=str(text) if text else None, samples=samples,
                          tokens=tokens, layers=layers, storage_dtype=storage_dtype,
                          compute_dtype=dtype, compression=compression, device=device,
                          device_map=device_map, max_memory=max_memory,
                          offload_folder=str(offload_folder) if offload_folder else None,
                          overwrite=overwrite)
    err_console.print(f"Capturing {samples} x {tokens} tokens from "
                      f"{model or 'SmolLM2-135M-Instruct (embedded)'} ...")
    with progress_bar("capture") as update:
        summary = run_library_call(lambda: run_capture(opts, output, progress=update))
    _write_report_json(summary, output)
    if as_json:
        print_json(summary.to_dict())
        return
    _render(summary)


def _write_report_json(summary, output: Path) -> None:
    """``RUN.capture.json`` beside the capture: what ``kvlens report`` shows about it."""
    from kvlens.capture.store import open_capture
    from kvlens.report.artifacts import capture_doc, capture_doc_path, write_artifact

    with open_capture(output) as cap:
        doc = capture_doc(summary.to_dict(), cap.meta)
    write_artifact("capture", doc, capture_doc_path(output))


def _render(s) -> None:
    from rich.table import Table

    from kvlens.text.selection import format_index_spec as _ranges

    table = Table(title=f"Capture written: {s.path}", show_header=False)
    table.add_row("model", f"{s.model} ({s.architecture})")
    table.add_row("layers", f"{_ranges(s.layers)} ({len(s.layers)} layers)")
    table.add_row("heads", f"{s.num_attention_heads} query / {s.num_key_value_heads} KV, "
                           f"head_dim {s.head_dim}")
    table.add_row("tokens", f"{s.samples} samples x {s.tokens} tokens")
    table.add_row("RoPE", s.rope_layout)
    table.add_row("storage", s.storage_dtype)
    table.add_row("file size", f"{s.file_bytes / 2**20:.1f} MiB")
    table.add_row("time", f"{s.seconds:.1f} s")
    table.add_row("weights", format_bytes_by_device(s.weights_by_device))
    by_dev: dict[str, list[int]] = {}
    for layer, dev in zip(s.layers, s.layer_devices):
        by_dev.setdefault(dev, []).append(layer)
    table.add_row("layers ran on", "; ".join(f"{dev}: {_ranges(ls)}" for dev, ls in by_dev.items()))
    for note in s.notes:
        table.add_row("note", note)
    console.print(table)
