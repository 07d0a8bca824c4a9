"""The per-layer exports of an answer: an engine target's chosen plan written for each engine
that reads it (``kvlens.deploy.exports``) with the KLD of what each engine will actually run
(measured with ``--validate``, else predicted, else its error score alone; what an engine runs
instead of the plan is built from the same measured types, ``plan_config``), and the per-layer
target's config mapped to the engines' types (``layer_exports``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvlens.cache.layout import config_bits
from kvlens.config import KVConfig, LayerKV
from kvlens.deploy import exports
from kvlens.deploy.targets import TargetRecommendation, plan_type, squared_error, target_engine
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


def layer_exports(config: KVConfig, shape) -> list[dict]:
    """The per-layer target's config in each engine's form (``LAYER_EXPORTERS``), each tensor's
    layout mapped to an engine type by its code bits (``BY_BITS``): another quantizer, which
    each export names as a change, its KLD not measured."""
    out = []
    for family, make in LAYER_EXPORTERS:
        lkv = {i: config.layer(i) for i in shape.attention_layers}
        plan = exports.Plan({i: (_by_bits(x.key, family), _by_bits(x.value, family))
                             for i, x in lkv.items()}, shape.num_layers)
        try:
            ex = make(plan)
        except ConfigError as exc:  # the plan quantizes nothing: the engine's default runs it
            out.append({"engine": make.__name__.removesuffix("_export"), "command": None,
                        "expressible": False, "changes": [str(exc)], "notes": [],
                        "kld": {"kld": None, "source": "not measured"}})
            continue
        doc = ex.to_dict()
        rule = ", ".join(f"<= {b} bits: {t}" for b, t in BY_BITS[family])
        # the engine never runs kvlens' layouts: the mapping is the first change
        doc["changes"] = [f"every layer: kvlens' layouts mapped by code bits ({rule}, else "
                          "f16), another quantizer with no full-precision window",
                          *doc["changes"]]
        doc["expressible"] = False
        doc["kld"] = {"kld": None, "source": "not measured: a different quantizer than the "
                                             "config's; simulate it before deploying"}
        out.append(doc)
    return out
