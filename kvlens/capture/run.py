"""``kvlens capture``: run a causal LM on text and stream per-layer Q/K/V into HDF5.

The attention function kvlens registers (``kvlens.model.hooks``) receives post-RoPE q, k, v as
the model's attention consumes them; pre-RoPE q, k are recovered by inverting RoPE (float64)
with the layer's own tables, normalised by ``kvlens.model.rotary``. Each RoPE layer's tables
for positions ``0..T-1`` are written once: every window starts at position 0 (checked). Each
sample is written as it is produced, so peak memory does not grow with the sample count
(``docs/reference/capture-format.md``: how the tensors are obtained).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlens import __version__
from kvlens.capture.store import CaptureMeta, CaptureWriter, LayerAttrs
from kvlens.errors import InputError, ModelLoadError, NumericalError
from kvlens.model.architecture import describe
from kvlens.model.header import read_header
from kvlens.model.hooks import attention_override, check_attention_shapes, rope_inputs
from kvlens.model.load import check_load_options, load_model, model_dtype
from kvlens.model.placement import input_device, weights_by_device
from kvlens.rope import FORMS, RopeTables
from kvlens.text.corpus import load_text, token_windows
from kvlens.text.selection import format_index_spec, parse_index_spec

ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class CaptureOptions:
    """What to capture and how to store it (CLI flags map one-to-one)."""

    model: str | None = None
    text: str | None = None
    samples: int = 4
    tokens: int = 512
    layers: str | None = None
    storage_dtype: str = "float16"
    compute_dtype: str = "float32"
    compression: str = "none"
    device: str = "auto"
    device_map: str | None = None  # auto, balanced, sequential, or a JSON map (kvlens.model.placement)
    max_memory: str | None = None  # e.g. "0=20GiB,cpu=60GiB,disk=200GiB"
    offload_folder: str | None = None  # where disk-offloaded weights may go
    overwrite: bool = False


@dataclass
class CaptureSummary:
    path: str
    model: str
    architecture: str
    layers: list[int]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    samples: int
    tokens: int
    has_rope: bool
    rope_layout: str
    storage_dtype: str
    file_bytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    #: bytes of model weights per device ("disk" = offloaded to the offload folder)
    weights_by_device: dict[str, int] = field(default_factory=dict)
    #: per captured layer, the device its q/k/v were computed and captured on
    layer_devices: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_capture(options: CaptureOptions, output: str | Path,
                progress: ProgressFn | None = None) -> CaptureSummary:
    """Load the model and text named in ``options`` and write a capture file to ``output``."""
    text, text_source = check_capture(options, output)
    model, tokenizer, source = load_model(options.model, **_load_options(options))
    windows = token_windows(tokenizer, text, options.samples, options.tokens, text_source)
    return capture_model(model, windows, output, layers=options.layers,
                         storage_dtype=options.storage_dtype, compression=options.compression,
                         overwrite=options.overwrite, model_name=source.display_name,
                         model_source=f"{source.kind}:{source.location}"
                         + (f"/{source.gguf_file}" if source.gguf_file else ""),
                         text_source=text_source, progress=progress)


def check_capture(options: CaptureOptions, output: str | Path) -> tuple[str, str]:
    """Every check ``run_capture`` can make before the model loads: the output, the text
    (returned as ``(text, source)``), the model's load options and ``--layers``."""
    CaptureWriter(output, overwrite=options.overwrite, storage_dtype=options.storage_dtype,
                  compression=options.compression)
    text = load_text(options.text)
    source, _ = check_load_options(options.model, **_load_options(options))
    # --layers against the layers the model's files declare (num_layers 0: they do not say)
    shape, spec = read_header(source).shape, options.layers
    if shape.num_layers:
        capture_layers(spec, shape)
    elif spec is not None and spec.strip().lower() not in ("", "all"):
        parse_index_spec(spec, 2**62)  # the syntax alone: any index >= 0
    return text


