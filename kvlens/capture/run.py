"""``kvlens capture``: run a causal LM on text and stream per-layer Q/K/V into HDF5.

For every selected layer and each sample the registered attention function (see ``kvlens.model.hooks``)
receives the post-RoPE q ``[B, Hq, T, D]`` and k, v ``[B, Hkv, T, D]`` exactly as the model's
attention consumes them (before any GQA repeat). Pre-RoPE q, k are recovered by inverting RoPE
with the exact ``(cos, sin)`` the layer was called with (float64; this also gives the right
tensor for QK-norm models, where the norm sits between projection and RoPE). Each sample is
written to disk as it is produced, so peak memory does not grow with the number of samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlens import __version__
from kvlens.capture.store import CaptureMeta, CaptureWriter, LayerAttrs
from kvlens.errors import ModelLoadError, NumericalError
from kvlens.model.architecture import describe
from kvlens.model.header import read_header
from kvlens.model.hooks import attention_override, rope_inputs
from kvlens.model.load import check_load_options, load_model
from kvlens.model.placement import input_device, weights_by_device
from kvlens.rope import detect_layout, invert_rope
from kvlens.text.corpus import load_text, token_windows
from kvlens.text.selection import parse_index_spec

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
    model, tokenizer, source = load_model(options.model, dtype=options.compute_dtype,
                                          device=options.device, device_map=options.device_map,
                                          max_memory=options.max_memory,
                                          offload_folder=options.offload_folder)
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
    source, _ = check_load_options(options.model, dtype=options.compute_dtype,
                                   device=options.device, device_map=options.device_map,
                                   max_memory=options.max_memory,
                                   offload_folder=options.offload_folder)
    check_layer_spec(options.layers, read_header(source).num_layers)
    return text


def check_layer_spec(spec: str | None, num_layers: int | None) -> None:
    """``--layers`` before the model loads: its syntax always, its indices against
    ``num_layers`` where the model's files declare it (``kvlens.model.header``)."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return
    parse_index_spec(spec, num_layers if num_layers is not None else _NO_LIMIT)


_NO_LIMIT = 2**62  # the syntax alone: any index >= 0


