"""benchmarks/gpu_acceptance.py (the GPU acceptance run, docs/internals/gpu-acceptance.md) on CPU: the summary and its
failure reporting on planted steps, the readings of ``generate --json`` that decide whether the
Triton path was really used, a failing ``kvlens`` step named in the summary with a non-zero
exit, and (slow) the ``--cpu-smoke`` run end to end on the real default model."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.py"


def _load(path=SCRIPT):
    name = f"_kvlens_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the body runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


ga = _load()

TRITON_REASON = ("Triton requested (CUDA): decode kernel for single-token decode steps, torch "
                 "path otherwise; torch path for: nothing quantized yet (model's own attention) "
                 "(60 calls), prefill / multi-token query (the kernel takes one query token) "
                 "(30 calls)")


def test_torch_path_calls_are_read_per_reason():
    assert ga.torch_path_calls(TRITON_REASON) == {
        "nothing quantized yet (model's own attention)": 60,
        "prefill / multi-token query (the kernel takes one query token)": 30}
    # a reason with a comma inside its parentheses stays one reason
    reason = ("x; torch path for: key group 24 per-token (the kernel needs a divisor of "
              "head_dim 64, >= 16) (7 calls)")
    assert ga.torch_path_calls(reason) == {
        "key group 24 per-token (the kernel needs a divisor of head_dim 64, >= 16)": 7}
    assert ga.torch_path_calls("torch path requested") == {}
    assert ga.torch_path_calls(None) == {}


def test_the_triton_verdict_accepts_a_run_the_kernel_served():
    results = [{"name": "recommended", "backend": "triton", "backend_reason": TRITON_REASON},
               {"name": "kivi-2", "backend": "triton", "backend_reason": TRITON_REASON}]
    verdict = ga.triton_verdict(results, kernel_calls=540, required=True)
    assert verdict["used"] and verdict["problems"] == []
    assert verdict["torch_path_calls"] == 180
    assert verdict["kernel_share"] == pytest.approx(540 / 720, abs=1e-4)


@pytest.mark.parametrize("results, calls, expect", [
    ([{"name": "kv", "backend": "torch", "backend_reason": "torch path requested"}], 0,
     "kv ran on the torch backend"),
    ([{"name": "kv", "backend": "triton", "backend_reason": TRITON_REASON}], 0,
     "never called"),
    ([{"name": "kv", "backend": "triton", "backend_reason":
       "T; torch path for: pre-RoPE keys (the kernel does not re-apply RoPE) (90 calls)"}], 10,
     "kv took the torch path for {'pre-RoPE keys"),
])
def test_the_triton_verdict_names_a_silent_torch_fallback(results, calls, expect):
    with pytest.raises(ga.StepFailure, match="not really used") as failure:
        ga.triton_verdict(results, kernel_calls=calls, required=True)
    assert expect in str(failure.value)
    verdict = ga.triton_verdict(results, kernel_calls=calls, required=False)  # smoke: recorded
    assert not verdict["used"] and any(expect in p for p in verdict["problems"])


def test_the_backends_perplexities_must_agree():
    assert ga.compare_ppl({"kv": 10.0, "kivi-2": 12.0}, {"kv": 10.05, "kivi-2": 12.0}, 0.01) == \
        {"kv": pytest.approx(0.05 / 10.05, abs=1e-6), "kivi-2": 0.0}
    with pytest.raises(ga.StepFailure, match="kv 0.0476"):
        ga.compare_ppl({"kv": 10.0}, {"kv": 10.5}, 0.01)
    with pytest.raises(ga.StepFailure, match="no config"):
        ga.compare_ppl({"kv": 10.0}, {"other": 10.0}, 0.01)


def test_bench_figures_summarise_the_timings():
    rows = [{"layer": "gqa", "layout": "kivi", "context": c, "bits": 2, "group": 64,
             "triton_ms": 0.1, "sdpa_fp16_ms": 0.1 * s, "speedup": s, "gbps": 1000.0,
             "frac_copy_bw": 0.5, "bytes": 1} for c, s in ((8192, 2.0), (32768, 4.0),
                                                          (16384, 3.0))]
    fig = ga.bench_figures({"device": "H100", "copy_bandwidth_gbps": 3000.0, "results": rows})
    assert (fig["speedup_min"], fig["speedup_median"], fig["speedup_max"]) == (2.0, 3.0, 4.0)
    assert "bytes" not in fig["rows"][0] and fig["device"] == "H100"
    with pytest.raises(ga.StepFailure, match="timed nothing"):
        ga.bench_figures({"results": []})


def _acceptance(tmp_path, steps):
    acc = ga.Acceptance(tmp_path / "s" / "summary.json", "cpu-smoke")
    for step in steps:
        acc.run(step)
    return acc, acc.finish()


def _fail():
    raise ga.StepFailure("capture wrote nothing")


def test_a_failed_step_is_named_its_dependents_skipped_and_the_exit_is_nonzero(tmp_path):
    acc, code = _acceptance(tmp_path, [
        ga.Step("a", lambda: {"figure": 1}),
        ga.Step("b", _fail, ("a",)),
        ga.Step("c", lambda: {"never": 1}, ("b",)),
        ga.Step("d", lambda: {"figure": 2}, ("a",)),
        ga.Step("e", lambda: {}, skip="not in this mode"),
        ga.Step("f", lambda: 1 / 0),
    ])
    doc = json.loads(acc.path.read_text())
    assert code == 1 and doc["ok"] is False
    assert doc["failed_steps"] == ["b", "f"]
    steps = doc["steps"]
    assert list(steps) == ["a", "b", "c", "d", "e", "f"]
    assert steps["a"] == {"ok": True, "figure": 1, "seconds": steps["a"]["seconds"]}
    assert steps["b"]["ok"] is False and steps["b"]["error"] == "capture wrote nothing"
    assert steps["c"]["ok"] is False and "needs b" in steps["c"]["skipped"]
    assert steps["d"]["ok"] is True and steps["e"] == {"ok": True, "skipped": "not in this mode",
                                                       "seconds": 0.0}
    assert steps["f"]["error"].startswith("ZeroDivisionError")  # a bug is reported, not hidden
    assert not list(acc.path.parent.glob("*.tmp"))


def test_a_run_of_passing_steps_exits_zero(tmp_path):
    acc, code = _acceptance(tmp_path, [ga.Step("a", lambda: {})])
    assert code == 0 and json.loads(acc.path.read_text())["ok"] is True


def test_run_command_names_the_exit_status_and_stderr(tmp_path):
    log = tmp_path / "logs" / "x.log"
    with pytest.raises(ga.StepFailure, match=r"status 3.*\n.*boom"):
        ga.run_command([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); "
                        "sys.exit(3)"], log, timeout=60)
    assert "boom" in log.read_text()
    with pytest.raises(ga.StepFailure, match="timed out after 1 s"):
        ga.run_command([sys.executable, "-c", "import time; time.sleep(30)"], log, timeout=1)
    with pytest.raises(ga.StepFailure, match="printed no JSON"):
        ga.run_command([sys.executable, "-c", "print('hi')"], log, 60, stdout_json=True)
    assert ga.run_command([sys.executable, "-c", "print('[1]')"], log, 60,
                          stdout_json=True) == [1]


def test_the_counting_shim_runs_kvlens_and_writes_the_count(tmp_path):
    counts = tmp_path / "calls.json"
    proc = subprocess.run([sys.executable, "-c", ga.COUNTING_SHIM, str(counts), "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\d+\.\d+", proc.stdout)
    assert json.loads(counts.read_text())["decode_attention"] == 0


def test_a_failing_kvlens_step_fails_the_run_loudly(tmp_path):
    missing = tmp_path / "missing.gguf"
    code = ga.main(["--cpu-smoke", "--out-dir", str(tmp_path / "o"), "--model", str(missing)])
    doc = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert code == 1 and doc["ok"] is False and doc["failed_steps"] == ["capture"]
    steps = doc["steps"]
    assert steps["environment"]["ok"] and "kvlens capture --model" in steps["capture"]["error"]
    assert "missing.gguf" in steps["capture"]["error"]
    assert "needs capture" in steps["report"]["skipped"]
    assert "needs recommend" in steps["generate-kld"]["skipped"]
    assert (tmp_path / "o" / "logs" / "capture.log").is_file()


def test_the_gpu_run_fails_at_environment_without_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    summary = tmp_path / "gpu.json"
    code = ga.main(["--out-dir", str(tmp_path / "o"), "--summary", str(summary)])
    doc = json.loads(summary.read_text())
    assert code == 1 and doc["mode"] == "gpu" and doc["failed_steps"] == ["environment"]
    assert "no CUDA GPU" in doc["steps"]["environment"]["error"]
    assert "needs environment" in doc["steps"]["kernel-bench"]["skipped"]


def test_gpu_check_sh_and_the_makefile_run_the_script():
    wrapper = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert "benchmarks/gpu_acceptance.py" in wrapper and '"$@"' in wrapper
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^gpu-check:.*\n((?:\t.*\n)+)", make, re.M)
    assert recipe and "benchmarks/gpu_check.sh" in recipe.group(1)


@pytest.mark.slow
def test_the_cpu_smoke_run_end_to_end(tmp_path):
    """The whole pipeline on the real SmolLM2, reduced (about 1-2.5 minutes on 2 cores)."""
    out = tmp_path / "smoke"
    assert ga.main(["--cpu-smoke", "--out-dir", str(out)]) == 0
    doc = json.loads((out / "summary.json").read_text())
    steps = doc["steps"]
    assert doc["ok"] and doc["failed_steps"] == [] and doc["mode"] == "cpu-smoke"
    assert all(s["ok"] for s in steps.values())
    assert steps["capture"]["layers"] == 30 and steps["capture"]["layer_devices"] == ["cpu"]
    assert steps["recommend"]["kernel_reads_every_layer"] is True
    assert steps["recommend"]["bits_held_at_context"] <= 3.0 + 1e-9
    kld = steps["generate-kld"]["configs"]
    assert set(kld) == {"fp16", "kivi-2", "recommended"}
    rec = kld["recommended"]
    assert rec["quantized_share"] > 0 and 0 < rec["mean_kld"] < 1
    assert rec["mean_kld_ci95"][0] <= rec["mean_kld"] <= rec["mean_kld_ci95"][1]
    assert kld["fp16"]["mean_kld"] < 1e-4
    assert steps["generate-kld"]["kernel_calls"] == 0
    assert "skipped" in steps["generate-triton"] and "skipped" in steps["kernel-bench"]
    torch_step = steps["generate-torch"]
    assert set(torch_step["ppl"]) == {"recommended", "kivi-2"}
    assert doc["triton"]["used"] is False and doc["triton"]["kernel_calls"] == 0
    assert (out / "report.html").stat().st_size > 0
    assert all(s["seconds"] >= 0 for s in steps.values()) and doc["seconds"] > 0


# -- the engine checks (benchmarks/engine_checks.py): everything but the engines themselves ----

ec = _load(ROOT / "benchmarks" / "engine_checks.py")


def test_the_acceptance_run_knows_the_engines_the_checks_run():
    assert ga.ENGINES == tuple(ec.ENGINES)


def test_engines_are_parsed_in_order_and_an_unknown_one_is_refused_with_the_list():
    assert ec.parse_engines("TRTLLM, vllm,vllm") == ["trtllm", "vllm"]
    assert ec.parse_engines("") == []
    with pytest.raises(ec.EngineCheckFailure, match="unknown engine llamacpp.*allowed: vllm, "
                                                      "sglang, trtllm"):
        ec.parse_engines("vllm,llamacpp")


def test_the_acceptance_arguments_choose_the_engine_checks(capsys):
    assert ga.parse_args([]).engine_names == ["vllm", "sglang", "trtllm"]  # the GPU run: all
    assert ga.parse_args(["--cpu-smoke"]).engine_names == []
    assert ga.parse_args(["--cpu-smoke", "--engines", "sglang"]).engine_names == ["sglang"]
    assert ga.parse_args(["--engines", ""]).engine_names == []
    for argv, says in ((["--engines", "vllm,tgi"], "unknown engine tgi"),
                       (["--engine-tokens", "1"], "--engine-tokens must be at least 2")):
        with pytest.raises(SystemExit):
            ga.parse_args(argv)
        assert says in capsys.readouterr().err


def test_a_missing_engine_says_what_to_install(tmp_path):
    absent = ec.Engine("absent", "no_such_engine_module_kvlens", "pip install absent", (), True)
    why = ec.missing_engine(absent, sys.executable)
    assert "absent is not installed" in why and "pip install absent" in why
    present = ec.Engine("present", "json", "-", (), True)
    assert ec.missing_engine(present, sys.executable) is None
    assert "cannot run" in ec.missing_engine(present, str(tmp_path / "no-python"))


def _kl(p_logits, q_logits):
    """KL(p || q) per row with torch, independently of the script's numpy code."""
    torch = pytest.importorskip("torch")
    p = torch.log_softmax(torch.as_tensor(p_logits, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.as_tensor(q_logits, dtype=torch.float64), -1)
    return torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1).numpy()