def _load_options(o: CaptureOptions) -> dict[str, Any]:
    """``load_model``'s keywords from the capture options."""
    return {"dtype": o.compute_dtype, "device": o.device, "device_map": o.device_map,
            "max_memory": o.max_memory, "offload_folder": o.offload_folder}


def capture_layers(layers: str | list[int] | None, info) -> list[int]:
    """The layers to capture: ``layers`` (a ``--layers`` spec or a list of model indices),
    by default every layer with a KV cache (``info``: ``kvlens.model.shape.ModelShape``)."""
    if layers is None or (isinstance(layers, str) and layers.strip().lower() in ("", "all")):
        return list(info.attention_layers)
    chosen = layers if isinstance(layers, list) else parse_index_spec(layers, info.num_layers)
    bad = [i for i in chosen if i not in info.attention_layers]
    if bad:
        raise InputError(f"{{layers}} {format_index_spec(bad)}: these layers hold no KV cache "
                         "(a hybrid model's linear-attention or SSM layers keep a fixed-size "
                         "state instead); layers with a KV cache: "
                         f"{format_index_spec(info.attention_layers)}.")
    return chosen


def capture_model(model, windows, output: str | Path, *, layers: str | list[int] | None = None,
                  storage_dtype: str = "float16", compression: str = "none",
                  overwrite: bool = False, model_name: str = "", model_source: str = "",
                  text_source: str = "", progress: ProgressFn | None = None) -> CaptureSummary:
    """Capture ``model`` on token windows ``[S, T]`` into ``output`` (library entry point)."""
    import torch
    import transformers

    start = time.perf_counter()
    info = describe(model)
    layer_list = capture_layers(layers, info)
    s_count, t_count = int(windows.shape[0]), int(windows.shape[1])
    device = input_device(model)
    # the shapes the model really uses, before any file is written
    check_attention_shapes(model, info, windows[:1, :min(t_count, 8)].to(device))
    head = model.get_output_embeddings()
    vocab, hidden = head.weight.shape if head is not None else (0, 0)
    meta = CaptureMeta(
        model=model_name or getattr(model.config, "_name_or_path", "") or info.architecture,
        shape=info, rope_layout="pending", rotary_dim=0,
        compute_dtype=model_dtype(model), storage_dtype=storage_dtype, num_samples=s_count,
        num_tokens=t_count, layers=tuple(layer_list), model_source=model_source,
        text_source=text_source, kvlens_version=__version__,
        extra={"transformers_version": str(transformers.__version__),
               "torch_version": str(torch.__version__),
               # the model's size: the file describes the model it came from
               "num_parameters": int(sum(p.numel() for p in model.parameters())),
               "vocab_size": int(vocab), "hidden_size": int(hidden)},
    )
    sink = _LayerSink(set(layer_list), info)
    writer = CaptureWriter(output, overwrite=overwrite, storage_dtype=storage_dtype,
                           compression=compression)
    with writer, rope_inputs(model) as tables, \
            attention_override(model, lambda orig: sink.attention_fn(orig, tables)), \
            torch.no_grad():
        writer.begin(meta)
        sink.writer = writer
        for s in range(s_count):
            sink.sample = s
            # every captured layer calls the attention interface (check_attention_shapes said so)
            model(input_ids=windows[s:s + 1].to(device), use_cache=False)
            if s == 0:
                sink.finalize_layout(writer)
            writer.write_tokens(s, windows[s].cpu().numpy().astype("int32"))
            if progress:
                progress(s + 1, s_count, f"sample {s + 1}/{s_count}")
        writer.set_attr("notes", "; ".join(sink.notes))
        path = writer.finish()
    return CaptureSummary(
        path=str(path), model=meta.model, architecture=info.architecture, layers=layer_list,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim,
        samples=s_count, tokens=t_count, has_rope=sink.rope_layout != "none",
        rope_layout=sink.rope_layout, storage_dtype=storage_dtype,
        file_bytes=path.stat().st_size, seconds=time.perf_counter() - start, notes=sink.notes,
        weights_by_device=weights_by_device(model),
        layer_devices=[sink.devices[i] for i in layer_list],
    )


