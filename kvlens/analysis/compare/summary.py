"""``compare-axes`` summaries: means over layers and heads, the winning axis per metric,
reconstruction-vs-output disagreements, the KIVI-pattern check, and what each swept engine
format is (layout, bits per element, calibration)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from kvlens.analysis.compare.config import (
    AXES,
    EXTRA_VARIANTS,
    KEY_METRICS,
    PLAIN,
    STAGES,
    TENSOR_NAMES,
    VALUE_METRICS,
    CompareConfig,
)
from kvlens.analysis.compare.records import Record

_TIE = 1e-9


CONFIG_FIELDS = ("tensor", "bits", "group_size", "stage", "variant")  # what names a config


def _config_key(r: Record) -> tuple:
    return (r.tensor, r.bits, r.group_size, r.stage, r.variant)


FORMAT_CALIBRATION_NOTE = (
    "static fp8 scales (fp8_e4m3, fp8_e5m2, @head; not :sS) are calibrated per layer from the "
    "same captured keys/values they are evaluated on (in-sample: absmax never clips); "
    "per-token-head and ggml scales are dynamic per token"
)


def format_info(config: CompareConfig, kv_heads: int, tokens: int, head_dim: int) -> list[dict]:
    """Per swept format: layout, storage bits per element for one sequence of the capture's
    shape, whether keys and values are rotated, and how scales were calibrated."""
    out = []
    shape = (1, kv_heads, tokens, head_dim)
    for setting in config.format_settings():
        fmt = setting.format
        out.append({"format": setting.name, "family": fmt.family,
                    "shares_scale": fmt.shares_scale, "code_bits": fmt.code_bits,
                    "bits_per_element": setting.bits_per_element(shape),
                    "rotated": setting.rotates(head_dim), "calibration": _calibration(fmt)})
    return out


def _calibration(fmt) -> str:
    if fmt.family != "fp8":
        return "dynamic"
    if fmt.fixed_scale is not None:
        return f"static, {fmt.calibration} (not calibrated)"
    return f"static, per layer from the capture ({fmt.calibration}, in-sample)"


def _means(records: Sequence[Record], fields: tuple[str, ...], sort) -> list[dict[str, Any]]:
    """Mean, min, max and count of the errors (over layers and heads) per value of the records'
    ``fields``, sorted by ``sort``."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        cells[tuple(getattr(r, f) for f in fields)].append(r.rel_error)
    return sorted(({**dict(zip(fields, key)), "mean": sum(v) / len(v), "min": min(v),
                    "max": max(v), "count": len(v)} for key, v in cells.items()), key=sort)


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """Means over layers and heads, the winning axis per metric, reconstruction-vs-output
    disagreements and the KIVI-pattern check (JSON-ready; see ``docs/compare-axes.md``).
    Engine-format records (``Record.format`` set) are summarised apart, in
    ``format_means``; they take no part in the axis comparison."""
    formats = [r for r in records if r.format is not None]
    order = {f: i for i, f in enumerate(dict.fromkeys(r.format for r in formats))}
    format_means = _means(formats, ("tensor", "format", "metric"), lambda m: (
        TENSOR_NAMES.index(m["tensor"]), order[m["format"]], KEY_METRICS.index(m["metric"])))
    records = [r for r in records if r.format is None]
    means = _means(records, ("tensor", "axis", "bits", "group_size", "stage", "variant",
                             "metric"), _sort_key)
    mean_of = means_by_key(means)
    configs = sorted({_config_key(r) for r in records},
                     key=lambda c: _sort_key(dict(zip(CONFIG_FIELDS, c, strict=True))))
    winners, rankings = _winners_and_rankings(records, mean_of, configs)
    return {
        "aggregation": "mean over layers and heads of per-(layer, head) relative Frobenius "
        "errors; reconstruction per KV head, attention metrics per query head",
        "means": means,
        "winners": winners,
        "rankings": rankings,
        "disagreements": [r for r in rankings if r["disagree"]],
        "kivi_pattern": _kivi_pattern(mean_of, configs),
        **({"format_means": format_means, "format_calibration": FORMAT_CALIBRATION_NOTE}
           if format_means else {}),
    }