def test_full_logits_give_kld_agreement_and_likelihoods():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(7, 11)) * 3
    test = ref + rng.normal(size=ref.shape)
    ids = [0, *rng.integers(0, 11, 7).tolist()]
    pp = ec.per_prediction_full(ref, test, ids)
    np.testing.assert_allclose(pp["kld"], _kl(ref, test), rtol=1e-9, atol=1e-12)
    assert np.array_equal(pp["agree"], (ref.argmax(-1) == test.argmax(-1)).astype(float))
    np.testing.assert_allclose(pp["nll_ref"][2], -(ref[2] - np.log(np.exp(ref[2]).sum()))[ids[3]])
    same = ec.per_prediction_full(ref, ref + 5.0, ids)  # a shift changes no distribution
    assert np.abs(same["kld"]).max() < 1e-12 and same["agree"].all()


def test_the_top_k_kld_is_a_lower_bound_and_exact_on_the_whole_vocabulary():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    for _ in range(20):
        ref, test = rng.normal(size=30) * 2, rng.normal(size=30) * 2
        full = float(_kl(ref[None], test[None])[0])
        lr, lt = ec.log_softmax(ref), ec.log_softmax(test)

        def top(lp, k):
            return {int(i): float(lp[i]) for i in np.argsort(-lp)[:k]}
        assert ec.coarse_kld(top(lr, 30), top(lt, 30)) == pytest.approx(full, rel=1e-9)
        for k in (1, 5, 12):
            assert 0 <= ec.coarse_kld(top(lr, k), top(lt, k)) <= full + 1e-12
    pp = ec.per_prediction_topk([{1: -0.1, 2: -2.5}], [{2: -0.2, 3: -1.8}], [0, 3])
    assert pp["agree"][0] == 0 and np.isnan(pp["nll_ref"][0]) and pp["nll_test"][0] == 1.8


