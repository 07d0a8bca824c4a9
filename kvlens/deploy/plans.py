"""The per-layer exports of an engine target's answer: the chosen setting's plan written for
each engine that reads it (``kvlens.deploy.exports``), with the KLD of what each engine will
actually run, measured when the command measures (``--validate``), else predicted by the
target's KLD model and labelled so, else its error score alone.

Where an engine runs the plan as it is, that is the chosen setting's own figure. Where it
cannot (``Export.changes``), what it runs instead is built as a kvlens config from the same
measured types (``plan_config``), scored on the target's error table and, with
``--validate``, measured beside the choice.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlens.cache.layout import config_bits
from kvlens.config import KVConfig, LayerKV
from kvlens.deploy import exports
from kvlens.deploy.targets import TargetRecommendation

#: the engines a target's plan is exported for, in order (the target's own first)
EXPORTERS = {"trtllm": (exports.trtllm_export, exports.vllm_export),
             "vllm": (exports.vllm_export,)}


def _variants(rec: TargetRecommendation) -> dict[str, tuple[str, LayerKV]]:
    """plan type -> (the measured variant the chosen config stores it as: a cache type, or a
    block-float layout's kind; the layer of the config that stores it)."""
    cfg = rec.chosen.config
    out = {"f16": ("f16", LayerKV(key_format="f16", value_format="f16"))}
    for lkv in (cfg.default, *cfg.layers.values()):
        variant = lkv.key_format or getattr(lkv.key, "kind", None)
        if variant is not None and lkv.key_format == lkv.value_format:
            out.setdefault(variant.split(":")[0].split("@")[0], (variant, lkv))
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
            score += row[("key", variants[t][0])] ** 2 + row[("value", variants[t][0])] ** 2
    return cfg, score


def engine_exports(rec: TargetRecommendation, validation: dict | None = None,
                   measure: Callable[[list], list[dict]] | None = None) -> list[dict]:
    """The exports of ``rec``'s chosen plan (``EXPORTERS``), each with ``kld``: what the
    engine will run, its bits, its score and its KLD (``measured`` from ``validation`` or
    ``measure(configs)``, else ``predicted``, else none). Adds their files to ``rec.files``."""
    plan = rec.chosen.plan
    out = []
    for make in EXPORTERS.get(rec.target, ()) if plan is not None else ():
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