def _winners_and_rankings(
    records: Sequence[Record], mean_of: Mapping[tuple, float], configs: Sequence[tuple]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per config and metric, the axis with the lower mean error (and in how many layers
    per-channel wins); per config, the winner of each metric and whether reconstruction and
    attention output disagree."""
    per_layer: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        per_layer[(*_config_key(r), r.axis, r.metric, r.layer)].append(r.rel_error)
    layer_mean = {k: sum(v) / len(v) for k, v in per_layer.items()}
    layers = sorted({r.layer for r in records})
    winners, rankings = [], []
    for ck in configs:
        metrics = KEY_METRICS if ck[0] == "key" else VALUE_METRICS
        ranking = dict(zip(CONFIG_FIELDS, ck, strict=True))
        for metric in metrics:
            tok = mean_of.get((*ck, "per-token", metric))
            ch = mean_of.get((*ck, "per-channel", metric))
            if tok is None or ch is None:
                continue
            won = sum(1 for layer in layers if layer_mean[(*ck, "per-channel", metric, layer)]
                      < layer_mean[(*ck, "per-token", metric, layer)])
            winner = ("tie" if abs(tok - ch) <= _TIE * max(tok, ch) else
                      "per-token" if tok < ch else "per-channel")
            winners.append({**ranking, "metric": metric, "per_token": tok, "per_channel": ch,
                            "winner": winner,
                            "ratio_token_over_channel": (tok / ch) if ch > 0 else None,
                            "layers_per_channel_better": won, "layers": len(layers)})
            ranking[metric] = winner
        recon, output = ranking.get("reconstruction"), ranking.get("attention_output")
        ranking["disagree"] = bool(recon and output and "tie" not in (recon, output)
                                   and recon != output)
        rankings.append(ranking)
    return winners, rankings


def means_by_key(means: Sequence[Mapping[str, Any]]) -> dict[tuple, float]:
    """Summary means keyed by (tensor, bits, group_size, stage, variant, axis, metric)."""
    return {(*(m[f] for f in CONFIG_FIELDS), m["axis"], m["metric"]): m["mean"] for m in means}


def _sort_key(m: Mapping[str, Any]) -> tuple:
    order = {n: i for i, n in
             enumerate((*TENSOR_NAMES, *AXES, *STAGES, PLAIN, *EXTRA_VARIANTS, *KEY_METRICS))}
    return (order[m["tensor"]], m["bits"], m["group_size"], order.get(m["stage"], -1),
            order[m["variant"]], order.get(m.get("axis"), -1), order.get(m.get("metric"), -1))


def _kivi_pattern(mean_of: Mapping[tuple, float], configs) -> list[dict[str, Any]]:
    """For each (bits, G) with plain post-RoPE keys and plain values: does KIVI's finding hold?
    Keys: per-channel lower reconstruction and score error. Values: per-channel lower or equal
    reconstruction error but higher attention-output error."""
    out = []
    for bits, g in sorted({(c[1], c[2]) for c in configs}):
        kk, vk = ("key", bits, g, "post", PLAIN), ("value", bits, g, None, PLAIN)

        def get(ck, metric, op):  # (per-channel mean, per-token mean, expected relation)
            return (mean_of.get((*ck, "per-channel", metric)),
                    mean_of.get((*ck, "per-token", metric)), op)

        parts = {"key_reconstruction": get(kk, "reconstruction", "<"),
                 "key_score": get(kk, "score", "<"),
                 "value_reconstruction": get(vk, "reconstruction", "<="),
                 "value_attention_output": get(vk, "attention_output", ">")}
        if any(ch is None or tok is None for ch, tok, _ in parts.values()):
            continue
        checks = {}
        for name, (ch, tok, op) in parts.items():
            ok = ch < tok if op == "<" else ch > tok if op == ">" else ch <= tok * (1 + _TIE)
            checks[name] = {"per_channel": ch, "per_token": tok,
                            "expected": f"per-channel {op} per-token", "holds": bool(ok)}
        out.append({"bits": bits, "group_size": g,
                    "holds": all(c["holds"] for c in checks.values()), "checks": checks})
    return out
