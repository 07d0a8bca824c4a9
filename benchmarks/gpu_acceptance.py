"""The GPU acceptance run (issue #51, item 4): the whole pipeline on the default model on one
CUDA GPU, each step timed, one JSON summary; never in CI (it needs a GPU), except its
``--cpu-smoke`` mode, which ``tests/test_gpu_acceptance.py`` runs.

Steps, each a ``kvlens`` command in its own process (the page: docs/internals/gpu-acceptance.md):

1. ``environment``: torch, triton, CUDA, the GPU's name (no CUDA GPU: this step fails);
2. ``capture``: ``kvlens capture`` (the embedded SmolLM2, on CUDA);
3. ``plot-outliers`` and 4. ``compare-axes`` on that capture;
5. ``recommend``: a per-layer config at ``--budget-bits`` (``-o OUT/kv.json``), restricted to
   layouts the Triton kernel reads (``--set prefer-fast=on``) so that step 7 can require it;
6. ``generate-kld``: ``kvlens generate --compare fp16,kivi-2,OUT/kv.json --eval kld`` at 4096
   tokens with ``--backend triton`` on CUDA (KLD with intervals, bits held);
7. ``generate-triton``: decode-mode perplexity (``--eval ppl``: one token per forward, the
   calls the kernel serves) of the config and kivi-2 with ``--backend triton``; the kernel's
   calls are counted in the process (``kvlens_kernels.decode_attention`` wrapped) and every
   call that took the torch path is read, per reason, from ``generate --json``. Fails unless
   the kernel ran and the torch path served only prefill and not-yet-quantized calls;
8. ``generate-torch``: the same with ``--backend torch``; fails when a perplexity differs from
   step 7's by more than ``--ppl-tolerance`` (relative);
9. ``report``: ``kvlens report`` over the run folder;
10. ``kernel-bench``: ``benchmarks/bench_kernels.py`` (its GPU correctness checks, then decode
    latency against fp16 SDPA at 8k-32k tokens: speedup, GB/s, share of copy bandwidth);
11. ``kernel-tests`` (``--kernel-tests`` only): the kernel tests compiled on the GPU;
12. ``engine-vllm``, ``engine-sglang``, ``engine-trtllm`` (``--engines``; all three by default on
    the GPU, none in the smoke run): the real engine's KV-cache dtypes (fp8, nvfp4, ...) on
    SmolLM2, its KLD printed beside kvlens's simulation of the same setting
    (``benchmarks/engine_checks.py``); an engine that ``--engine-python`` cannot import is
    skipped with what to install;
13. ``budget``: the whole run (without steps 11 and 12) within ``--budget-s`` (default 480 s).

A failed step is named in the summary (``failed_steps``, its ``error`` and the tail of its log);
steps that need it are skipped, the others still run, and the exit status is 1. The summary is
rewritten after every step, so a run cut short still leaves what finished. ``--cpu-smoke`` runs
the same orchestration on CPU with tiny token counts and the torch backend, without the kernel
steps or the budget.

Usage (repository root; kvlens and kvlens_kernels installed)::

    python benchmarks/gpu_acceptance.py --summary out-gpu/summary.json
    python benchmarks/gpu_acceptance.py --cpu-smoke --out-dir /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_KERNELS = ROOT / "benchmarks" / "bench_kernels.py"
ENGINE_CHECKS = ROOT / "benchmarks" / "engine_checks.py"
ENGINES = ("vllm", "sglang", "trtllm")  # engine_checks.py's engines (a test keeps them equal)
KERNEL_TESTS = ("tests/test_kernels_decode.py", "tests/test_kernels_codebook.py")
SCHEMA = 1
BUDGET_S = 480.0
#: attention calls the torch path may serve under ``--backend triton`` (``kvlens.cache.attention``
#: notes them with these reasons): a multi-token forward, and a layer with nothing quantized yet
EXPECTED_TORCH_REASONS = ("prefill / multi-token query", "nothing quantized yet")
LOG_TAIL = 2000  # characters of a failed step's log kept in the summary

#: Runs ``kvlens`` with ``kvlens_kernels.decode_attention`` wrapped in a counter (the glue imports
#: it at call time, so the wrapper sees every kernel call) and writes the count to argv[1] at exit.
COUNTING_SHIM = r"""
import atexit, json, sys
path, calls = sys.argv[1], {"decode_attention": 0}
def _write():
    with open(path, "w") as f:
        json.dump(calls, f)