def capture_model(model, windows, output: str | Path, *, layers: str | list[int] | None = None,
                  storage_dtype: str = "float16", compression: str = "none",
                  overwrite: bool = False, model_name: str = "", model_source: str = "",
                  text_source: str = "", progress: ProgressFn | None = None) -> CaptureSummary:
    """Capture ``model`` on token windows ``[S, T]`` into ``output`` (library entry point)."""
    import torch
    import transformers

    start = time.perf_counter()
    info = describe(model)
    layer_list = layers if isinstance(layers, list) else parse_index_spec(layers, info.num_layers)
    s_count, t_count = int(windows.shape[0]), int(windows.shape[1])
    compute_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    meta = CaptureMeta(
        model=model_name or getattr(model.config, "_name_or_path", "") or info.architecture,
        architecture=info.architecture, model_type=info.model_type,
        num_layers=info.num_layers, num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim,
        has_rope=info.declares_rope, rope=info.rope, rope_layout="pending", rotary_dim=0,
        compute_dtype=compute_dtype, storage_dtype=storage_dtype, num_samples=s_count,
        num_tokens=t_count, layers=tuple(layer_list), model_source=model_source,
        text_source=text_source, kvlens_version=__version__,
        extra={"transformers_version": str(transformers.__version__),
               "torch_version": str(torch.__version__),
               # the model's size, for recommend's cost prediction (kvlens.recommend.cost)
               "num_parameters": int(sum(p.numel() for p in model.parameters())),
               "vocab_size": int(model.get_output_embeddings().weight.shape[0]
                                 if model.get_output_embeddings() is not None else 0),
               "hidden_size": int(model.get_output_embeddings().weight.shape[1]
                                  if model.get_output_embeddings() is not None else 0)},
    )
    sink = _LayerSink(set(layer_list), info)
    device = input_device(model)
    writer = CaptureWriter(output, overwrite=overwrite, storage_dtype=storage_dtype,
                           compression=compression)
    with writer, rope_inputs(model) as tables, \
            attention_override(model, lambda orig: sink.attention_fn(orig, tables)), \
            torch.no_grad():
        writer.begin(meta)
        sink.writer = writer
        for s in range(s_count):
            sink.sample = s
            model(input_ids=windows[s:s + 1].to(device), use_cache=False)
            missing = set(layer_list) - sink.seen
            if missing:
                raise ModelLoadError(
                    f"Unsupported model {info.architecture}: layers {sorted(missing)} never "
                    "called the attention interface, so kvlens cannot capture them.")
            if s == 0:
                sink.finalize_layout(writer)
            writer.write_tokens(s, windows[s].cpu().numpy().astype("int32"))
            sink.seen.clear()
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
        self.seen: set[int] = set()
        self.rope_layout = "pending"
        self.rotary_dim = 0
        self.notes: list[str] = []
        self._layer_attrs: dict[int, Any] = {}
        self.devices: dict[int, str] = {}  # layer -> device its tensors arrived on

    def attention_fn(self, original: Callable, tables: dict[int, tuple]) -> Callable:
        def fn(module, query, key, value, attention_mask, **kwargs):
            out = original(module, query, key, value, attention_mask, **kwargs)
            idx = module.layer_idx
            if idx in self.layers:
                pe = tables.get(idx)  # (cos, sin, position_ids)
                self._record(module, idx, query, key, value, pe[:2] if pe else None, kwargs)
            return out

        return fn

    def _record(self, module, idx, query, key, value, pe, kwargs) -> None:

        tq = query.shape[-2]
        post = {"q": query[0], "k": key[0, :, -tq:], "v": value[0, :, -tq:]}
        pre = self._pre_rope(idx, post, pe)
        tensors = {**post, **pre}
        for name, t in tensors.items():
            if not bool(t.isfinite().all()):
                raise NumericalError(
                    f"Layer {idx} produced NaN/Inf in {name} (sample {self.sample}). The model "
                    "or its compute dtype is numerically unstable here; try --dtype float32.")
        for name, t in tensors.items():
            self.writer.write(idx, name, self.sample, t)
        self.devices[idx] = str(query.device)
        if idx not in self._layer_attrs:
            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = getattr(module, "scaling", None) or self.info.head_dim ** -0.5
            self._layer_attrs[idx] = LayerAttrs(
                idx, float(scaling), int(kwargs.get("sliding_window") or 0),
                float(kwargs.get("softcap") or 0.0))
        self.seen.add(idx)

    def _pre_rope(self, idx, post, pe) -> dict[str, Any]:

        if pe is None:
            if self.info.declares_rope:
                raise ModelLoadError(
                    f"Unsupported model {self.info.architecture}: its config declares RoPE but "
                    f"layer {idx} received no position_embeddings=(cos, sin), so pre-RoPE "
                    "tensors cannot be recovered exactly.")
            self._set_layout("none", 0)
            return {"q_pre": post["q"], "k_pre": post["k"]}
        cos, sin = pe
        layout = detect_layout(cos)
        self._set_layout(layout, int(cos.shape[-1]))
        cos, sin = cos[:1], sin[:1]
        return {"q_pre": invert_rope(post["q"][None], cos, sin, layout)[0],
                "k_pre": invert_rope(post["k"][None], cos, sin, layout)[0]}

    def _set_layout(self, layout: str, rotary_dim: int) -> None:
        if self.rope_layout == "pending":
            self.rope_layout, self.rotary_dim = layout, rotary_dim
            if layout == "none":
                self.notes.append("model has no RoPE: q_pre/k_pre equal q/k")
            elif rotary_dim < self.info.head_dim:
                self.notes.append(f"partial rotary: first {rotary_dim} of "
                                  f"{self.info.head_dim} channels rotate")

    def finalize_layout(self, writer) -> None:
        writer.set_attr("rope_layout", self.rope_layout)
        writer.set_attr("rotary_dim", self.rotary_dim)
        writer.set_attr("has_rope", self.rope_layout != "none")
        for la in self._layer_attrs.values():
            writer.set_layer_attrs(la)
