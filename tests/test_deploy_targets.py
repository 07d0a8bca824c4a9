"""``recommend --target``: engine menus, planted answers, the KLD predictor, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import SCALING, write_capture
from typer.testing import CliRunner

from kvlens.capture.store import CaptureMeta, LayerAttrs
from kvlens.cli import app
from kvlens.config import load_config
from kvlens.config.engine import parse_engine_setting
from kvlens.deploy.kld_model import fit_kld_model
from kvlens.deploy.targets import TargetOptions, pareto, recommend_target
from kvlens.errors import ConfigError, InputError
from kvlens.model.shape import ModelShape

runner = CliRunner()
HQ, HKV, T, D = 4, 2, 64, 64


def _capture(path, layers: list[tuple]) -> str:
    """A synthetic capture with its own (q, k, v) per layer."""
    meta = CaptureMeta(model="synthetic",
                       shape=ModelShape(len(layers), HQ, HKV, D, model_type="llama",
                                        has_rope=False),
                       rope_layout="none", rotary_dim=0,
                       compute_dtype="float32", storage_dtype="float32", num_samples=1,
                       num_tokens=T, layers=tuple(range(len(layers))))
    data = {i: {"q": q, "k": k, "v": v, "q_pre": q, "k_pre": k}
            for i, (q, k, v) in enumerate(layers)}
    attrs = {i: LayerAttrs(i, SCALING, 0, 0.0) for i in range(len(layers))}
    write_capture(path, meta, data, layer_attrs=attrs)
    return str(path)


def _normal(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HQ, T, D, generator=g), torch.randn(1, HKV, T, D, generator=g),
            torch.randn(1, HKV, T, D, generator=g))


@pytest.fixture(scope="module")
def offset_capture(tmp_path_factory):
    """Keys on a large offset (100 + U[0, 1)): only a type that stores a minimum (q4_1, q5_1)
    keeps them at 4-5 bits."""
    layers = []
    for seed in range(2):
        q, k, v = _normal(seed)
        k = 100 + torch.rand(k.shape, generator=torch.Generator().manual_seed(9 + seed))
        layers.append((q, k, v))
    return _capture(tmp_path_factory.mktemp("t") / "offset.h5", layers)


@pytest.fixture(scope="module")
def outlier_capture(tmp_path_factory):
    """Layer 2's keys are tiny (1e-4) with one huge outlier (1e4): a per-tensor fp8 scale
    flushes them to zero, so skipping layer 2 is the best single skip."""
    layers = [_normal(s) for s in range(4)]
    q, k, v = layers[2]
    k = k * 1e-4
    k[0, 0, 0, 0] = 1e4
    layers[2] = (q * 1e4, k, v)
    return _capture(tmp_path_factory.mktemp("t") / "outlier.h5", layers)


def test_kld_model_recovers_a_planted_power_law():
    pts = [(s, 0.3 * s ** 1.2) for s in (0.01, 0.1, 0.5, 2.0)]
    m = fit_kld_model(pts)
    assert m.c == pytest.approx(0.3) and m.alpha == pytest.approx(1.2)
    assert m.log_rmse == pytest.approx(0.0, abs=1e-12)
    assert m.predict(1.0) == pytest.approx(0.3)
    one = fit_kld_model([(0.2, 0.01), (0.0, 0.5)])  # S = 0 carries no information
    assert one.alpha == 1.0 and one.predict(0.4) == pytest.approx(0.02)
    with pytest.raises(InputError, match="no setting"):
        fit_kld_model([(0.0, 0.1)])
    noisy = fit_kld_model([(1.0, 0.1 * 1.1), (1.0, 0.1 / 1.1)])  # same S: alpha 1, c 0.1
    assert noisy.c == pytest.approx(0.1) and noisy.log_rmse == pytest.approx(math.log(1.1))


def test_llamacpp_picks_the_type_with_a_minimum_for_offset_keys(offset_capture):
    """Without the rotation (LLAMA_ATTN_ROT_DISABLE=1), at 4.75 bits (one 5-bit and one
    4.5-bit type) the offset keys get q4_1; the front is monotone."""
    rec = recommend_target(offset_capture, TargetOptions("llama.cpp", budget_bits=4.75,
                                                         rotation=False))
    c = rec.chosen
    assert c.deploy["cache_type_k"] == "q4_1" and c.bits <= 4.75
    assert c.deploy["command"].startswith("LLAMA_ATTN_ROT_DISABLE=1 llama-server -m MODEL.gguf "
                                          "-ctk q4_1 -ctv ")
    assert c.deploy["env"] == {"LLAMA_ATTN_ROT_DISABLE": "1"}
    assert c.setting.endswith(":norot") and c.config.default.key_format == "q4_1+norot"
    assert rec.candidates == 49
    bits = [f.bits for f in rec.front]
    scores = [f.score for f in rec.front]
    assert bits == sorted(bits) and scores == sorted(scores, reverse=True)
    # f16 is not exact for keys near 100 (step 1/16): q5_1's stored minimum beats it
    assert rec.front[-1].setting == "llamacpp:q5_1/f16:norot"
    rot = recommend_target(offset_capture, TargetOptions("llama.cpp", budget_bits=4.75))
    assert "env" not in rot.chosen.deploy and rot.chosen.config.default.key_format in (
        "q4_1", "q4_0", "iq4_nl", "q5_0")


def test_vllm_skips_the_layer_a_per_tensor_scale_ruins(outlier_capture):
    rec = recommend_target(outlier_capture, TargetOptions("vllm", budget_bits=10.1))
    c = rec.chosen
    assert c.deploy["skip_layers"] == [2]
    assert "--kv-cache-dtype-skip-layers 2" in c.deploy["command"]
    assert rec.where_it_hurts(1)[0]["layer"] != 2
    assert bool(c.config.kv_scales) == ("kv_scales.json" in rec.files)
    # the calibrated fp8_e4m3 candidate with layer 2 skipped: its scale file has no layer 2
    from dataclasses import replace

    from kvlens.deploy.targets import candidates_for, measure_errors, scale_files

    opts = TargetOptions("vllm", budget_bits=10.1)
    meta, table, sc = measure_errors(outlier_capture, "vllm", opts)
    cand = next(x for x in candidates_for("vllm", meta, table, sc, opts)
                if x.setting == "vllm:fp8_e4m3:skip=2")
    scales = json.loads(scale_files(replace(rec, chosen=cand), meta)["kv_scales.json"])
    assert set(scales) == {f"model.layers.{i}.self_attn.{t}_scale" for i in (0, 1, 3)
                           for t in "kv"}
    k0 = sc[0][("key", "fp8_e4m3")][0]
    assert scales["model.layers.0.self_attn.k_scale"] == k0 > 0
    with pytest.raises(ConfigError, match="the cheapest, vllm:nvfp4:s1, holds 4.50"):
        recommend_target(outlier_capture, TargetOptions("vllm", budget_bits=4.0))


def test_max_kld_takes_the_cheapest_setting_under_the_fitted_prediction(offset_capture,
                                                                         monkeypatch):
    """Anchors 'measured' as KLD = 0.5 * S: the fit recovers it and the choice is the
    cheapest front setting with 0.5 * S <= X."""
    import kvlens.deploy.targets as targets

    def fake_measure(bundle, configs, eval_tokens, progress=None):
        out = []
        for cfg in configs:
            cand = next(f for f in front if f.config is cfg)
            out.append({"setting": cfg.name, "mean_kld": 0.5 * cand.score, "ci95": [0, 1],
                        "bits_per_element": cand.bits, "top1_agreement": 1.0})
        return out

    base = recommend_target(offset_capture, TargetOptions("llama.cpp", budget_bits=16))
    front = base.front
    monkeypatch.setattr(targets, "measure_kld", fake_measure)
    monkeypatch.setattr(targets, "pareto", lambda cands: front)
    # a hair above an anchor's 0.5 * S: the fitted c and alpha are equal to 0.5 and 1 only
    # up to floating-point rounding, which must not decide whether that anchor qualifies
    x = 0.5 * sorted(f.score for f in front if f.score > 0)[1] * (1 + 1e-6)
    rec = recommend_target(offset_capture, TargetOptions("llama.cpp", max_kld=x),
                           model_bundle=("model", "tok"))
    assert rec.kld_model.c == pytest.approx(0.5) and rec.kld_model.alpha == pytest.approx(1.0)
    ok = [f for f in front if 0.5 * f.score <= x]
    assert rec.chosen.bits == min(f.bits for f in ok)
    # the choice's prediction is the one made before it was measured (an anchor has none)
    assert rec.predicted_kld == rec.measured_kld["predicted_kld"]
    assert rec.predicted_kld is None or rec.predicted_kld <= x * (1 + 1e-9)
    # the choice is measured: an anchor, or a check measured after the anchors
    assert rec.measured_kld["setting"] == rec.chosen.setting
    assert rec.measured_kld["mean_kld"] == pytest.approx(0.5 * rec.chosen.score)
    assert rec.measured_kld["mean_kld"] <= x
    doc = rec.to_dict()
    assert doc["measured_kld"] == rec.measured_kld["mean_kld"]
    assert doc["measured_kld_ci95"] == [0, 1]
    assert {f["setting"] for f in doc["front"] if f["measured_kld"] is not None} == \
        {a["setting"] for a in rec.anchors}
    calls = []
    monkeypatch.setattr(targets, "measure_kld", lambda *a, **k: calls.append(a) or [])
    got = targets.validate(rec, ("model", "tok"), rec.measured_kld["eval_tokens"])
    assert calls == [] and got["mean_kld"] == rec.measured_kld["mean_kld"]  # not twice
    monkeypatch.setattr(targets, "measure_kld", fake_measure)
    with pytest.raises(ConfigError, match="raise max_kld"):
        recommend_target(offset_capture, TargetOptions("llama.cpp", max_kld=-0.0 + 1e-300),
                         model_bundle=("model", "tok"))


def test_vllm_cpu_target_searches_the_truncating_writer(outlier_capture):
    """--target vllm:cpu (vLLM's CPU build): the same dtypes truncated to fp8, which lose more
    than the GPU writer's rounding on every layer; the answer is a :cpu setting, deployed with
    the same vllm command on the CPU build, and no nvfp4 is offered."""
    from kvlens.deploy.targets import canonical_target, measure_errors

    assert canonical_target("VLLM-CPU") == canonical_target("vllm:cpu") == "vllm:cpu"
    rec = recommend_target(outlier_capture, TargetOptions("vllm:cpu", budget_bits=10.1))
    assert rec.target == "vllm:cpu" and ":cpu" in rec.chosen.setting
    assert rec.chosen.deploy["command"].startswith("vllm serve MODEL --kv-cache-dtype fp8")
    assert "vllm-cpu" in rec.chosen.deploy["build"]
    assert all("nvfp4" not in c.setting for c in rec.front)
    assert bool(rec.chosen.config.kv_scales) == ("kv_scales.json" in rec.files)
    cpu = measure_errors(outlier_capture, "vllm:cpu", TargetOptions("vllm:cpu", budget_bits=9))[1]
    gpu = measure_errors(outlier_capture, "vllm", TargetOptions("vllm", budget_bits=9))[1]
    for c_row, g_row in zip(cpu, gpu):
        for t in ("key", "value"):
            assert c_row[(t, "fp8_e5m2:s1:trunc")] > g_row[(t, "fp8_e5m2:s1")]


def test_cli_max_kld_says_which_kld_is_measured_and_which_predicted(outlier_capture,
                                                                    monkeypatch):
    """`recommend --target vllm --max-kld X` ('measured' here as KLD = 0.5 * S, X just
    above a setting that is not an anchor): the choice is checked, printed with its measured
    KLD beside the prediction, the front shows both columns, the anchors list marks the check;
    --json carries the same figures under their own keys, and the export runs the measured
    figure."""
    import kvlens.deploy.answer as answer
    import kvlens.deploy.targets as targets
    from kvlens.deploy.kld_search import spread_anchors

    class Loaded:
        def __init__(self, *a, **k):
            pass

        def get(self):
            return ("model", "tok")

    def fake_measure(bundle, configs, eval_tokens, progress=None):
        return [{"setting": c.name, "mean_kld": 0.5 * scores[c.name], "ci95": [0.0, 1.0],
                 "bits_per_element": 0.0, "top1_agreement": 1.0} for c in configs]

    front = recommend_target(outlier_capture, TargetOptions("vllm", budget_bits=16)).front
    scores = {f.setting: f.score for f in front}
    monkeypatch.setattr(answer, "CaptureModel", Loaded)
    monkeypatch.setattr(targets, "measure_kld", fake_measure)
    anchors = {c.setting for c in spread_anchors(front, 3)}
    target = next(f for f in sorted(front, key=lambda f: f.bits) if f.setting not in anchors
                  and f.score < max(scores.values()))
    x = 0.5 * target.score * (1 + 1e-6)
    args = ["recommend", outlier_capture, "--target", "vllm", "--max-kld", f"{x!r}",
            "--eval-tokens", "64"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert f"simulated as {target.setting}:" in out
    assert f"measured KLD {0.5 * target.score:.4f} [0.0000, 1.0000] on 64 held-out tokens " \
           f"(predicted {0.5 * target.score:.4f} before it was measured)" in out
    assert "pred. KLD" in out and "meas. KLD" in out
    assert f"{target.setting}: S {target.score:.4g}, measured KLD" in out and "(checked: " \
        "predicted" in out
    assert "KLD check 1/4" in res.output  # progress on stderr
    doc = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert doc["setting"] == target.setting
    assert doc["measured_kld"] == pytest.approx(0.5 * target.score)
    assert doc["predicted_kld"] == pytest.approx(0.5 * target.score)
    roles = {a["setting"]: a["role"] for a in doc["anchors"]}
    assert roles == {**dict.fromkeys(anchors, "anchor"), target.setting: "check"}
    assert [(e["kld"]["source"], e["kld"]["kld"]) for e in doc["deploy"]["exports"]] == [
        ("measured", doc["measured_kld"])]


def test_pareto_drops_dominated_settings():
    from kvlens.deploy.targets import TargetCandidate

    def cand(bits, err):
        return TargetCandidate(f"{bits}/{err}", None, bits, [(err, 0.0)], {})

    front = pareto([cand(4.5, 0.3), cand(5.0, 0.4), cand(6.0, 0.1), cand(4.5, 0.2)])
    assert [f.setting for f in front] == ["4.5/0.2", "6.0/0.1"]


def test_options_are_checked():
    with pytest.raises(ConfigError, match="allowed: kvlens, llama.cpp, vllm, sglang"):
        TargetOptions("tensorrt", budget_bits=8)
    with pytest.raises(InputError, match="budget_bits B .* or max_kld X"):
        TargetOptions("vllm")


def test_cli_target_json_writes_config_and_scales(outlier_capture, tmp_path):
    out = tmp_path / "kv.json"
    result = runner.invoke(app, ["recommend", outlier_capture, "--target", "sglang",
                                 "--budget-bits", "9", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["deploy"]["target"] == "sglang"
    assert doc["deploy"]["command"].startswith("python -m sglang.launch_server")
    cfg = load_config(out)
    assert cfg.default.key_format.startswith("fp8_e")
    artifact = json.loads((tmp_path / "kv.deploy.json").read_text())  # for kvlens report
    assert artifact["kvlens_report"] == "deploy" and artifact["deploy"] == doc["deploy"]
    if cfg.kv_scales:
        scales = json.loads((tmp_path / "kv_scales.json").read_text())
        assert scales["kv_cache"]["dtype"] == "float8_e4m3fn"
        assert set(scales["kv_cache"]["scaling_factor"]["0"]) == {"0", "1", "2", "3"}
        for s in cfg.kv_scales.values():
            assert s["key"] == s["value"]  # SGLang: one scale per layer
    table = runner.invoke(app, ["recommend", outlier_capture, "--target", "llama.cpp",
                                "--budget-bits", "6"])
    assert table.exit_code == 0, table.output
    assert "Deploy on llama.cpp: llama-server" in table.stdout and "Where it hurts" in \
        table.stdout


def test_cli_target_transformers_writes_the_cache_stock_transformers_loads(outlier_capture,
                                                                           tmp_path):
    """Beside the config, the per-layer cache file: one transformers layer per capture layer
    with the chosen setting's arguments; the table prints the snippet that loads it."""
    out = tmp_path / "kv.json"
    result = runner.invoke(app, ["recommend", outlier_capture, "--target", "transformers",
                                 "--budget-bits", "5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    setting = parse_engine_setting(json.loads((tmp_path / "kv.deploy.json").read_text())
                                   ["setting"])
    cache = json.loads((tmp_path / "transformers_cache.json").read_text())
    assert cache["format"] == "kvlens-transformers-cache" and cache["num_layers"] == 4
    assert cache["layers"] == [{"class": "QuantoQuantizedLayer",
                                "kwargs": setting.cache_kwargs()}] * 4
    assert "cache_utils.Cache(layers=" in result.stdout
    again = runner.invoke(app, ["recommend", outlier_capture, "--target", "transformers",
                                "--budget-bits", "5", "-o", str(tmp_path / "kv2.json")])
    assert again.exit_code == 1 and "transformers_cache.json" in again.output


def test_cli_target_errors(outlier_capture):
    result = runner.invoke(app, ["recommend", outlier_capture, "--target", "tgi",
                                 "--budget-bits", "8"])
    assert result.exit_code == 1 and "allowed: kvlens, llama.cpp" in result.output
    result = runner.invoke(app, ["recommend", outlier_capture])
    assert result.exit_code == 1 and "takes one of --budget-bits" in result.output


@pytest.mark.parametrize("target,rotation", [("llama.cpp", True), ("llama.cpp", False),
                                             ("vllm", True), ("sglang", True),
                                             ("transformers", True), ("trtllm", True),
                                             ("vllm:cpu", True)])
def test_every_printed_setting_resolves_in_generate_to_the_same_config(outlier_capture, target,
                                                                       rotation):
    """What `recommend --target` prints (``TargetCandidate.setting``) is the engine-setting
    name `generate --compare` reads (``is_engine_setting`` + ``engine_config``, with
    ``--calibration`` the capture recommend measured): the same config, calibrated scales
    included; and its canonical spelling."""
    from kvlens.config import is_engine_setting
    from kvlens.config.engine import parse_engine_setting
    from kvlens.deploy import engine_config
    from kvlens.deploy.targets import candidates_for, measure_errors

    opts = TargetOptions(target, budget_bits=16, rotation=rotation)
    meta, table, scales = measure_errors(outlier_capture, target, opts)
    cands = candidates_for(target, meta, table, scales, opts)
    assert len(cands) >= 3
    for cand in cands:
        if cand.config.layers and target == "trtllm":  # a per-layer mix: no engine setting,
            assert "+" in cand.setting  # its config runs it (and its exports say where)
            continue
        assert is_engine_setting(cand.setting)
        assert parse_engine_setting(cand.setting).name == cand.setting
        got = engine_config(cand.setting, calibration=outlier_capture).config.to_dict()
        want = cand.config.to_dict()
        got.pop("description"), want.pop("description")
        assert got == want, cand.setting


def test_generate_compare_accepts_what_recommend_prints(outlier_capture, monkeypatch):
    """The CLI path: every vLLM setting recommend prints is accepted by `generate --compare`
    (parsing happens before the model's files are read, which is stopped here: the capture's
    scales do not fit the default model)."""
    import kvlens.model.header
    import kvlens.model.load
    from kvlens.deploy.targets import candidates_for, measure_errors
    from kvlens.errors import ModelLoadError

    def stop(*a, **k):
        raise ModelLoadError("stopped after parsing")

    monkeypatch.setattr(kvlens.model.load, "load_model", stop)
    monkeypatch.setattr(kvlens.model.header, "read_header", stop)
    opts = TargetOptions("vllm", budget_bits=16)
    names = [c.setting for c in candidates_for("vllm", *measure_errors(outlier_capture, "vllm",
                                                                       opts), opts)]
    assert "vllm:fp8_e4m3:s1:skip=2" in names and "vllm:fp8_e5m2:s1" in names
    result = runner.invoke(app, ["generate", "--compare", ",".join(names), "--calibration",
                                 outlier_capture, "--prompt", "x"])
    assert result.exit_code == 1
    assert "stopped after parsing" in result.output and "Unknown" not in result.output


def test_llamacpp_key_errors_see_the_query_in_the_key_types_dot_product_type():
    """recommend --target llama.cpp measures a key type with the query llama.cpp dots with it:
    rotated, through q8_0 (q4_0 keys), rotated back; f16 keys keep the float query."""
    import torch

    from kvlens.deploy.targets import _llamacpp_query
    from kvlens.quant import engine_rotation
    from kvlens.quant.cachetypes import parse_cache_type
    from kvlens.quant.ggml import GGML_FORMATS, dequantize_ggml, quantize_ggml

    q = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(0))
    r = engine_rotation("key", 64)
    got = _llamacpp_query(q, parse_cache_type("q4_0"), "q4_0")
    ref = dequantize_ggml(quantize_ggml(q @ r, GGML_FORMATS["q8_0"])) @ r.T
    assert torch.allclose(got, ref, atol=1e-6)
    assert not torch.allclose(got, q, atol=1e-4)
    plain = _llamacpp_query(q, parse_cache_type("q4_0+norot"), "q4_0")
    assert torch.allclose(plain, dequantize_ggml(quantize_ggml(q, GGML_FORMATS["q8_0"])))
    assert _llamacpp_query(q, parse_cache_type("f16"), "f16") is q


def test_target_names_take_the_engine_setting_spelling_and_suggest_the_closest():
    """--target llamacpp is llama.cpp (as engine settings spell it, llamacpp:q8_0), names are
    case-insensitive, and an unknown name gets the closest target and every allowed one."""
    from kvlens.deploy.targets import TARGETS, TargetOptions, canonical_target
    from kvlens.errors import ConfigError

    assert canonical_target("llamacpp") == canonical_target("LLAMA.CPP") == "llama.cpp"
    assert TargetOptions(target="llamacpp", budget_bits=4.0).target == "llama.cpp"
    with pytest.raises(ConfigError) as err:
        canonical_target("vlm")
    message = str(err.value)
    assert "Unknown target 'vlm' (did you mean 'vllm'?); allowed:" in message
    assert all(t in message for t in TARGETS)
    with pytest.raises(ConfigError, match="Unknown target 'tgi'; allowed: kvlens") as err:
        canonical_target("tgi")
    assert "did you mean" not in str(err.value)


def test_trtllm_target_writes_modelopts_file_and_the_exports(outlier_capture, tmp_path):
    """--target trtllm: the KvCacheConfig dtype to run, ModelOpt's hf_quant_config.json beside
    the config (valid JSON, ModelOpt's field names, one entry per attention layer) and the
    per-layer exports, each saying what it runs and the KLD's source."""
    out = tmp_path / "kv.json"
    result = runner.invoke(app, ["recommend", outlier_capture, "--target", "tensorrt-llm",
                                 "--budget-bits", "9", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    d = doc["deploy"]
    assert doc["target"] == "trtllm" and d["target"] == "trtllm"
    assert 'kv_cache_config=KvCacheConfig(dtype="fp8")' in d["command"]
    q = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert q["kv_cache_quant_algo"] in ("FP8", "NVFP4", "MIXED_PRECISION")
    assert set(q["kv_cache_quantized_layers"]) == {f"model.layers.{i}.self_attn"
                                                   for i in range(4)}
    assert [e["engine"] for e in d["exports"]] == ["trtllm", "vllm"]
    for ex in d["exports"]:
        assert ex["kld"]["source"].startswith("not measured")  # no --max-kld, no --validate
        assert ex["kld"]["score"] >= 0
    cfg = load_config(out)
    assert cfg.default.key_format == "fp8_e4m3:s1"
    again = runner.invoke(app, ["recommend", outlier_capture, "--target", "trtllm",
                                "--budget-bits", "9", "-o", str(tmp_path / "other.json")])
    assert again.exit_code == 1 and "hf_quant_config.json" in again.output  # not overwritten


def test_an_inexpressible_export_carries_the_kld_of_what_runs(outlier_capture, monkeypatch):
    """A plan vLLM cannot run (two quantized dtypes) exports as the nearest one it can, and
    its KLD is that plan's: predicted from its own score on the error table (labelled), or
    measured when the command validates."""
    from kvlens.deploy.exports import Plan
    from kvlens.deploy.kld_model import fit_kld_model
    from kvlens.deploy.plans import engine_exports

    rec = recommend_target(outlier_capture, TargetOptions("vllm", budget_bits=16))
    rec.kld_model = fit_kld_model([(0.1, 0.05), (1.0, 0.5)])  # KLD = 0.5 S
    # the chosen vLLM plan, with layer 1 asking for f16 keys but fp8 values: not one dtype
    rec.chosen.plan = Plan({**rec.chosen.plan.layers, 1: ("f16", "fp8_e4m3")},
                           rec.chosen.plan.num_layers)
    ex = engine_exports(rec)[0]
    assert not ex["expressible"] and ex["changes"][0].startswith("layer 1:")
    assert ex["kld"]["source"] == "predicted"
    # layer 1 runs unquantized: 0, as a skipped layer scores in the vLLM candidates
    runs_score = sum(e[0] ** 2 + e[1] ** 2 for i, e in enumerate(rec.chosen.errors) if i != 1)
    assert runs_score < rec.chosen.score or rec.chosen.errors[1] == (0.0, 0.0)
    assert ex["kld"]["score"] == pytest.approx(runs_score)
    assert ex["kld"]["kld"] == pytest.approx(0.5 * runs_score)
    measured = engine_exports(rec, None, lambda cfgs: [{"mean_kld": 0.123, "ci95": [0.1, 0.2],
                                                       "setting": cfgs[0].name}])[0]
    assert measured["kld"]["source"] == "measured" and measured["kld"]["ci95"] == [0.1, 0.2]
    assert measured["kld"]["kld"] == 0.123


@pytest.fixture(scope="module")
def spiky_capture(tmp_path_factory):
    """Layer 1's keys carry one large channel (40) beside values near 0.5: an NVFP4 block
    scale set by that channel rounds the rest of its 16 channels to zero, while fp8's
    per-element exponent keeps them. The other layers are plain normals."""
    layers = [_normal(s) for s in range(4)]
    q, k, v = layers[1]
    k = 0.5 * k
    k[..., 3] = 40.0
    layers[1] = (q, k, v)
    return _capture(tmp_path_factory.mktemp("t") / "spiky.h5", layers)


def test_trtllm_mixes_nvfp4_with_fp8_where_nvfp4_fails(spiky_capture):
    """Between NVFP4 everywhere (4.5 bits) and fp8 everywhere (8), the per-layer mix at 5.375
    bits raises exactly the layer NVFP4 ruins; TensorRT-LLM cannot run the mix, so its export
    runs fp8 everywhere and names the layers that changed."""
    rec = recommend_target(spiky_capture, TargetOptions("trtllm", budget_bits=5.4))
    c = rec.chosen
    assert c.setting == "trtllm:nvfp4:s1+fp8_e4m3@1" and c.bits == pytest.approx(5.375,
                                                                                abs=1e-3)
    assert c.plan.layers[1] == ("fp8_e4m3", "fp8_e4m3") and c.plan.layers[0] == ("nvfp4",) * 2
    assert {"trtllm:nvfp4:s1", "trtllm:fp8:s1"} <= {f.setting for f in rec.front}
    nvfp4 = next(f for f in rec.front if f.setting == "trtllm:nvfp4:s1")
    assert nvfp4.errors[1][0] > 5 * c.errors[1][0]  # layer 1's keys: what the mix fixes
    from kvlens.deploy.plans import engine_exports

    trt, vllm = engine_exports(rec)
    assert not trt["expressible"] and trt["runs"] == {str(i): "fp8_e4m3" for i in range(4)}
    assert trt["changes"][0].startswith("layers 0, 2, 3: nvfp4 -> fp8_e4m3")
    assert vllm["command"].endswith("--kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers 1")
    q = json.loads(rec.files["hf_quant_config.json"])["quantization"]
    assert q["kv_cache_quant_algo"] == "MIXED_PRECISION"
    assert q["kv_cache_quantized_layers"]["model.layers.1.self_attn"] == {"quant_algo": "FP8"}
    assert 'dtype="fp8"' in c.deploy["command"]


def test_vllm_answers_nvfp4_with_the_layers_it_ruins_skipped(spiky_capture):
    """recommend --target vllm considers nvfp4: under 7.5 bits (fp8 holds 8) the answer is
    nvfp4 with layer 1 skipped, printed as vLLM parses it."""
    rec = recommend_target(spiky_capture, TargetOptions("vllm", budget_bits=7.5))
    c = rec.chosen
    assert c.setting == "vllm:nvfp4:s1:skip=1" and c.deploy["skip_layers"] == [1]
    assert c.deploy["command"] == ("vllm serve MODEL --kv-cache-dtype nvfp4 "
                                   "--kv-cache-dtype-skip-layers 1")
    assert "kv_scales.json" not in rec.files  # nvfp4's block scales are computed as written
