"""Helpers shared by several test modules: seeded random tensors, a relative error, a synthetic
capture writer, and the plain-torch references the cache tests compare against.

Planted data sets (the tensors whose right answers a test states) stay in the test module that
explains them; what is generic lives here, once. Fixtures are in conftest.py, tiny models and
the tiny tokenizer in tiny_models.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvlens.cache import compressed_attention
from kvlens.cache.cache import held_bytes_by_device
from kvlens.cache.torch_read import packed_attention
from kvlens.capture.store import TENSORS, CaptureMeta, CaptureWriter, LayerAttrs
from kvlens.config import preset
from kvlens.model.hooks import cache_argument_name
from kvlens.model.shape import ModelShape
from kvlens.quant import QTensor, dequantize, quantize
from kvlens.recommend.extension import Twin

SCALING = 0.25  # the attention scaling make_capture records for every layer


def rand(*shape, seed=0):
    """Standard normal tensor from its own seeded generator."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    """||a - b|| / ||a|| as a float."""
    return float((a - b).norm() / a.norm())


def make_capture(path, q, k, v, *, k_pre=None, q_pre=None, rope_theta=None, layers=1,
                 record_theta=True, per_layer=None):
    """Synthetic float32 capture; the same tensors in every layer (``record_theta=False``: RoPE
    without its theta in the metadata, as Gemma3 captures have) unless ``per_layer``
    ``{layer: {"k": ..., ...}}`` replaces some of a layer's tensors."""
    rope = {} if rope_theta is None or not record_theta else \
        {"rope_theta": rope_theta, "rope_type": "default"}
    meta = CaptureMeta(
        model="synthetic",
        shape=ModelShape(layers, q.shape[1], k.shape[1], q.shape[-1], architecture="Synthetic",
                         model_type="synthetic", has_rope=rope_theta is not None, rope=rope),
        rope_layout="half" if rope_theta is not None else "none",
        rotary_dim=q.shape[-1] if rope_theta is not None else 0,
        compute_dtype="float32",
        storage_dtype="float32",
        num_samples=q.shape[0],
        num_tokens=q.shape[2],
        layers=tuple(range(layers)),
    )
    data = {
        "q": q,
        "k": k,
        "v": v,
        "q_pre": q if q_pre is None else q_pre,
        "k_pre": k if k_pre is None else k_pre,
    }
    attrs = {i: LayerAttrs(i, SCALING, 0, 0.0) for i in range(layers)}
    per_layer = per_layer or {}
    return write_capture(path, meta, {i: {**data, **per_layer.get(i, {})} for i in range(layers)},
                         layer_attrs=attrs)


# -- cache references --------------------------------------------------------------------------

def stub_session():
    """The little of a compression session a lone ``CompressedLayer`` reads."""
    return SimpleNamespace(active=True, rope={})


def held_bytes(cache) -> int:
    """Bytes of every tensor storage reachable from ``cache`` (``held_bytes_by_device``, summed)."""
    return sum(held_bytes_by_device(cache).values())


def reference_attention(q, keys, values, mask):
    """softmax(q k^T / sqrt(d) + mask) v with the repeat_kv GQA mapping."""
    g = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1)
    v = values.repeat_interleave(g, dim=1)
    s = q.float() @ k.float().transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.float()).transpose(1, 2)