atexit.register(_write)
try:
    import kvlens_kernels
except ImportError as exc:
    calls["import_error"] = str(exc)
else:
    _kernel = kvlens_kernels.decode_attention
    def counted(*args, **kwargs):
        calls["decode_attention"] += 1
        return _kernel(*args, **kwargs)
    kvlens_kernels.decode_attention = counted
from kvlens.cli import main
sys.argv = ["kvlens", *sys.argv[2:]]
main()
"""


class StepFailure(Exception):
    """A step did not do what the acceptance run requires; the message says what."""


# -- settings -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """What each step runs with: the GPU run, or the reduced CPU smoke run."""

    device: str
    backend: str
    capture: tuple[str, ...]
    compare_axes: tuple[str, ...]
    recommend: tuple[str, ...]
    eval_tokens: int
    kld_chunk: int
    ppl_tokens: int
    kernel_bench: bool
    budget_s: float | None


def settings_for(args) -> Settings:
    if args.cpu_smoke:
        return Settings(device="cpu", backend="torch",
                        capture=("--samples", "1", "--tokens", "128"),
                        compare_axes=("--bits", "2", "--samples", "1"),
                        recommend=("--windows", "32", "--set", "group-sizes=32",
                                   "--set", "sensitivity=uniform", "--set", "retrieval=off"),
                        eval_tokens=128, kld_chunk=32, ppl_tokens=48, kernel_bench=False,
                        budget_s=None)
    # recommend loads its model on the CPU unless a device map places it: on the GPU here
    return Settings(device="cuda", backend="triton", capture=(), compare_axes=(),
                    recommend=("--device-map", "auto"), eval_tokens=args.eval_tokens, kld_chunk=64,
                    ppl_tokens=args.ppl_tokens, kernel_bench=True,
                    budget_s=args.budget_s or None)


# -- running steps --------------------------------------------------------------------------

@dataclass
class Step:
    name: str
    run: Callable[[], dict]  # returns the step's key figures; raises StepFailure
    needs: tuple[str, ...] = ()
    skip: str | None = None  # why the step does not run in this mode


@dataclass
class Acceptance:
    """The summary being built; ``write`` saves it (atomically) after every step."""

    path: Path
    mode: str
    doc: dict = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.doc = {"kvlens_gpu_acceptance": SCHEMA, "mode": self.mode,
                    "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "ok": None, "failed_steps": [], "seconds": 0.0, "steps": {}}

    def run(self, step: Step) -> dict:
        missing = [n for n in step.needs if not self.doc["steps"].get(n, {}).get("ok")]
        if step.skip or missing:
            why = step.skip or f"needs {', '.join(missing)}, which did not succeed"
            rec = {"ok": not missing, "skipped": why, "seconds": 0.0}
        else:
            print(f"== {step.name}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                rec = {"ok": True, **step.run()}
            except StepFailure as exc:
                rec = {"ok": False, "error": str(exc)}
            except Exception as exc:  # a bug in this script: still named, never hidden
                rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            rec["seconds"] = round(time.perf_counter() - start, 2)
            state = "ok" if rec["ok"] else f"FAILED: {rec['error']}"
            print(f"== {step.name}: {state} ({rec['seconds']:.1f} s)", file=sys.stderr,
                  flush=True)
        if not rec["ok"] and not missing:  # a skipped dependent is not another failure
            self.doc["failed_steps"].append(step.name)
        self.doc["steps"][step.name] = rec
        self.write()
        return rec

    def finish(self, interrupted: bool = False) -> int:
        if interrupted:
            self.doc["interrupted"] = True
            self.doc["failed_steps"].append("interrupted")
        self.doc["ok"] = not self.doc["failed_steps"]
        self.write()
        return 0 if self.doc["ok"] else (130 if interrupted else 1)

    def write(self) -> None:
        self.doc["seconds"] = round(time.perf_counter() - self.t0, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def run_command(cmd: list[str], log: Path, timeout: float, env: dict | None = None,
                stdout_json: bool = False):
    """Run ``cmd``; its stdout and stderr go to ``log``. Returns the parsed stdout JSON (or
    ``None``); raises ``StepFailure`` with the exit status and the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = _text(exc.stdout), _text(exc.stderr), None
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}\n",
                   encoding="utf-8")
    if rc != 0:
        what = f"timed out after {timeout:.0f} s" if rc is None else f"exited with status {rc}"
        raise StepFailure(f"`{_short(cmd)}` {what}; log {log}; stderr ends:\n"
                          f"{err[-LOG_TAIL:]}")
    if not stdout_json:
        return None
    try:
        return json.loads(out)
    except json.JSONDecodeError as exc:
        raise StepFailure(f"`{_short(cmd)}` printed no JSON on stdout ({exc}); log {log}") \
            from exc


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _short(cmd: list[str]) -> str:
    """The command as a user would type it (``kvlens ...`` for ``python -m kvlens`` and for
    the counting shim)."""
    if cmd[1:2] == ["-m"] and cmd[2:3] == ["kvlens"]:
        return " ".join(["kvlens", *cmd[3:]])
    if cmd[1:2] == ["-c"]:
        return " ".join(["kvlens", *cmd[4:]])
    return " ".join(cmd)


