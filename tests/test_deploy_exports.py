"""Per-layer exports (``kvlens.deploy.exports``): each engine's own form of a plan, read back
the way the engine reads it, and a plan an engine cannot express reported, never rounded
silently."""

from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

from kvlens.deploy.exports import (
    MODELOPT_FILE,
    Plan,
    ik_llama_export,
    modelopt_quant_config,
    trtllm_export,
    type_bits,
    vllm_export,
)
from kvlens.errors import ConfigError

# vLLM's CacheDType values kvlens prints (vllm/config/cache.py)
VLLM_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4")


def _vllm_parse(command: str) -> argparse.Namespace:
    """``vllm serve MODEL ...`` parsed as vLLM's CLI parses these two flags: a dtype from its
    list, the skipped layers a list of strings (``nargs="+"``, ``kv_cache_dtype_skip_layers:
    list[str]``)."""
    words = shlex.split(command)
    assert words[:3] == ["vllm", "serve", "MODEL"]
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--kv-cache-dtype", choices=VLLM_DTYPES, required=True)
    p.add_argument("--kv-cache-dtype-skip-layers", nargs="+", default=[])
    return p.parse_args(words[3:])


def _vllm_layers(command: str, plan: Plan) -> dict[int, tuple[str, str]]:
    """What vLLM stores per layer for ``command``: a skipped layer in the model dtype."""
    args = _vllm_parse(command)
    skip = {int(s) for s in args.kv_cache_dtype_skip_layers}  # indices only, as printed
    return {i: ("f16", "f16") if i in skip else (args.kv_cache_dtype,) * 2 for i in plan.layers}


def _ik_layers(command: str, num_layers: int) -> dict[int, tuple[str, str]]:
    """ik_llama.cpp's per-layer types for ``command``, decoded independently of the export by
    the rule of its src/llama.cpp: layer ``i`` takes the ``-ct?-first`` type when ``i < N``,
    the ``-ct?-last`` type when ``i >= n_layer - M``, else ``-ct?``."""
    words = shlex.split(command)
    flags = dict(zip(words[3::2], words[4::2]))
    assert words[:3] == ["llama-server", "-m", "MODEL.gguf"]
    out = {}
    for i in range(num_layers):
        kv = []
        for t in ("k", "v"):
            this = flags[f"-ct{t}"]
            if f"-ct{t}-first" in flags:
                typ, n = flags[f"-ct{t}-first"].split(",")
                this = typ if i < int(n) else this
            if f"-ct{t}-last" in flags:
                typ, m = flags[f"-ct{t}-last"].split(",")
                this = typ if i >= num_layers - int(m) else this
            kv.append(this)
        out[i] = tuple(kv)
    return out


def test_modelopt_file_has_modelopts_field_names():
    mix = Plan.uniform("nvfp4", "nvfp4", range(5), 6, {1: ("fp8", "fp8"), 4: ("f16", "f16")})
    doc = json.loads(json.dumps(modelopt_quant_config(mix)))
    q = doc["quantization"]
    assert q["kv_cache_quant_algo"] == "MIXED_PRECISION" and q["quant_algo"] is None
    assert q["kv_cache_schema_version"] == 1
    # layer 4 is unquantized: absent from the map; layer 5 is not an attention layer here
    assert q["kv_cache_quantized_layers"] == {
        "model.layers.0.self_attn": {"quant_algo": "NVFP4"},
        "model.layers.1.self_attn": {"quant_algo": "FP8"},
        "model.layers.2.self_attn": {"quant_algo": "NVFP4"},
        "model.layers.3.self_attn": {"quant_algo": "NVFP4"}}
    one = modelopt_quant_config(Plan.uniform("fp8_e4m3", "fp8_e4m3", range(3), 3))
    assert one["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert set(one["quantization"]["kv_cache_quantized_layers"]) == {
        f"model.layers.{i}.self_attn" for i in range(3)}
    with pytest.raises(ConfigError, match="keys fp8_e4m3 and values nvfp4 differ.*"
                       "FP8_K_NVFP4_V is read by no engine"):
        modelopt_quant_config(Plan({0: ("fp8", "nvfp4")}, 1))
    with pytest.raises(ConfigError, match="q8_0 has no ModelOpt KV algo"):
        modelopt_quant_config(Plan({0: ("q8_0", "q8_0")}, 1))
    with pytest.raises(ConfigError, match="Unknown plan type 'int3'"):
        Plan({0: ("int3", "f16")}, 1)


