"""Per-layer exports each engine can read: a plan (one K type and one V type per attention
layer) written in each engine's own form, one function per form, and whatever an engine cannot
express said, never rounded silently. The engines' forms, read from their source:
docs/lab-notes/deploy-exports.md.

A ``Plan`` names types in one vocabulary: ``f16`` / ``bf16`` / ``f32`` (the model dtype,
unquantized), the vLLM fp8 dtypes (``fp8_e4m3``, ``fp8_e5m2``; ``fp8`` = ``fp8_e4m3``),
``nvfp4``, and llama.cpp's ggml types (``q8_0`` ...). Each export is an ``Export``: the command
(or snippet) to run, the files to write beside the kvlens config, the plan the engine will
actually run (``runs``) and, when that is not the plan, each change (``changes``): the
nearest setting the engine expresses that is at least as accurate on every layer (a layer is
raised, never lowered, unless the engine has no setting that high).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

from kvlens.errors import ConfigError
from kvlens.quant.ggml import GGML_FORMATS

UNQUANTIZED = ("f32", "f16", "bf16")
FP8_TYPES = ("fp8_e4m3", "fp8_e5m2")
NVFP4 = "nvfp4"
#: what ModelOpt calls each type it has (``quant_algo`` of a KV layer)
MODELOPT_ALGOS = {"fp8_e4m3": "FP8", NVFP4: "NVFP4"}
MODELOPT_FILE = "hf_quant_config.json"
MODELOPT_SCHEMA_VERSION = 1  # ModelOpt's kv_cache_schema_version of the per-layer KV map
DOCS = {
    "trtllm": "TensorRT-LLM quantization (https://nvidia.github.io/TensorRT-LLM/features/"
              "quantization.html): KvCacheConfig(dtype='fp8'|'nvfp4'); NVFP4 needs a ModelOpt "
              "checkpoint",
    "vllm": "vLLM Quantized KV Cache (https://docs.vllm.ai/en/latest/features/quantization/"
            "quantized_kvcache/): --kv-cache-dtype, --kv-cache-dtype-skip-layers",
    "ik_llama.cpp": "ik_llama.cpp common/common.cpp: -ctk/-ctv, -ctk-first/-ctk-last, "
                    "-ctv-first/-ctv-last TYPE,N (https://github.com/ikawrakow/ik_llama.cpp)",
}


def export_path(out: Path, name: str) -> Path:
    """Where file ``name`` goes beside a config written to ``out``: ``kv.json`` ->
    ``kv.NAME`` (several budgets' configs share a folder)."""
    return out.with_name(f"{out.stem}.{name}")


def canonical_type(name: str) -> str:
    """``name`` in the plan vocabulary (module docstring): ``fp8`` -> ``fp8_e4m3``."""
    key = str(name).strip().lower()
    key = {"fp8": "fp8_e4m3"}.get(key, key)
    if key in (*UNQUANTIZED, *FP8_TYPES, NVFP4, *GGML_FORMATS):
        return key
    raise ConfigError(f"Unknown plan type {name!r}; allowed: "
                      f"{', '.join((*UNQUANTIZED, 'fp8', *FP8_TYPES, NVFP4, *GGML_FORMATS))}.")


def type_bits(name: str) -> float:
    """Held bits per element of a plan type: the precision order the exports raise along
    (nvfp4: 4 bits per value and one 8-bit scale per 16 values)."""
    t = canonical_type(name)
    if t in UNQUANTIZED:
        return 32.0 if t == "f32" else 16.0
    if t in FP8_TYPES:
        return 8.0
    if t == NVFP4:
        return 4.5
    return GGML_FORMATS[t].bits_per_element()


@dataclass(frozen=True)
class Plan:
    """One key and one value type per attention layer: ``layers[model layer index] = (key
    type, value type)`` (module docstring); ``num_layers``: the model's layers, attention or
    not (ik_llama.cpp counts ``-ctk-last`` from the model's last layer)."""

    layers: Mapping[int, tuple[str, str]]
    num_layers: int

    def __post_init__(self) -> None:
        layers = {int(i): (canonical_type(k), canonical_type(v))
                  for i, (k, v) in sorted(self.layers.items())}
        if not layers or min(layers) < 0 or max(layers) >= self.num_layers:
            raise ConfigError(f"A plan needs layers in 0..{self.num_layers - 1}, got "
                              f"{sorted(layers)}.")
        object.__setattr__(self, "layers", layers)

    @classmethod
    def uniform(cls, key: str, value: str, layers, num_layers: int,
                overrides: Mapping[int, tuple[str, str]] | None = None) -> Plan:
        """``key``/``value`` on every layer of ``layers``, ``overrides`` on some."""
        return cls({i: (overrides or {}).get(i, (key, value)) for i in layers}, num_layers)

    def tensor(self, t: int) -> list[str]:
        """The types of tensor ``t`` (0: keys, 1: values), in layer order."""
        return [kv[t] for kv in self.layers.values()]

    def quantized(self) -> set[str]:
        """The quantized types the plan names."""
        return {t for kv in self.layers.values() for t in kv if t not in UNQUANTIZED}

    def describe(self, i: int) -> str:
        k, v = self.layers[i]
        return k if k == v else f"K {k} / V {v}"


@dataclass
class Export:
    """What one engine runs for a plan (module docstring). ``changes``: how ``runs`` differs
    from the plan, each a sentence; empty when the engine runs the plan as it is."""

    engine: str
    command: str
    runs: Plan
    changes: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def expressible(self) -> bool:
        return not self.changes

    def to_dict(self) -> dict:
        return {"engine": self.engine, "command": self.command,
                "expressible": self.expressible, "changes": list(self.changes),
                "runs": {str(i): k if k == v else [k, v]
                         for i, (k, v) in self.runs.layers.items()},
                "files": sorted(self.files), "notes": list(self.notes),
                "docs": DOCS.get(self.engine, "")}


def _raise_to(plan: Plan, target: dict[int, tuple[str, str]], why: str) -> tuple[Plan, tuple]:
    """``plan`` with layers replaced by ``target``, and a sentence per group of layers whose
    types changed the same way (``why``: what the engine cannot do)."""
    runs = Plan({**plan.layers, **target}, plan.num_layers)
    groups: dict[tuple[str, str], list[int]] = {}
    for i in plan.layers:
        if runs.layers[i] != plan.layers[i]:
            groups.setdefault((plan.describe(i), runs.describe(i)), []).append(i)
    changes = tuple(f"layer{'s' if len(ls) > 1 else ''} {', '.join(map(str, sorted(ls)))}: "
                    f"{a} -> {b} ({why})" for (a, b), ls in groups.items())
    return runs, changes


# -- ModelOpt and TensorRT-LLM ------------------------------------------------------------------


def modelopt_quant_config(plan: Plan) -> dict:
    """``hf_quant_config.json`` for ``plan``, as ModelOpt's KV AutoQuant writes it (NVIDIA/
    Model-Optimizer tests/unit/torch/export/test_convert_hf_config.py): FP8 / NVFP4 on every layer
    -> that ``kv_cache_quant_algo``; a mix -> ``MIXED_PRECISION``; both with the per-layer map
    (unquantized layers absent). Types ModelOpt has no KV algo for, and keys and values of
    one layer in different types, raise ``ConfigError``: ModelOpt's main branch names FP8 keys
    with NVFP4 values ``FP8_K_NVFP4_V``, which no engine reads yet (docs/lab-notes/
    engine-formats.md#fp8-keys-with-fp4-values), so kvlens does not write it."""
    per_layer = {}
    for i, (k, v) in plan.layers.items():
        if k != v:
            raise ConfigError(f"layer {i}: keys {k} and values {v} differ; the per-layer map "
                              "gives a layer one KV algo (FP8 or NVFP4): ModelOpt's "
                              "FP8_K_NVFP4_V is read by no engine release yet.")
        if k in UNQUANTIZED:
            continue
        if k not in MODELOPT_ALGOS:
            raise ConfigError(f"layer {i}: {k} has no ModelOpt KV algo; allowed: "
                              f"{', '.join(MODELOPT_ALGOS)} or unquantized.")
        # the attention module, named as ModelOpt writes a llama-style decoder's
        per_layer[f"model.layers.{i}.self_attn"] = {"quant_algo": MODELOPT_ALGOS[k]}
    algos = {a["quant_algo"] for a in per_layer.values()}
    if not algos:
        raise ConfigError("The plan quantizes no layer: there is no KV algo to write.")
    return {"producer": {"name": "kvlens"},
            "quantization": {
                "quant_algo": None,
                "kv_cache_quant_algo": algos.pop() if len(algos) == 1 else "MIXED_PRECISION",
                "kv_cache_quantized_layers": per_layer,
                "kv_cache_schema_version": MODELOPT_SCHEMA_VERSION}}


def _modelopt_file(plan: Plan) -> dict[str, str]:
    return {MODELOPT_FILE: json.dumps(modelopt_quant_config(plan), indent=2) + "\n"}


def trtllm_export(plan: Plan) -> Export:
    """TensorRT-LLM runs one KV dtype for every layer (``KvCacheConfig(dtype=...)``; its ModelOpt
    reader, tensorrt_llm/quantization/modelopt_config.py, reads no per-layer map): a plan of one
    ModelOpt type runs as it is; otherwise every layer runs the most accurate quantized type
    of the plan (unquantized layers lowered to it: TensorRT-LLM has no per-layer exception).
    The ModelOpt file carries the plan itself, for runtimes that read its per-layer map."""
    quantized = plan.quantized()
    bad = sorted(quantized - set(MODELOPT_ALGOS))
    if bad:
        raise ConfigError(f"TensorRT-LLM's KV types are fp8 (e4m3) and nvfp4; the plan has "
                          f"{', '.join(bad)}.")
    if not quantized:
        raise ConfigError("The plan quantizes no layer: TensorRT-LLM's default cache runs it.")
    best = max(quantized, key=type_bits)
    runs, changes = _raise_to(plan, {i: (best, best) for i in plan.layers},
                              "TensorRT-LLM runs one KV dtype for every layer")
    dtype = {"fp8_e4m3": "fp8", NVFP4: "nvfp4"}[best]
    command = ("LLM(model=\"MODEL_DIR\", kv_cache_config=KvCacheConfig("
               f"dtype=\"{dtype}\"))  # tensorrt_llm.llmapi; MODEL_DIR holds {MODELOPT_FILE}")
    notes = ()
    if changes:
        notes = (f"{MODELOPT_FILE} holds the plan's per-layer map (ModelOpt's MIXED_PRECISION "
                 "KV form); TensorRT-LLM's ModelOpt reader takes one kv_cache_quant_algo, so "
                 f"the command sets dtype={dtype!r} for every layer",)
    try:
        files = _modelopt_file(plan)
    except ConfigError:  # keys and values differ somewhere: write what will run
        files = _modelopt_file(runs)
    return Export("trtllm", command, runs, changes, files, notes)


# -- vLLM ------------------------------------------------------------------------------------


def vllm_command(dtype: str, skip: list[int] | tuple[int, ...]) -> str:
    """``vllm serve`` with one KV dtype and the layers kept in the model dtype (space-separated
    indices: vLLM parses the flag as a list)."""
    cmd = f"vllm serve MODEL --kv-cache-dtype {dtype}"
    return cmd + (f" --kv-cache-dtype-skip-layers {' '.join(map(str, sorted(skip)))}"
                  if skip else "")


def vllm_export(plan: Plan) -> Export:
    """vLLM runs one quantized dtype with some layers skipped (``--kv-cache-dtype-skip-layers``,
    vllm/config/cache.py): the plan's cheapest quantized type on every layer that has it (K and
    V alike), every other layer skipped (raised to the model dtype)."""
    quantized = plan.quantized()
    bad = sorted(t for t in quantized if t in GGML_FORMATS)
    if bad:
        raise ConfigError(f"vLLM has no llama.cpp types; the plan has {', '.join(bad)}.")
    if not quantized:
        raise ConfigError("The plan quantizes no layer: vLLM's default cache runs it.")
    base = min(quantized, key=type_bits)
    skipped = {i for i, kv in plan.layers.items() if kv != (base, base)}
    runs, changes = _raise_to(plan, {i: ("f16", "f16") for i in skipped
                                     if not set(plan.layers[i]) <= set(UNQUANTIZED)},
                              "vLLM runs one --kv-cache-dtype; other layers are skipped to the "
                              "model dtype")
    notes = ()
    if changes and quantized <= set(MODELOPT_ALGOS):
        notes = ("vLLM PR #56116 (not merged) reads ModelOpt's per-layer FP8/NVFP4 map "
                 f"({MODELOPT_FILE}); released vLLM runs the command above",)
    return Export("vllm", vllm_command(base, sorted(skipped)), runs, changes, {}, notes)


# -- ik_llama.cpp -------------------------------------------------------------------------------


def _first_last(types: list[str]) -> tuple[str, tuple | None, tuple | None] | None:
    """``(base, (first type, N) | None, (last type, M) | None)`` when ``types`` (one per layer,
    in order) is at most three runs, the middle one (or the only one) the base; else None."""
    runs = [(t, len(list(group))) for t, group in groupby(types)]
    if len(runs) == 1:
        return runs[0][0], None, None
    if len(runs) == 2:  # the longer run is the base
        (a, n), (b, m) = runs
        return (b, (a, n), None) if m >= n else (a, None, (b, m))
    if len(runs) == 3:
        return runs[1][0], runs[0], runs[2]
    return None


def ik_llama_export(plan: Plan) -> Export:
    """ik_llama.cpp's ``-ctk T`` plus ``-ctk-first T,N`` / ``-ctk-last T,M`` (and ``-ctv-...``:
    the first ``N`` / last ``M`` layers in another type; common/common.cpp), per tensor. The
    plan must name every layer of the model (the flags count the model's layers). A tensor whose
    types are not first/base/last runs has every middle layer raised to its best middle type."""
    if len(plan.layers) != plan.num_layers:
        raise ConfigError("ik_llama.cpp's -ctk-first/-ctk-last count every layer of the model; "
                          f"the plan names {len(plan.layers)} of {plan.num_layers}.")
    bad = sorted(t for t in plan.quantized() if t not in GGML_FORMATS)
    if bad:
        raise ConfigError(f"ik_llama.cpp's cache types are llama.cpp's; the plan has "
                          f"{', '.join(bad)}.")
    flags, target = [], {i: list(kv) for i, kv in plan.layers.items()}
    for t, name in ((0, "k"), (1, "v")):
        types = plan.tensor(t)
        shape = _first_last(types)
        if shape is None:  # keep the outer runs, raise the middle to its best type
            n = next(j for j, x in enumerate(types) if x != types[0])
            m = next(j for j, x in enumerate(reversed(types)) if x != types[-1])
            best = max(types[n:len(types) - m], key=type_bits)
            types = types[:n] + [best] * (len(types) - n - m) + types[len(types) - m:]
            for j, x in enumerate(types):
                target[j][t] = x
            shape = _first_last(types)
        base, head, tail = shape
        flags += [f"-ct{name}{flag} {','.join(map(str, run))}"
                  for flag, run in (("", (base,)), ("-first", head), ("-last", tail)) if run]
    runs, changes = _raise_to(plan, {i: tuple(kv) for i, kv in target.items()},
                              "ik_llama.cpp sets the first and last layers apart, not others")
    quantized_v = any(v not in UNQUANTIZED for v in runs.tensor(1))
    command = "llama-server -m MODEL.gguf " + " ".join(flags) + (" -fa on" if quantized_v else "")
    notes = ("ik_llama.cpp does not rotate keys and values as llama.cpp does (its -khad "
             "rotates keys when asked): compare with the llamacpp:...:norot simulation",)
    return Export("ik_llama.cpp", command, runs, changes, {}, notes)
