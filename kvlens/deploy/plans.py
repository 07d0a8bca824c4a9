"""The per-layer exports of an answer (``kvlens.deploy.exports``), each with the KLD of what
the engine will actually run: an engine target's chosen plan (``engine_exports``) and the
per-layer target's config mapped to the engines' types (``layer_exports``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvlens.cache.layout import config_bits
from kvlens.config import KVConfig, LayerKV, validate_for
from kvlens.config.engine import LlamaCppSetting
from kvlens.deploy import exports
from kvlens.deploy.presets import engine_config
from kvlens.deploy.targets import (
    TRTLLM_SETTINGS,
    TargetRecommendation,
    plan_type,
    setting_config,
    squared_error,
    target_engine,
)
from kvlens.errors import ConfigError

#: the engines a target's plan is exported for, in order (the target's own first)
EXPORTERS = {"trtllm": (exports.trtllm_export, exports.vllm_export),
             "vllm": (exports.vllm_export,)}


def _variants(rec: TargetRecommendation) -> dict[str, tuple[str, LayerKV]]:
    """plan type -> (the measured variant the chosen config stores it as, the config's layer
    that stores it)."""
    cfg = rec.chosen.config
    out = {"f16": ("f16", LayerKV(key_format="f16", value_format="f16"))}
    for lkv in (cfg.default, *cfg.layers.values()):
        variant = lkv.key_format or getattr(lkv.key, "kind", None)
        if variant is not None and lkv.key_format == lkv.value_format:
            out.setdefault(plan_type(variant), (variant, lkv))
    return out


def plan_config(rec: TargetRecommendation, plan: exports.Plan, name: str):
    """``(config, score)`` of ``plan`` built from the layers of the chosen config that store
    its types, and its score ``S`` over the target's error table (``(None, None)`` when a type
    was not measured, or a layer's keys and values differ)."""
    variants = _variants(rec)
    if any(k != v or k not in variants for k, v in plan.layers.values()):
        return None, None
    layers = {i: variants[k][1] for i, (k, _) in plan.layers.items()}
    cfg = KVConfig(name, variants["f16"][1], layers, fp_dtype="float16",
                   description=f"what {name} runs")
    score = 0.0  # an unquantized tensor scores 0, as the targets' candidates score it
    for i, row in zip(rec.layers, rec.table):
        t = plan.layers[i][0]
        if t not in exports.UNQUANTIZED:
            score += squared_error(row, variants[t][0])
    return cfg, score


def engine_exports(rec: TargetRecommendation, validation: dict | None = None,
                   measure: Callable[[list], list[dict]] | None = None) -> list[dict]:
    """The exports of ``rec``'s chosen plan (``EXPORTERS``), each with the ``kld`` of what the
    engine will run (``measured`` from ``validation`` or ``measure(configs)``, else
    ``predicted``, else none). Adds their files to ``rec.files``."""
    plan = rec.chosen.plan
    out = []
    for make in EXPORTERS.get(target_engine(rec.target), ()) if plan is not None else ():
        ex = make(plan)
        doc = ex.to_dict()
        if ex.expressible:
            kld = {"setting": rec.chosen.setting, "bits_per_element": rec.chosen.bits,
                   "score": rec.chosen.score}
            got = validation
        else:
            cfg, score = plan_config(rec, ex.runs, f"{rec.chosen.setting} as {ex.engine} runs it")
            kld = {"setting": None if cfg is None else cfg.name, "score": score,
                   "bits_per_element": None if cfg is None
                   else config_bits(cfg, rec.shape, rec.context)}
            got = None if cfg is None or measure is None else measure([cfg])[0]
        if got is not None:
            kld |= {"kld": got["mean_kld"], "ci95": got.get("ci95"), "source": "measured"}
        elif rec.kld_model is not None and kld["score"] is not None:
            kld |= {"kld": rec.kld_model.predict(kld["score"]), "source": "predicted"}
        else:
            kld |= {"kld": None, "source": "not measured (give --max-kld or --validate)"}
        doc["kld"] = kld
        out.append(doc)
        for name, text in ex.files.items():
            rec.files.setdefault(name, text)
    return out