def test_statistics_of_planted_predictions():
    np = pytest.importorskip("numpy")
    kld = np.r_[np.full(64, 0.01), np.full(64, 0.03)]
    pp = {"kld": kld, "agree": np.r_[np.ones(100), np.zeros(28)],
          "nll_ref": np.full(128, 2.0), "nll_test": np.r_[np.full(127, 2.1), np.nan]}
    st = ec.statistics(pp)
    assert st["predictions"] == 128 and st["mean_kld"] == pytest.approx(0.02)
    lo, hi = st["mean_kld_ci95"]
    # two blocks of 64 resampled whole: the means are 0.01, 0.02 or 0.03 (per prediction, the
    # interval would be about 0.02 +- 0.002)
    assert lo == pytest.approx(0.01) and hi == pytest.approx(0.03)
    assert st["top1_agreement"] == pytest.approx(100 / 128)
    assert st["ppl_change"] == pytest.approx(np.exp(0.1) - 1)  # the NaN prediction left out
    with pytest.raises(ec.EngineCheckFailure, match="no predictions"):
        ec.statistics({"kld": [], "agree": [], "nll_ref": np.array([]), "nll_test": np.array([])})


def test_the_engine_is_set_beside_the_simulation():
    assert ec.side_by_side({"mean_kld": 0.034}, {"mean_kld": 0.0159}) == \
        {"ratio": 2.138, "within_1_5x": False}
    assert ec.side_by_side({"mean_kld": 0.012}, {"mean_kld": 0.0159})["within_1_5x"] is True
    assert ec.side_by_side({"mean_kld": 0.01}, None) == {"ratio": None, "within_1_5x": None}
    doc = {"results": [{"name": "vllm:fp8_e4m3:s1", "bits_per_element": 8.0, "kld": {
        "mean_kld": {"value": 0.0159, "ci95": [0.012, 0.019]}, "scored": 2047,
        "top1_agreement": {"value": 0.94}, "ppl_change": {"value": 0.02}}}]}
    fig = ec.sim_figures(doc, "VLLM:fp8_e4m3:s1")  # the only result, however kvlens spells it
    assert fig["mean_kld"] == 0.0159 and fig["predictions"] == 2047
    with pytest.raises(ec.EngineCheckFailure, match="no kld for x"):
        ec.sim_figures({"results": [{"name": "x"}]}, "x")