def test_trtllm_runs_one_dtype_and_says_what_a_mix_becomes():
    same = trtllm_export(Plan.uniform("nvfp4", "nvfp4", range(4), 4))
    assert same.expressible and 'KvCacheConfig(dtype="nvfp4")' in same.command
    assert json.loads(same.files[MODELOPT_FILE])["quantization"]["kv_cache_quant_algo"] == \
        "NVFP4"
    mix = Plan.uniform("nvfp4", "nvfp4", range(4), 4, {2: ("fp8", "fp8")})
    ex = trtllm_export(mix)
    assert not ex.expressible
    assert re.search(r'dtype="(\w+)"', ex.command)[1] == "fp8"  # the most accurate type
    assert set(ex.runs.layers.values()) == {("fp8_e4m3", "fp8_e4m3")}
    assert len(ex.changes) == 1 and ex.changes[0].startswith("layers 0, 1, 3: nvfp4 -> "
                                                             "fp8_e4m3")
    # the file keeps the plan itself (ModelOpt's per-layer form) and says so in a note
    q = json.loads(ex.files[MODELOPT_FILE])["quantization"]
    assert q["kv_cache_quant_algo"] == "MIXED_PRECISION" and ex.notes
    assert ex.to_dict()["expressible"] is False
    with pytest.raises(ConfigError, match="fp8 \\(e4m3\\) and nvfp4; the plan has q4_0"):
        trtllm_export(Plan({0: ("q4_0", "q4_0")}, 1))


@pytest.mark.parametrize("layers", [
    {0: ("fp8", "fp8"), 1: ("f16", "f16"), 2: ("fp8", "fp8"), 3: ("f16", "f16")},
    {i: ("nvfp4", "nvfp4") for i in range(5)},
    {0: ("nvfp4", "nvfp4"), 1: ("fp8", "fp8"), 2: ("nvfp4", "nvfp4"), 3: ("fp8", "nvfp4")},
])
def test_the_vllm_command_parses_back_to_what_runs(layers):
    """vLLM's parser reads the printed flags back into exactly the plan the export says will
    run; that is the plan itself when it is one dtype plus skipped layers, else each raised
    layer is named."""
    plan = Plan(layers, 6)
    ex = vllm_export(plan)
    assert _vllm_layers(ex.command, plan) == ex.runs.layers
    mixed = len({kv for kv in plan.layers.values() if kv != ("f16", "f16")}) > 1
    assert ex.expressible == (not mixed)
    if mixed:  # nvfp4 kept, the rest raised to the model dtype: never lowered
        assert _vllm_parse(ex.command).kv_cache_dtype == "nvfp4"
        for i, kv in plan.layers.items():
            assert all(type_bits(r) >= type_bits(p) for r, p in zip(ex.runs.layers[i], kv))
        assert any("3" in c and "K fp8_e4m3 / V nvfp4" in c for c in ex.changes)


def test_the_old_comma_spelling_would_skip_nothing():
    """Why the skipped layers are space-separated: vLLM reads ``2,10`` as one pattern."""
    args = argparse.ArgumentParser()
    args.add_argument("--kv-cache-dtype-skip-layers", nargs="+")
    got = args.parse_args(["--kv-cache-dtype-skip-layers", "2,10"]).kv_cache_dtype_skip_layers
    assert got == ["2,10"] and "2" not in got
    ex = vllm_export(Plan.uniform("fp8", "fp8", range(12), 12, {2: ("f16",) * 2,
                                                                10: ("f16",) * 2}))
    assert ex.command.endswith("--kv-cache-dtype-skip-layers 2 10")


@pytest.mark.parametrize("keys,values,expressible", [
    (["f16", "q4_0", "q4_0", "q4_0", "q8_0"], ["q8_0"] * 5, True),
    (["q4_0", "q4_0", "q4_0", "f16", "f16"], ["f16", "q5_0", "q5_0", "q5_0", "q5_0"], True),
    (["q8_0"] * 5, ["q8_0"] * 5, True),
    (["f16", "q4_0", "q8_0", "q4_0", "f16"], ["q4_0"] * 5, False),
    (["q4_0", "q8_0", "q4_0", "q5_1", "q4_0", "q8_0"], ["f16"] + ["q4_0"] * 5, False),
])
def test_ik_llama_first_last_flags_decode_to_what_runs(keys, values, expressible):
    plan = Plan({i: kv for i, kv in enumerate(zip(keys, values))}, len(keys))
    ex = ik_llama_export(plan)
    assert _ik_layers(ex.command, len(keys)) == ex.runs.layers
    assert ex.expressible == expressible
    if expressible:
        assert ex.runs.layers == plan.layers
    else:  # every changed layer raised, and named
        changed = [i for i in plan.layers if ex.runs.layers[i] != plan.layers[i]]
        assert changed and all(str(i) in " ".join(ex.changes) for i in changed)
        for i in changed:
            assert all(type_bits(r) >= type_bits(p)
                       for r, p in zip(ex.runs.layers[i], plan.layers[i]))
    assert ("-fa on" in ex.command) == any(v != "f16" for v in values)


