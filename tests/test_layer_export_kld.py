"""The per-layer target's engine exports state the KLD of what each engine will actually run
(``kvlens.deploy.plans.layer_exports``, ``measure_layer_exports``): with ``--validate`` each
distinct config an engine runs is measured once on the validation's held-out tokens; without
it, the export names the command that measures it, and that command works."""

from __future__ import annotations

import json
import shlex

from helpers import tiny_capture
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.config import KVConfig, LayerKV
from kvlens.deploy.plans import layer_exports, measure_layer_exports
from kvlens.model.shape import ModelShape
from kvlens.quant import QuantSpec

runner = CliRunner()


def test_a_config_two_exports_run_is_measured_once():
    """Every tensor 4-bit: vLLM runs nvfp4 everywhere, as TensorRT-LLM does (one config, two
    names), ik_llama.cpp q4_0: two configs measured, across two recommendations too, and each
    export gets its own config's figure."""
    shape = ModelShape(3, 4, 2, 64, model_type="llama")
    spec = QuantSpec(4, "per-token", 32)
    made = [layer_exports(KVConfig(name, LayerKV(spec, spec)), shape) for name in ("a", "b")]
    asked = []

    def measure(configs):
        asked.append([c.name for c in configs])
        return [{"mean_kld": 0.1 * (j + 1), "ci95": [0.0, 1.0]} for j in range(len(configs))]

    measure_layer_exports(made, measure)  # two distinct configs, measured at once
    assert asked == [["trtllm:nvfp4:s1", "llamacpp:q4_0/q4_0:norot"]]
    for ex in made:
        trt, vllm, ik = (d["kld"] for d in ex.documents)
        assert vllm["setting"] == "vllm:nvfp4:s1" and trt["kld"] == vllm["kld"] == 0.1
        assert ik["kld"] == 0.2 and {trt["source"], ik["source"]} == {"measured"}


def test_an_export_that_quantizes_nothing_is_not_measured():
    """8-bit keys, 4-bit values on every layer: vLLM's one dtype (nvfp4) fits no layer, so it
    skips them all and runs the model's own cache, said so and not measured; TensorRT-LLM
    runs fp8 everywhere, ik_llama.cpp q8_0 keys and q4_0 values, both measured."""
    shape = ModelShape(3, 4, 2, 64, model_type="llama")
    cfg = KVConfig("kv", LayerKV(QuantSpec(8, "per-token", 32), QuantSpec(4, "per-token", 32)))
    made = layer_exports(cfg, shape)
    trt, vllm, ik = made.documents
    assert made.configs[1] is None and vllm["kld"]["bits_per_element"] == 16.0
    assert "every layer runs unquantized" in vllm["kld"]["source"]
    asked = []
    measure_layer_exports([made], lambda cs: asked.extend(c.name for c in cs) or [
        {"mean_kld": 0.5, "ci95": [0.4, 0.6]} for _ in cs])
    assert asked == ["trtllm:fp8:s1", "llamacpp:q8_0/q4_0:norot"]
    assert vllm["kld"]["kld"] is None and trt["kld"]["kld"] == ik["kld"]["kld"] == 0.5


def test_validate_measures_what_each_engine_runs_and_the_command_reproduces_it(
        tiny_model_dir, tmp_path):
    """On a tiny model: with --validate the vLLM and TensorRT-LLM exports' KLD is measured on
    the validation's tokens, and differs from the chosen config's (the mapping changes every
    layer's quantizer); ik_llama.cpp's q4_0 blocks do not fit head_dim 16 and say so. Without
    --validate the export is not measured and names a command, which run gives the same
    figure."""
    cap = tiny_capture(tiny_model_dir, tmp_path)
    common = ["recommend", str(cap), "-b", "6", "--context", "512", "--windows", "16", "--set",
              "group-sizes=16", "--model", str(tiny_model_dir), "--json"]
    res = runner.invoke(app, [*common, "--validate", "--eval-tokens", "96"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    chosen = next(r for r in doc["validation"] if r["name"] == doc["config"]["name"])
    chosen_kld = chosen["kld"]["mean_kld"]["value"]
    trt, vllm, ik = (e["kld"] for e in doc["exports"])
    for k in (trt, vllm):
        assert k["source"] == "measured" and k["kld"] > 0 and k["kld"] != chosen_kld, k
        assert k["ci95"][0] <= k["kld"] <= k["ci95"][1]
        assert "--eval-tokens 96" in k["command"] and k["setting"] in k["command"]
    assert ik["kld"] is None and ik["source"].startswith("not measurable here")
    assert ik["command"] is None
    # not measured without --validate: the command it names (at the default held-out tokens)
    # gives the same figure on the same tokens
    res = runner.invoke(app, [*common, "-o", str(tmp_path / "kv.json")])
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)["exports"][1]["kld"]
    written = json.loads((tmp_path / "kv.hf_quant_config.json").read_text())  # trtllm's file
    assert written["quantization"]["kv_cache_quant_algo"] in ("FP8", "NVFP4", "MIXED_PRECISION")
    assert again["kld"] is None and again["source"] == "not measured"
    assert again["command"] == vllm["command"].replace(" --eval-tokens 96", "")
    words = shlex.split(again["command"])
    assert words[:2] == ["kvlens", "generate"]
    res = runner.invoke(app, [*words[1:], "--eval-tokens", "96", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["results"][0]["kld"]["mean_kld"]["value"]
    assert abs(got - vllm["kld"]) <= 1e-6 * max(1.0, vllm["kld"])


def test_the_modelopt_file_a_trtllm_export_names_is_written_beside_the_config(tmp_path):
    """The per-layer target's TensorRT-LLM export names ModelOpt's hf_quant_config.json: it is
    one of the files written beside the config (under the config's stem, so that several
    budgets' configs can share a folder), holding the plan; without an output path the export
    says how to get it instead of naming a file that is never written."""
    shape = ModelShape(3, 4, 2, 64, model_type="llama")
    spec8, spec4 = QuantSpec(8, "per-token", 32), QuantSpec(4, "per-token", 32)
    cfg = KVConfig("kv", LayerKV(spec4, spec4), {1: LayerKV(spec8, spec8)})
    out = tmp_path / "kv.json"
    made = layer_exports(cfg, shape, out=out)
    trt = made.documents[0]
    assert trt["engine"] == "trtllm"
    assert trt["files"] == [str(tmp_path / "kv.hf_quant_config.json")]
    text = made.files[tmp_path / "kv.hf_quant_config.json"]
    quant = json.loads(text)["quantization"]
    assert quant["kv_cache_quant_algo"] == "MIXED_PRECISION"
    assert any("copy it into the model folder as hf_quant_config.json" in n for n in trt["notes"])
    unwritten = layer_exports(cfg, shape).documents[0]
    assert unwritten["files"] == [] and "give --output to write hf_quant_config.json" in \
        unwritten["notes"]