FAKE_ENGINE = """import json, sys
import numpy as np
if sys.argv[1] == "-c":
    sys.exit(0)  # the import probe: installed
_, _, engine, dtype, model, ids, out = sys.argv[1:8]
n = len(json.load(open(ids)))
if dtype == "nvfp4":
    sys.exit("the engine refuses nvfp4 here")
base = np.random.default_rng(0).normal(size=(n - 1, 40)) * 3
noise = {"auto": 0.0, "fp8": 0.2, "fp8_e5m2": 0.6}[dtype]
np.save(out, base + noise * np.random.default_rng(1).normal(size=base.shape))
"""

FAKE_KVLENS = """import json, sys
setting = sys.argv[sys.argv.index("--compare") + 1]
if "nvfp4" in setting:
    sys.exit("unknown engine setting " + setting)
value = {"vllm:fp8_e4m3:s1": 0.02, "vllm:fp8_e5m2:s1": 1.0, "vllm:fp8_e4m3:s1:cpu": 0.04,
         "vllm:fp8_e5m2:s1:cpu": 1.5}[setting]
print(json.dumps({"results": [{"name": setting, "kld": {
    "mean_kld": {"value": value, "ci95": [value / 2, value * 2]}, "scored": 9,
    "top1_agreement": {"value": 0.9}, "ppl_change": {"value": 0.01}}}]}))
"""