def stored_view(x, spec, f, n_q, window_dtype=torch.float16):
    """What the cache holds: reference quantization per block for the first ``n_q`` tokens,
    the rest as the float16 window (the default ``fp_dtype``; blocks are quantized from it)."""
    x = x.to(window_dtype).float()
    b, h, _, d = x.shape
    blocks = x[:, :, :n_q].reshape(b, h, n_q // f, f, d).transpose(1, 2)
    blocks = blocks.reshape(-1, h, f, d)
    q = quantize(blocks, spec)
    deq = dequantize(QTensor(q.codes, q.scale.half().float(), q.zero.half().float(), spec,
                             q.shape))
    deq = deq.reshape(b, n_q // f, h, f, d).transpose(1, 2).reshape(b, h, n_q, d)
    return torch.cat((deq, x[:, :, n_q:].half().float()), dim=2)


def small_options(**kw):
    """``RecommendOptions`` with the small settings these tests were written for where they do
    not say otherwise: one window (``residual_tokens`` R: ``windows=(R,)``; default 128), 256
    tokens and uniform sensitivity. The library's own defaults are what ``kvlens recommend``
    runs (several windows, layout sensitivity), slower on the synthetic captures here."""
    from kvlens.recommend import RecommendOptions

    r = kw.pop("residual_tokens", None)
    if r is not None:
        kw["windows"] = (r,)
    kw.setdefault("windows", (128,))
    kw.setdefault("tokens", 256)
    kw.setdefault("sensitivity", "uniform")
    return RecommendOptions(**kw)


def decode_one_by_one(layer, q, k, v, scaling, softcap: float = 0.0, sinks=None):
    """Feed a ``CompressedLayer`` one token at a time as generate does (each query right after
    its token): ``(the MiKV set before each query [B, Hkv, T, T] bool, attention outputs
    [B, Hq, T, D])``; ``softcap``/``sinks`` as ``packed_attention`` takes them."""
    b, hkv, t, _ = k.shape
    sets = torch.zeros(b, hkv, t, t, dtype=torch.bool)
    outs = []
    for i in range(t):
        layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
        if layer.has_hp:
            sets[:, :, i].scatter_(-1, layer.hp_pos.long(), True)
        out, colsum = packed_attention(q[:, :, i:i + 1], layer, None, scaling, with_probs=True,
                                       softcap=softcap, sinks=sinks)
        layer.commit(q[:, :, i:i + 1], colsum)
        outs.append(out.transpose(1, 2))
    return sets, torch.cat(outs, dim=2)


def exact_cache_generates_like_the_model(model, ids, max_new_tokens: int) -> bool:
    """Whether greedy generation through kvlens' cache with the ``exact`` preset (nothing
    quantized) gives the tokens transformers' own cache gives."""
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        with compressed_attention(model, preset("exact")) as session:
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 **{cache_argument_name(model): session.new_cache()})
    return torch.equal(ref, out)


def write_capture(path: str | os.PathLike, meta: CaptureMeta, tensors: dict[int, dict[str, Any]],
                  tokens=None, layer_attrs: dict[int, LayerAttrs] | None = None, *,
                  overwrite: bool = False, compression: str = "none") -> Path:
    """Write a complete capture from in-memory tensors (``tensors[layer][name]`` is
    ``[S, H, T, D]``): synthetic captures for tests."""
    with CaptureWriter(path, overwrite=overwrite, storage_dtype=meta.storage_dtype,
                       compression=compression) as w:
        w.begin(meta)
        for layer in meta.layers:
            la = (layer_attrs or {}).get(layer) or LayerAttrs(layer, meta.shape.head_dim ** -0.5,
                                                              0, 0.0)
            w.set_layer_attrs(la)
            for name in TENSORS:
                data = tensors[layer][name]
                for s in range(meta.num_samples):
                    w.write(layer, name, s, data[s])
        toks = tokens if tokens is not None else torch.zeros(meta.num_samples, meta.num_tokens,
                                                             dtype=torch.int32)
        for s in range(meta.num_samples):
            w.write_tokens(s, toks[s].cpu().numpy())
        return w.finish()


def set_twin(c, bits: int, fraction: float):
    """``c``'s MiKV set twin (``kvlens.research.mikv``) at ``bits`` and heavy ``fraction``."""
    return dataclasses.replace(c, twin=Twin("mikv", (bits, fraction)))


def set_of(c) -> tuple[int, float] | None:
    """``(set_bits, heavy_fraction)`` of a MiKV set twin; None for any other candidate."""
    return c.twin.setting if c.twin is not None and c.twin.extension == "mikv" else None


def tiny_capture(model_dir, directory: Path) -> Path:
    """``kvlens capture`` of ``model_dir`` (a tiny model directory) on a short English text:
    one sample of 64 tokens, written to ``directory/run.h5``."""
    from typer.testing import CliRunner

    from kvlens.cli import app

    text = directory / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80, encoding="utf-8")
    cap = directory / "run.h5"
    res = CliRunner().invoke(app, ["capture", "--model", str(model_dir), "--text", str(text),
                                   "-s", "1", "-t", "64", "-o", str(cap)])
    assert res.exit_code == 0, res.output
    return cap