# -- what the steps read ---------------------------------------------------------------------

def torch_path_calls(reason: str | None) -> dict[str, int]:
    """``{reason: calls}`` from a result's ``backend_reason`` (``...; torch path for: R (N
    calls), R2 (M calls)``); empty when no call took the torch path."""
    if not reason or "; torch path for: " not in reason:
        return {}
    tail = reason.split("; torch path for: ", 1)[1]
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"(.*?) \((\d+) calls\)(?:, |$)", tail)}


def triton_verdict(results: list[dict], kernel_calls: int, required: bool) -> dict:
    """Whether the Triton kernel served the compressed configs of a ``generate --json`` run:
    every config on the triton backend, the kernel called, and the torch path taken only for
    ``EXPECTED_TORCH_REASONS``. Raises ``StepFailure`` when ``required`` and it did not."""
    per_config, problems = {}, []
    for res in results:
        calls = torch_path_calls(res.get("backend_reason"))
        unexpected = {r: n for r, n in calls.items()
                      if not r.startswith(EXPECTED_TORCH_REASONS)}
        per_config[res["name"]] = {"backend": res.get("backend"), "torch_path_calls": calls,
                                   "unexpected_torch_path_calls": unexpected}
        if res.get("backend") != "triton":
            problems.append(f"{res['name']} ran on the {res.get('backend')} backend")
        if unexpected:
            problems.append(f"{res['name']} took the torch path for {unexpected}")
    torch_calls = sum(n for c in per_config.values() for n in c["torch_path_calls"].values())
    if kernel_calls <= 0:
        problems.append("the Triton kernel was never called")
    total = kernel_calls + torch_calls
    verdict = {"used": kernel_calls > 0 and not problems, "kernel_calls": kernel_calls,
               "torch_path_calls": torch_calls,
               "kernel_share": round(kernel_calls / total, 4) if total else 0.0,
               "configs": per_config, "problems": problems}
    if required and problems:
        raise StepFailure("the Triton path was not really used: " + "; ".join(problems))
    return verdict


def compare_ppl(triton: dict[str, float], torch: dict[str, float], tolerance: float) -> dict:
    """Relative perplexity differences between the two backends; ``StepFailure`` beyond
    ``tolerance``."""
    diffs = {name: abs(triton[name] / torch[name] - 1) for name in triton if name in torch}
    if not diffs:
        raise StepFailure("no config has a perplexity on both backends")
    bad = {n: d for n, d in diffs.items() if not d <= tolerance}
    if bad:
        raise StepFailure(f"Triton and torch perplexities differ beyond {tolerance:g}: "
                          + ", ".join(f"{n} {d:.3g}" for n, d in bad.items()))
    return {name: round(d, 6) for name, d in diffs.items()}