def _fake_check(tmp_path, device: str, printed: list):
    engine = tmp_path / "engine-python"
    engine.write_text(f"#!{sys.executable}\n{FAKE_ENGINE}")
    engine.chmod(0o755)
    fake_kvlens = tmp_path / "fake_kvlens.py"
    fake_kvlens.write_text(FAKE_KVLENS)
    return ec.check_engine("vllm", model=tmp_path, ids=list(range(1, 11)), out=tmp_path / "o",
                           python=str(engine), device=device, model_dtype="float32",
                           timeout=120, kvlens=[sys.executable, str(fake_kvlens)],
                           progress=printed.append)


def test_an_engine_check_runs_the_worker_and_kvlens_and_records_refusals(tmp_path):
    np = pytest.importorskip("numpy")
    printed = []
    figs = _fake_check(tmp_path, "cuda", printed)
    assert list(figs) == ["fp8", "fp8_e5m2", "nvfp4"]
    ref, fp8 = (np.load(tmp_path / "o" / f"vllm-{d}.npy") for d in ("auto", "fp8"))
    want = float(_kl(ref, fp8).mean())
    assert figs["fp8"]["engine"]["mean_kld"] == pytest.approx(want, rel=1e-9)
    assert figs["fp8"]["engine"]["predictions"] == 9
    assert figs["fp8"]["ratio"] == pytest.approx(want / 0.02, rel=1e-3)
    assert figs["fp8_e5m2"]["engine"]["mean_kld"] > figs["fp8"]["engine"]["mean_kld"]
    nv = figs["nvfp4"]
    assert "refuses nvfp4" in nv["engine_error"] and "unknown engine setting" in nv["kvlens_error"]
    assert "engine" not in nv and "ratio" not in nv
    assert printed[0].startswith("vllm fp8: engine KLD ") and "| kvlens vllm:fp8_e4m3:s1 0.02" \
        in printed[0]
    assert "not run: " in printed[2] and "no simulation: " in printed[2]
    assert (tmp_path / "o" / "vllm-nvfp4.log").is_file()


def test_on_a_cpu_vllm_is_checked_against_its_cpu_builds_settings(tmp_path):
    pytest.importorskip("numpy")
    printed = []
    figs = _fake_check(tmp_path, "cpu", printed)
    # the CPU build truncates (:cpu); its nvfp4 is not an fp4 cache, so not checked there
    assert {d: f["kvlens_setting"] for d, f in figs.items()} == {
        "fp8": "vllm:fp8_e4m3:s1:cpu", "fp8_e5m2": "vllm:fp8_e5m2:s1:cpu"}
    assert figs["fp8"]["kvlens"]["mean_kld"] == 0.04
    assert not (tmp_path / "o" / "vllm-nvfp4.log").exists()
    assert "| kvlens vllm:fp8_e4m3:s1:cpu 0.04" in printed[0]


def test_an_engine_not_installed_is_a_skipped_step_of_the_acceptance_run(tmp_path):
    absent = tmp_path / "python-without-engines"
    absent.write_text("#!/bin/sh\nexit 1\n")
    absent.chmod(0o755)
    code = ga.main(["--cpu-smoke", "--out-dir", str(tmp_path / "o"), "--model",
                    str(tmp_path / "missing.gguf"), "--engines", "vllm,trtllm",
                    "--engine-python", str(absent)])
    doc = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert code == 1 and doc["failed_steps"] == ["capture"]  # the engines did not fail it
    for name, install in (("vllm", "pip install vllm"), ("trtllm", "pip install tensorrt-llm")):
        step = doc["steps"][f"engine-{name}"]  # ran, and said why it checked nothing
        assert step["ok"] is True and "not installed" in step["skipped"]
        assert install in step["skipped"]
    assert "engine-sglang" not in doc["steps"]
    assert "pip install vllm" in (tmp_path / "o" / "logs" / "engine-vllm.log").read_text()