#: the engine type a kvlens layout maps to, by its code bits: the first with at least as many
#: (``layer_exports``): NVFP4 / fp8 for vLLM, ModelOpt and TensorRT-LLM; ggml for ik_llama.cpp
BY_BITS = {"fp": ((4, exports.NVFP4), (8, "fp8_e4m3")),
           "ggml": ((4, "q4_0"), (5, "q5_0"), (8, "q8_0"))}
LAYER_EXPORTERS = (("fp", exports.trtllm_export), ("fp", exports.vllm_export),
                   ("ggml", exports.ik_llama_export))


def _by_bits(spec, family: str) -> str:
    bits = getattr(spec, "bits", None)  # None: unquantized
    return "f16" if bits is None else next((t for b, t in BY_BITS[family] if bits <= b), "f16")


def _default_scale(t: str) -> str:
    """The measured variant of plan type ``t`` at the engines' default scale 1.0 (what runs
    without a scale file: the per-layer exports write none)."""
    return t if t == exports.NVFP4 else f"{t}:s1"


def runs_setting(engine: str, runs: exports.Plan) -> str | None:
    """The engine setting (``kvlens.config.engine``) that runs ``runs``, an export's plan, on
    every layer at the default scales, named as the engine targets name theirs: vLLM's one
    dtype with the unquantized layers skipped, TensorRT-LLM's one dtype, one llama.cpp type
    pair without llama.cpp's rotation (ik_llama.cpp has none); None where the types differ
    from layer to layer in a way no setting names (ik_llama.cpp's first and last layers)."""
    quantized, pairs = sorted(runs.quantized()), set(runs.layers.values())
    if engine == "vllm" and len(quantized) == 1:
        skip = tuple(i for i, kv in runs.layers.items() if set(kv) <= set(exports.UNQUANTIZED))
        return setting_config("vllm", _default_scale(quantized[0]), skip).name
    if engine == "trtllm" and len(pairs) == 1 and len(quantized) == 1:
        return TRTLLM_SETTINGS[_default_scale(quantized[0])]
    if engine == "ik_llama.cpp" and len(pairs) == 1:
        return LlamaCppSetting(*pairs.pop(), rotation="off").name
    return None


def runs_config(engine: str, runs: exports.Plan, name: str) -> tuple[KVConfig, str | None]:
    """``(config, setting)``: the config that simulates what ``engine`` runs for ``runs``,
    built from engine settings (one meaning: ``kvlens.deploy.presets.engine_config``); the
    setting where one names it all (``runs_setting``), else each layer's from the setting of
    its own type pair, the config named ``name``."""
    setting = runs_setting(engine, runs)
    if setting is not None:
        return engine_config(setting).config, setting
    by_pair = {kv: engine_config(runs_setting(engine, exports.Plan({0: kv}, 1))).config
               for kv in set(runs.layers.values())}
    # one engine's settings of one form read the cache alike (llama.cpp's arithmetic)
    attention = next(iter(by_pair.values())).engine_attention
    layers = {i: by_pair[kv].default for i, kv in runs.layers.items()}
    return KVConfig(name, LayerKV(key_format="f16", value_format="f16"), layers,
                    fp_dtype="float16", engine_attention=attention,
                    description=f"what {engine} runs"), None


@dataclass
class LayerExports:
    """``layer_exports``' answer: the documents (``--json``), the config each engine runs (None
    where none runs or it does not fit the model) and the files to write (path -> a config or
    an engine's own file's text)."""

    documents: list[dict]
    configs: list[KVConfig | None]
    files: dict[Path, KVConfig | str] = field(default_factory=dict)


#: the engines whose exports may run a config no engine setting names (``runs_setting``), which
#: ``layer_exports`` writes beside the recommendation
FILE_ENGINES = ("ik_llama.cpp",)