class _LayerSink:
    """Receives each layer's q/k/v from the attention function and writes them."""

    def __init__(self, layers: set[int], info):
        self.layers = layers
        self.info = info
        self.writer = None
        self.sample = 0
        self.rope_layout = "pending"
        self.rotary_dim = 0
        self.rope_inputs = None  # set by attention_fn: kvlens.model.rotary.RopeInputs
        self._rope: dict[int, Any] = {}  # layer -> its RopeTables at sample 0 (None: NoPE)
        self.notes: list[str] = []
        self._layer_attrs: dict[int, Any] = {}
        self.devices: dict[int, str] = {}  # layer -> device its tensors arrived on

    def attention_fn(self, original: Callable, tables: dict[int, tuple]) -> Callable:
        self.rope_inputs = tables  # _pre_rope normalises a layer's RoPE inputs
        def fn(module, query, key, value, attention_mask, **kwargs):
            out = original(module, query, key, value, attention_mask, **kwargs)
            if module.layer_idx in self.layers:
                self._record(module, module.layer_idx, query, key, value, kwargs)
            return out

        return fn

    def _record(self, module, idx, query, key, value, kwargs) -> None:
        tq = query.shape[-2]
        post = {"q": query[0], "k": key[0, :, -tq:], "v": value[0, :, -tq:]}
        pre = self._pre_rope(idx, post)
        for name, t in {**post, **pre}.items():  # a failure deletes the partial file
            if not bool(t.isfinite().all()):
                raise NumericalError(
                    f"Layer {idx} produced NaN/Inf in {name} (sample {self.sample}). The model "
                    "or its compute dtype is numerically unstable here; try {dtype} float32.")
            self.writer.write(idx, name, self.sample, t)
        self.devices[idx] = str(query.device)
        if idx not in self._layer_attrs:
            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = getattr(module, "scaling", None) or self.info.head_dim ** -0.5
            sinks = kwargs.get("s_aux")  # gpt-oss's learned sink logits, one per query head
            if sinks is None:
                sinks = getattr(module, "sinks", None)
            self._layer_attrs[idx] = LayerAttrs(
                idx, float(scaling), self._window(idx, kwargs, int(query.shape[-2])),
                float(kwargs.get("softcap") or 0.0),
                tuple(sinks.detach().float().reshape(-1).tolist()) if hasattr(sinks, "detach")
                else ())

    def _window(self, idx: int, kwargs: dict, tokens: int) -> int:
        """The layer's sliding window (0 = none); a chunked-attention layer (Llama 4) is
        recorded as a sliding window of one chunk, what its cache keeps: the analysis' masks
        equal chunked attention's while a sample is at most one chunk long (noted otherwise)."""
        window = int(kwargs.get("sliding_window") or 0)
        if self.info.kind(idx) == "chunked":
            window = int(self.info.window(idx))
            note = (f"chunked attention (chunks of {window} tokens) analysed as a sliding window "
                    f"of {window}: exact only up to {window} tokens per sample")
            if tokens > window and note not in self.notes:
                self.notes.append(note)
        return window

    def _pre_rope(self, idx, post) -> dict[str, Any]:
        """``q_pre``, ``k_pre`` ``[H, T, D]``: RoPE inverted with the layer's own tables (a NoPE
        layer keeps its tensors)."""
        tables = None
        if idx in self.rope_inputs:
            tables = self.rope_inputs.tables(idx, int(post["q"].shape[-1]))
        elif self.info.has_rope:
            raise ModelLoadError(
                f"Unsupported model {self.info.architecture}: its config declares RoPE but "
                f"layer {idx} received no position_embeddings (cos, sin) or freqs_cis, so "
                "pre-RoPE tensors cannot be recovered exactly.")
        if tables is not None:
            tables = RopeTables(tables.layout, tables.cos[:1], tables.sin[:1])
            self._check_positions(idx, tables, int(post["q"].shape[-2]))
        self._set_layout(idx, tables)
        if tables is None:
            return {"q_pre": post["q"], "k_pre": post["k"]}
        return {"q_pre": tables.invert(post["q"][None])[0],
                "k_pre": tables.invert(post["k"][None])[0]}

    def _check_positions(self, idx: int, tables, t: int) -> None:
        """The file keeps one RoPE table per layer, for positions ``0..T-1``: refuse a call at
        other positions (where the model passes its ``position_ids``) or of another length."""
        import torch

        pos = self.rope_inputs[idx][2]
        if tables.cos.shape[-2] != t or (pos is not None and not torch.equal(
                pos.reshape(-1, pos.shape[-1])[0].cpu(), torch.arange(t))):
            raise ModelLoadError(
                f"Unsupported model {self.info.architecture}: layer {idx} was called at "
                f"positions other than 0..{t - 1} for a window of {t} tokens; kvlens capture "
                "stores one RoPE table per layer for those positions.")

    def _set_layout(self, idx: int, tables) -> None:
        """Keep layer ``idx``'s RoPE (``None``: none) from its first sample, check later samples
        use the same tables and every RoPE layer one layout and rotary width (file attributes)."""
        import torch

        if idx in self._rope:
            kept = self._rope[idx]
            same = (kept is None and tables is None) or (
                kept is not None and tables is not None and kept.layout == tables.layout
                and torch.equal(kept.cos, tables.cos) and torch.equal(kept.sin, tables.sin))
            if not same:
                raise ModelLoadError(
                    f"Unsupported model {self.info.architecture}: layer {idx}'s RoPE tables "
                    f"differ between samples at the same positions (sample {self.sample}); "
                    "kvlens capture stores one table per layer.")
            return
        self._rope[idx] = tables
        if tables is None:
            return
        if self.rope_layout == "pending":
            self.rope_layout, self.rotary_dim = tables.layout, tables.rotary_dim
        elif (self.rope_layout, self.rotary_dim) != (tables.layout, tables.rotary_dim):
            raise ModelLoadError(
                f"Unsupported model {self.info.architecture}: layer {idx} applies RoPE "
                f"{tables.layout} to {tables.rotary_dim} channels, other layers {self.rope_layout}"
                f" to {self.rotary_dim}; a capture file has one RoPE layout and width.")

    def _rope_notes(self) -> list[str]:
        nope = sorted(i for i, t in self._rope.items() if t is None)
        if self.rope_layout == "none":
            if any(i in self.rope_inputs for i in nope):
                return [f"layers {nope} apply no RoPE (NoPE): q_pre/k_pre equal q/k"]
            return ["model has no RoPE: q_pre/k_pre equal q/k"]
        notes = [f"RoPE given as {f.name}, stored as {self.rope_layout} tables"
                 for f in self.rope_inputs.forms
                 if f not in FORMS[:2]]  # the two plain forms need no note
        if nope:
            notes.append(f"layers {nope} apply no RoPE (NoPE): q_pre/k_pre equal q/k there")
        if self.rotary_dim < self.info.head_dim:
            notes.append(f"partial rotary: first {self.rotary_dim} of "
                         f"{self.info.head_dim} channels rotate")
        return notes

    def finalize_layout(self, writer) -> None:
        if self.rope_layout == "pending":
            self.rope_layout = "none"
        self.notes.extend(self._rope_notes())
        writer.set_attr("rope_layout", self.rope_layout)
        writer.set_attr("rotary_dim", self.rotary_dim)
        writer.set_attr("has_rope", self.rope_layout != "none")
        if self.rope_layout != "none":  # each layer's tables at positions 0..T-1, [T, R]
            for idx, tables in sorted(self._rope.items()):
                writer.write_rope(idx, self.rope_layout,
                                  *((tables.cos[0], tables.sin[0]) if tables else (None, None)))
        for la in self._layer_attrs.values():
            writer.set_layer_attrs(la)