def kld_figures(report: dict) -> dict:
    """Per config: mean KLD with its interval, top-1 agreement, perplexity change, bits held,
    the share of scored tokens that read quantized entries, and the backend reported."""
    out = {}
    for res in report["results"]:
        kld = res.get("kld")
        if kld is None:
            raise StepFailure(f"generate reported no kld for {res['name']}")
        out[res["name"]] = {
            "mean_kld": kld["mean_kld"]["value"], "mean_kld_ci95": kld["mean_kld"]["ci95"],
            "top1_agreement": kld["top1_agreement"]["value"],
            "ppl_change": kld["ppl_change"]["value"], "scored_tokens": kld["scored"],
            "quantized_share": kld.get("quantized_share"),
            "bits_per_element": res.get("bits_per_element"), "backend": res.get("backend"),
            "kv_bytes_by_device": res.get("kv_bytes_by_device")}
    return out


def bench_figures(doc: dict) -> dict:
    """``bench_kernels.py``'s JSON, shortened: the device, copy bandwidth, speedup range and one
    row per timing."""
    rows = doc.get("results") or []
    if not rows:
        raise StepFailure("bench_kernels.py timed nothing")
    keep = ("layer", "layout", "context", "bits", "group", "triton_ms", "sdpa_fp16_ms",
            "speedup", "gbps", "frac_copy_bw")
    speedups = sorted(r["speedup"] for r in rows)
    return {"device": doc.get("device"), "copy_bandwidth_gbps": doc.get("copy_bandwidth_gbps"),
            "speedup_min": speedups[0], "speedup_median": speedups[len(speedups) // 2],
            "speedup_max": speedups[-1],
            "rows": [{k: r.get(k) for k in keep} for r in rows]}


def best_axes(summary: dict) -> dict:
    """compare-axes' winner per tensor and bit width (lowest mean attention-output error of
    plain quantization)."""
    best: dict = {}
    for m in summary.get("means", []):
        if m.get("metric") != "attention_output" or m.get("variant") != "plain":
            continue
        key = f"{m['tensor']} {m['bits']}b G{m['group_size']}"
        if key not in best or m["mean"] < best[key][1]:
            best[key] = (m["axis"], m["mean"])
    return {k: {"axis": a, "attention_output_error": e} for k, (a, e) in best.items()}


# -- the steps ------------------------------------------------------------------------------

def environment(gpu: bool) -> dict:
    """Versions and the device; fails on a GPU run without CUDA or triton."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = None
        info["triton_error"] = str(exc)
    try:
        from importlib.metadata import version
        info["kvlens"] = version("kvlens")
    except Exception as exc:  # not installed as a distribution: say so
        info["kvlens"] = f"unknown ({type(exc).__name__})"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT)
    info["commit"] = commit.stdout.strip() or None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    compute_capability=f"{props.major}.{props.minor}")
    if gpu and not info["cuda_available"]:
        raise StepFailure("no CUDA GPU (torch.cuda.is_available() is False); on CPU run "
                          "--cpu-smoke")
    if gpu and info["triton"] is None:
        raise StepFailure(f"triton is not importable ({info['triton_error']})")
    return info


def build_steps(args, s: Settings, out: Path, env: dict, acc: Acceptance) -> list[Step]:
    kv = [sys.executable, "-m", "kvlens"]
    logs = out / "logs"
    model = ["--model", args.model] if args.model else []
    run_h5, config = out / "run.h5", out / "kv.json"
    state: dict = {}

    def cli(name, argv, as_json=True, counts: Path | None = None):
        cmd = kv + argv
        if counts is not None:
            cmd = [sys.executable, "-c", COUNTING_SHIM, str(counts), *argv]
        return run_command(cmd, logs / f"{name}.log", args.step_timeout, env, as_json)

    def capture():
        doc = cli("capture", ["capture", *model, "-o", str(run_h5), "--device", s.device,
                              "--overwrite", "--json", *s.capture])
        return {"model": doc["model"], "layers": len(doc["layers"]), "samples": doc["samples"],
                "tokens": doc["tokens"], "file_bytes": doc["file_bytes"],
                "capture_seconds": doc["seconds"], "layer_devices": sorted(set(
                    doc.get("layer_devices") or []))}

    def plot_outliers():
        doc = cli("plot-outliers", ["plot-outliers", str(run_h5), "--out", str(out / "outliers"),
                                    "--overwrite", "--json"])
        heads = doc.get("heads", [])
        return {"figures": len(doc.get("figures", [])), "analysis_seconds": doc.get("seconds"),
                "heads_with_outliers": sum(1 for h in heads if h.get("outliers")),
                "heads": len(heads)}

    def compare_axes():
        doc = cli("compare-axes", ["compare-axes", str(run_h5), "--plots", str(out / "compare"),
                                   "--overwrite", "--json", *s.compare_axes])
        return {"records": len(doc.get("records", [])),
                "best_axis": best_axes(doc.get("summary", {}))}

    def recommend():
        doc = cli("recommend", ["recommend", str(run_h5), "-b", str(args.budget_bits), "-o",
                                str(config), "--overwrite", "--remeasure", "--json",
                                "--set", "prefer-fast=on", *model, *s.recommend])
        cost = next((c for c in doc.get("decode_cost", []) if c.get("config") == doc["config"]
                     .get("name")), None) or (doc.get("decode_cost") or [{}])[0]
        ctx = str(doc["context"])
        figures = {"budget_bits": doc["budget_bits"], "mean_bits": doc["mean_bits"],
                   "bits_held_at_context": 16 * doc["kv_bytes"][ctx] / doc["kv_bytes_fp16"][ctx],
                   "context": doc["context"], "expected_output_error":
                       doc["expected_output_error"],
                   "kernel_reads_every_layer": cost.get("fused"),
                   "unfused_layers": cost.get("unfused_layers"),
                   "read_vs_fp16": cost.get("read_vs_fp16"),
                   "stages_seconds": doc.get("profile", {}).get("stages")}
        if cost.get("fused") is not True:
            raise StepFailure(f"the config has layers the Triton kernel cannot read despite "
                              f"prefer-fast=on: {cost.get('unfused_layers')}")
        return figures

    def generate_kld():
        counts = out / "logs" / "generate-kld.kernel_calls.json"
        doc = cli("generate-kld", ["generate", *model, "--compare", f"fp16,kivi-2,{config}",
                                   "--eval", "kld", "--eval-tokens", str(s.eval_tokens),
                                   "--chunk", str(s.kld_chunk), "--backend", s.backend,
                                   "--device", s.device, "--json", "--report-json",
                                   str(out / "eval.generate.json"), "--overwrite"],
                  counts=counts)
        figures = kld_figures(doc)
        ev = doc.get("evaluation", {}).get("kld", {})
        return {"configs": figures, "tokens": s.eval_tokens, "chunk": s.kld_chunk,
                "backend_requested": s.backend, "exact": ev.get("exact"),
                # chunks of several tokens take the torch path: 0 expected here
                "kernel_calls": _read_counts(counts).get("decode_attention")}

    def generate_ppl(backend):
        def step():
            counts = out / "logs" / f"generate-{backend}.kernel_calls.json"
            doc = cli(f"generate-{backend}",
                      ["generate", *model, "--compare", f"{config},kivi-2", "--eval", "ppl",
                       "--ppl-tokens", str(s.ppl_tokens), "--backend", backend, "--device",
                       s.device, "--json"], counts=counts)
            ppl = {r["name"]: r["ppl"] for r in doc["results"]}
            state[backend] = ppl
            figures = {"backend_requested": backend, "ppl": ppl,
                       "ppl_change": {r["name"]: r.get("ppl_change") for r in doc["results"]},
                       "backend_reason": {r["name"]: r.get("backend_reason")
                                          for r in doc["results"]}}
            calls = _read_counts(counts)
            figures["kernel_calls"] = calls.get("decode_attention")
            if backend == "triton" or s.backend != "triton":
                # the GPU run requires the kernel here; the smoke run records the same verdict
                # on its torch step (not used), so that the reading is exercised on CPU
                verdict = triton_verdict(doc["results"], calls.get("decode_attention", 0),
                                         required=backend == "triton")
                figures["triton"] = verdict
                acc.doc["triton"] = {"requested": s.backend == "triton",
                                     **{k: verdict[k] for k in ("used", "kernel_calls",
                                                                "torch_path_calls",
                                                                "kernel_share", "problems")}}
            elif calls.get("decode_attention"):
                raise StepFailure(f"--backend torch called the Triton kernel "
                                  f"{calls['decode_attention']} times")
            if backend == "torch" and "triton" in state:
                figures["ppl_rel_diff_vs_triton"] = compare_ppl(state["triton"], ppl,
                                                                args.ppl_tolerance)
            return figures
        return step

    def report():
        html = out / "report.html"
        cli("report", ["report", str(out), "-o", str(html), "--overwrite"], as_json=False)
        if not html.is_file() or html.stat().st_size == 0:
            raise StepFailure(f"kvlens report wrote no {html}")
        return {"html": str(html), "bytes": html.stat().st_size}

    def kernel_bench():
        path = out / "bench_kernels.json"
        run_command([sys.executable, str(BENCH_KERNELS), "--contexts",
                     *map(str, args.bench_contexts), "--bits", "2", "4", "--groups", "64",
                     "--layers", "mha", "gqa", "--layouts", *args.bench_layouts,
                     "--out", str(path)], logs / "kernel-bench.log", args.step_timeout, env)
        return bench_figures(json.loads(path.read_text(encoding="utf-8")))

    def engine_step(name):
        def step():
            doc = run_command([sys.executable, str(ENGINE_CHECKS), "--engines", name, "--out",
                               str(out / "engines"), "--device", s.device, "--tokens",
                               str(args.engine_tokens), "--engine-python", args.engine_python,
                               "--timeout", str(args.step_timeout), *model],
                              logs / f"engine-{name}.log", 8 * args.step_timeout, env,
                              stdout_json=True)
            return {"tokens": args.engine_tokens, **doc["engines"][name]}
        return step

    def kernel_tests():
        tenv = {**env, "TRITON_INTERPRET": "0", "KVLENS_KERNEL_TEST_DEVICE": "cuda"}
        run_command([sys.executable, "-m", "pytest", "-q", "-x", *KERNEL_TESTS],
                    logs / "kernel-tests.log", args.step_timeout, tenv)
        return {"tests": list(KERNEL_TESTS)}

    no_kernels = None if s.kernel_bench else "CPU smoke: kernel timings need a GPU"
    use_torch_backend = "CPU smoke: the torch backend only (the Triton interpreter is too slow)"
    return [
        Step("environment", lambda: environment(gpu=s.device == "cuda")),
        Step("capture", capture, ("environment",)),
        Step("plot-outliers", plot_outliers, ("capture",)),
        Step("compare-axes", compare_axes, ("capture",)),
        Step("recommend", recommend, ("capture",)),
        Step("generate-kld", generate_kld, ("recommend",)),
        Step("generate-triton", generate_ppl("triton"), ("recommend",),
             skip=None if s.backend == "triton" else use_torch_backend),
        Step("generate-torch", generate_ppl("torch"), ("recommend",)),
        Step("report", report, ("capture",)),
        Step("kernel-bench", kernel_bench, ("environment",), skip=no_kernels),
        Step("kernel-tests", kernel_tests, ("environment",),
             skip=no_kernels or (None if args.kernel_tests else "not asked (--kernel-tests)")),
        *[Step(f"engine-{name}", engine_step(name), ("environment",))
          for name in args.engine_names],
    ]


def _read_counts(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise StepFailure(f"the kernel-call counter wrote no {path} ({exc})") from exc


def check_budget(acc: Acceptance, budget_s: float | None) -> dict:
    per_step = {n: r.get("seconds", 0.0) for n, r in acc.doc["steps"].items()}
    # the compiled kernel tests (--kernel-tests) and the engine checks are extra, outside it
    extra = sum(t for n, t in per_step.items() if n == "kernel-tests" or n.startswith("engine-"))
    spent = round(time.perf_counter() - acc.t0 - extra, 1)
    if budget_s is not None and spent > budget_s:
        raise StepFailure(f"the run took {spent:.0f} s, over the {budget_s:.0f} s budget "
                          f"(per step: {per_step})")
    return {"budget_s": budget_s, "spent_s": spent}


# -- entry point ----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summary", type=Path, default=None,
                   help="JSON summary path (default: OUT_DIR/summary.json)")
    p.add_argument("--out-dir", type=Path, default=Path("out-gpu"),
                   help="folder for the capture, figures, config, report and logs")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="reduced run on CPU: tiny token counts, torch backend, no kernel steps")
    p.add_argument("--model", default=None,
                   help="--model for every kvlens command (default: the embedded SmolLM2)")
    p.add_argument("--budget-bits", type=float, default=3.0, help="recommend -b")
    p.add_argument("--eval-tokens", type=int, default=4096, help="generate --eval kld tokens")
    p.add_argument("--ppl-tokens", type=int, default=512,
                   help="decode-mode perplexity tokens of the Triton/torch comparison")
    p.add_argument("--ppl-tolerance", type=float, default=0.01,
                   help="largest relative perplexity difference between the two backends")
    p.add_argument("--bench-contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--bench-layouts", nargs="+", default=["kivi", "tokch"],
                   help="bench_kernels.py --layouts")
    p.add_argument("--kernel-tests", action="store_true",
                   help="also run the kernel tests compiled on the GPU (outside the budget)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="the whole run must finish within this many seconds (0: no limit)")
    p.add_argument("--step-timeout", type=float, default=420.0,
                   help="seconds after which a step's process is killed and the step fails")
    p.add_argument("--engines", default=None,
                   help=f"comma list of engine checks ({', '.join(ENGINES)}; default: all on "
                        "the GPU, none with --cpu-smoke; '' for none)")
    p.add_argument("--engine-python", default=sys.executable,
                   help="the interpreter that has the engines installed (default: this one)")
    p.add_argument("--engine-tokens", type=int, default=2048,
                   help="held-out tokens each engine check scores")
    args = p.parse_args(argv)
    if args.engines is None:
        args.engines = "" if args.cpu_smoke else ",".join(ENGINES)
    args.engine_names = list(dict.fromkeys(n.strip().lower() for n in args.engines.split(",")
                                           if n.strip()))
    unknown = [n for n in args.engine_names if n not in ENGINES]
    if unknown:
        p.error(f"unknown engine {', '.join(unknown)} in --engines; allowed: "
                f"{', '.join(ENGINES)} (comma list)")
    if args.engine_tokens < 2:
        p.error(f"--engine-tokens must be at least 2 (one prediction), got {args.engine_tokens}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    s = settings_for(args)
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    acc = Acceptance(args.summary or out / "summary.json",
                     "cpu-smoke" if args.cpu_smoke else "gpu")
    env = dict(os.environ)
    if s.device == "cuda":  # compiled kernels, never the interpreter
        env.pop("TRITON_INTERPRET", None)
    acc.doc["settings"] = {"device": s.device, "backend": s.backend, "out_dir": str(out),
                           "eval_tokens": s.eval_tokens, "ppl_tokens": s.ppl_tokens,
                           "budget_bits": args.budget_bits, "model": args.model or "embedded"}
    try:
        for step in build_steps(args, s, out, env, acc):
            acc.run(step)
        acc.run(Step("budget", lambda: check_budget(acc, s.budget_s),
                     skip=None if s.budget_s else "no budget in this mode"))
    except KeyboardInterrupt:
        return _done(acc, acc.finish(interrupted=True))
    return _done(acc, acc.finish())


def _done(acc: Acceptance, code: int) -> int:
    env = acc.doc["steps"].get("environment", {})
    tri = acc.doc.get("triton", {})
    print(f"{'OK' if code == 0 else 'FAILED'}: {acc.doc['mode']} run in "
          f"{acc.doc['seconds']:.0f} s on {env.get('gpu') or 'CPU'}; Triton used: "
          f"{tri.get('used', False)}; failed: {', '.join(acc.doc['failed_steps']) or 'none'}; "
          f"summary {acc.path}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