def layer_exports(config: KVConfig, shape, context: int = 4096, out: Path | None = None,
                  command: Callable[[str], str] | None = None) -> LayerExports:
    """The per-layer target's config in each engine's form (``LAYER_EXPORTERS``), each tensor's
    layout mapped to an engine type by its code bits (``BY_BITS``): another quantizer, which
    each export names as a change. Each export's ``kld`` names the config the engine runs
    (``runs_config``: its setting, else its file ``export_path(out, ENGINE.json)``), its bits
    at ``context`` tokens and ``command(item)``, the command that measures it; ``source`` "not
    measured" until ``measure_layer_exports`` measures it."""
    docs, configs, files = [], [], {}
    for family, make in LAYER_EXPORTERS:
        lkv = {i: config.layer(i) for i in shape.attention_layers}
        plan = exports.Plan({i: (_by_bits(x.key, family), _by_bits(x.value, family))
                             for i, x in lkv.items()}, shape.num_layers)
        try:
            ex = make(plan)
        except ConfigError as exc:  # the plan quantizes nothing: the engine's default runs it
            docs.append({"engine": make.__name__.removesuffix("_export"), "command": None,
                         "expressible": False, "changes": [str(exc)], "notes": [],
                         "kld": {"kld": None, "source": "not measured"}})
            configs.append(None)
            continue
        doc = ex.to_dict()
        rule = ", ".join(f"<= {b} bits: {t}" for b, t in BY_BITS[family])
        # the engine never runs kvlens' layouts: the mapping is the first change
        doc["changes"] = [f"every layer: kvlens' layouts mapped by code bits ({rule}, else "
                          "f16), another quantizer with no full-precision window",
                          *doc["changes"]]
        doc["expressible"] = False
        doc["files"] = []
        for name, text in ex.files.items():  # the engine's own files (ModelOpt's config)
            if out is None:
                doc["notes"].append(f"give --output to write {name}")
                continue
            path = exports.export_path(out, name)
            files[path] = text
            doc["files"].append(str(path))
            doc["notes"].append(f"{path.name} is {name}: copy it into the model folder as {name}")
        if not ex.runs.quantized():  # e.g. vLLM skipping every layer whose K and V differ
            doc["kld"] = {"kld": None, "source": "not measured: every layer runs unquantized "
                          "(the engine's default cache)", "bits_per_element": 16.0}
            docs.append(doc)
            configs.append(None)
            continue
        runs, setting = runs_config(ex.engine, ex.runs, f"{config.name} on {ex.engine}")
        doc["kld"] = kld = {"kld": None, "source": "not measured", "setting": setting,
                            "bits_per_element": config_bits(runs, shape, context),
                            "command": None}
        try:
            validate_for(runs, shape)
        except ConfigError as exc:
            kld["source"] = f"not measurable here: {exc}"
            runs = None
        if runs is not None and setting is None:
            runs = replace(runs, model=config.model)
            if out is None:
                kld["source"] = ("not measured (give --validate, or --output to write the "
                                 "config it runs)")
            else:
                path = exports.export_path(out, f"{ex.engine}.json")
                files[path] = runs
                kld["config"] = str(path)
        item = setting or kld.get("config")
        if runs is not None and item is not None and command is not None:
            kld["command"] = command(item)
        docs.append(doc)
        configs.append(runs)
    return LayerExports(docs, configs, files)


def measure_layer_exports(made: list[LayerExports],
                          measure: Callable[[list[KVConfig]], list[dict]]) -> None:
    """Measure each distinct config the exports in ``made`` run once (two exports that run
    the same layers share one measurement), ``measure(configs)`` returning one
    ``kvlens.deploy.targets.measure_kld`` dict per config, and put the figure in each
    export's ``kld``."""
    distinct: dict[str, KVConfig] = {}
    for ex in made:
        for cfg in ex.configs:
            if cfg is not None:
                distinct.setdefault(_runs_key(cfg), cfg)
    got = dict(zip(distinct, measure(list(distinct.values())))) if distinct else {}
    for ex in made:
        for doc, cfg in zip(ex.documents, ex.configs):
            if cfg is not None:
                m = got[_runs_key(cfg)]
                doc["kld"] |= {"kld": m["mean_kld"], "ci95": m["ci95"], "source": "measured"}


def _runs_key(config: KVConfig) -> str:
    """What a config runs, apart from its name, description and model check."""
    return json.dumps({**config.to_dict(), "name": None, "description": None, "model": None},
                      sort_keys=True)