def test_ik_llama_needs_every_layer_and_llamacpp_types():
    with pytest.raises(ConfigError, match="names 2 of 3"):
        ik_llama_export(Plan({0: ("q8_0", "q8_0"), 2: ("q8_0", "q8_0")}, 3))
    with pytest.raises(ConfigError, match="the plan has nvfp4"):
        ik_llama_export(Plan({0: ("nvfp4", "nvfp4")}, 1))


def test_a_per_layer_config_exports_by_code_bits_and_says_it_changed(tmp_path):
    """The per-layer target's config (kvlens layouts) in the engines' forms: 2/4-bit tensors
    map to nvfp4 (ggml: q4_0), 8-bit to fp8 (q8_0), unquantized stay f16; every export says
    the quantizer changed, and the vLLM command parses back to the mapped plan. The config
    each engine runs holds the engine's types per layer: the vLLM and TensorRT-LLM ones as
    engine settings, ik_llama.cpp's first/last mix as a config file beside the output."""
    from kvlens.config import KVConfig, LayerKV
    from kvlens.deploy.plans import layer_exports
    from kvlens.deploy.presets import engine_config
    from kvlens.model.shape import ModelShape
    from kvlens.quant import QuantSpec

    cfg = KVConfig("mix", LayerKV(QuantSpec(2, "per-channel", 32), QuantSpec(4, "per-token", 32),
                                  residual_tokens=64),
                   {1: LayerKV(QuantSpec(8, "per-token", 32), QuantSpec(8, "per-token", 32)),
                    3: LayerKV()})
    shape = ModelShape(4, 4, 2, 64, model_type="llama")
    made = layer_exports(cfg, shape, out=tmp_path / "kv.json", command=lambda x: f"measure {x}")
    trt, vllm, ik = made.documents
    assert [e["engine"] for e in (trt, vllm, ik)] == ["trtllm", "vllm", "ik_llama.cpp"]
    assert all(not e["expressible"] and e["changes"][0].startswith("every layer: kvlens'")
               and e["kld"]["kld"] is None and e["kld"]["source"] == "not measured"
               for e in (trt, vllm, ik))
    plan = Plan({0: ("nvfp4", "nvfp4"), 1: ("fp8", "fp8"), 2: ("nvfp4", "nvfp4"),
                 3: ("f16", "f16")}, 4)
    assert _vllm_layers(vllm["command"], plan) == {0: ("nvfp4",) * 2, 1: ("f16",) * 2,
                                                   2: ("nvfp4",) * 2, 3: ("f16",) * 2}
    assert 'dtype="fp8"' in trt["command"]
    # q4_0, q8_0, q4_0, f16 per layer is not first/base/last: layer 2 raised to q8_0, named
    assert _ik_layers(ik["command"], 4) == {0: ("q4_0",) * 2, 1: ("q8_0",) * 2,
                                            2: ("q8_0",) * 2, 3: ("f16",) * 2}
    assert ik["changes"][1].startswith("layer 2: q4_0 -> q8_0")
    # what each engine runs, per layer, in the engine settings' own layers
    c_trt, c_vllm, c_ik = made.configs
    assert trt["kld"]["setting"] == "trtllm:fp8:s1" and vllm["kld"]["setting"] == \
        "vllm:nvfp4:s1:skip=1,3" and ik["kld"]["setting"] is None
    assert trt["kld"]["command"] == "measure trtllm:fp8:s1"
    nvfp4 = engine_config("vllm:nvfp4:s1").config.default
    f16 = engine_config("vllm:fp8:s1:skip=0").config.layer(0)
    assert [c_vllm.layer(i) for i in range(4)] == [nvfp4, f16, nvfp4, f16]
    assert {c_trt.layer(i).key_type.name for i in range(4)} == {"fp8_e4m3:s1"}
    ll = {t: engine_config(f"llamacpp:{t}/{t}:norot").config for t in ("q4_0", "q8_0")}
    assert [c_ik.layer(i) for i in range(4)] == [ll["q4_0"].default, ll["q8_0"].default,
                                                 ll["q8_0"].default, LayerKV(
                                                     key_format="f16", value_format="f16")]
    assert c_ik.engine_attention == ll["q4_0"].engine_attention is not None
    path = tmp_path / "kv.ik_llama.cpp.json"
    assert made.files == {path: c_ik, tmp_path / "kv.hf_quant_config.json": made.files[
        tmp_path / "kv.hf_quant_config.json"]} and ik["kld"]["command"] == f"measure {path}"
    # bits at the context: each layer's type held as the engine holds it, no window
    for doc, types in ((trt, ["fp8_e4m3"] * 4), (vllm, ["nvfp4", "f16", "nvfp4", "f16"]),
                       (ik, ["q4_0", "q8_0", "q8_0", "f16"])):
        assert doc["kld"]["bits_per_element"] == pytest.approx(
            sum(map(type_bits, types)) / 4, abs=1e-3), doc["engine"]
