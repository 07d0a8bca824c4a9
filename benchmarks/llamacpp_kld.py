"""KL divergence of llama.cpp's quantized KV caches against its f16 cache, on kvlens's protocol.

The real engine, not a simulation: ``llama-cpp-python`` (built from its PyPI source; not a
kvlens dependency, never in CI) runs the model's GGUF twice in lockstep on the same chunks of
the held-out text, once with an f16 KV cache (the reference) and once with ``type_k/type_v``,
flash attention on (llama.cpp needs it for a quantized V cache). Tokens are the ones
``kvlens generate --eval kld`` scores (the model's HF tokenizer, no special tokens, the first
``--eval-tokens``), the chunking is the same (``--chunk``, default 64 = ``n_batch`` =
``n_ubatch``), and the statistics and bootstrap intervals are kvlens's own
(``kvlens.evaluation.kld.summarize``), so the figures sit beside kvlens's in one table.

In llama.cpp every token is written to the quantized cache before attention reads it, the
current batch included: every scored prediction reads quantized entries (share 1.0).

    PYTHONPATH=/path/to/llama_cpp_site python benchmarks/llamacpp_kld.py \\
        --model default --types q8_0/q4_0,q4_0/q4_0,q8_0/q8_0 --json out.json

``--no-rotation`` sets ``LLAMA_ATTN_ROT_DISABLE=1`` (llama.cpp then stores K and V unrotated).
``--no-extra-bufts`` loads the weights without llama.cpp's extra CPU buffer types (AMX, weight
repacking: ``llama_model_params.use_extra_bufts = false``), the plain ``mul_mat`` path kvlens
simulates; a native build on a CPU that reports AMX but may not use it (a VM) needs it.
Compare the result with the simulation: ``benchmarks/llamacpp_vs_sim.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

#: bits per element of llama.cpp's cache types (block of 32 elements + fp16 scale [+ fp16 min])
TYPE_BITS = {"f16": 16.0, "bf16": 16.0, "f32": 32.0, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0,
             "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5}


def _ggml_type(llama_cpp, name: str) -> int:
    attr = f"GGML_TYPE_{name.upper()}"
    if not hasattr(llama_cpp, attr):
        raise SystemExit(f"unknown llama.cpp cache type {name!r}; allowed: {', '.join(TYPE_BITS)}")
    return getattr(llama_cpp, attr)


def _context(llama_cpp, path: str, n_ctx: int, chunk: int, type_k: str, type_v: str,
             threads: int):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=chunk, n_ubatch=chunk,
                 type_k=_ggml_type(llama_cpp, type_k), type_v=_ggml_type(llama_cpp, type_v),
                 flash_attn=True, logits_all=False, n_threads=threads,
                 n_threads_batch=threads, verbose=False)


def _no_extra_bufts() -> None:
    """Make every later ``Llama(...)`` load its weights with ``use_extra_bufts = false``
    (llama-cpp-python has no argument for it: its default params are patched)."""
    import llama_cpp.llama as llama_module

    default = llama_module.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_module.llama_cpp.llama_model_default_params = params


def _chunk_logits(llm, tokens: list[int], n_past: int) -> np.ndarray:
    """Decode ``tokens`` at positions ``n_past...`` and return their logits ``[m, vocab]``.

    Uses the context directly (not ``Llama.eval``) so that no ``n_ctx x vocab`` score matrix is
    allocated (4.4 GB for Gemma3's 262k vocabulary at 4096 tokens)."""
    llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
    llm._ctx.decode(llm._batch)
    vocab = llm.n_vocab()
    flat = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(tokens) * vocab,))
    return flat.reshape(len(tokens), vocab).astype(np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def score_types(llama_cpp, path: str, ids: list[int], chunk: int, pairs: list[tuple[str, str]],
                threads: int):
    """TextScores of K/V type pairs against the f16 cache, all in lockstep (all llama.cpp)."""
    from kvlens.evaluation.kld import TextScores, TokenScores

    n = len(ids)
    ref = _context(llama_cpp, path, n + chunk, chunk, "f16", "f16", threads)
    tests = [_context(llama_cpp, path, n + chunk, chunk, k, v, threads) for k, v in pairs]
    starts = list(range(0, n, chunk))
    configs = [TokenScores(f"llama.cpp {k}/{v}") for k, v in pairs]
    scores = TextScores(tokens=n, chunk=chunk, chunks_total=len(starts), configs=configs)
    t0 = time.perf_counter()
    for k, s in enumerate(starts):
        x = ids[s:s + chunk]
        targets = np.asarray(ids[s + 1:s + chunk + 1])
        m = len(targets)
        rows = np.arange(m)
        le = _log_softmax(_chunk_logits(ref, x, s))[:m]
        pe = np.exp(le)
        for ts, test in zip(configs, tests):
            lq = _log_softmax(_chunk_logits(test, x, s))[:m]
            ts.kld.extend(np.clip((pe * (le - lq)).sum(-1), 0.0, None).tolist())
            ts.top1.extend((le.argmax(-1) == lq.argmax(-1)).tolist())
            ts.nll.extend((-lq[rows, targets]).tolist())
            ts.quantized.extend([True] * m)
        scores.nll_exact.extend((-le[rows, targets]).tolist())
        scores.chunk_of_token.extend([k] * m)
        scores.chunks_done = k + 1
        if (k + 1) % 8 == 0:
            print(f"  chunk {k + 1}/{len(starts)} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)
    scores.seconds = {"all_forwards": round(time.perf_counter() - t0, 1)}
    return scores


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="'default' (SmolLM2) or a .gguf path")
    ap.add_argument("--types", default="q8_0/q4_0,q4_0/q4_0,q8_0/q8_0",
                    help="comma-separated K/V cache type pairs")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-rotation", action="store_true",
                    help="LLAMA_ATTN_ROT_DISABLE=1: no Hadamard rotation of Q/K/V")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="no AMX / repacked weight buffers (use_extra_bufts = false)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.no_rotation:
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
    import llama_cpp

    if args.no_extra_bufts:
        _no_extra_bufts()

    from kvlens.evaluation import load_eval_text
    from kvlens.evaluation.kld import summarize
    from kvlens.model.load import load_model

    _, tokenizer, source = load_model(None if args.model == "default" else args.model)
    if source.kind != "gguf":
        raise SystemExit(f"llama.cpp runs GGUF files; {args.model} is not one")
    path = os.path.join(source.location, source.gguf_file)
    text, text_source = load_eval_text(None)
    ids = tokenizer(text, add_special_tokens=False).input_ids[:args.eval_tokens]
    print(f"llama-cpp-python {llama_cpp.__version__}, {path}, {len(ids)} tokens of "
          f"{text_source}, chunk {args.chunk}, rotation "
          f"{'off' if args.no_rotation else 'llama.cpp default'}", file=sys.stderr)
    pairs = [tuple(p.split("/")) if "/" in p else (p, p) for p in args.types.split(",")]
    scores = score_types(llama_cpp, path, ids, args.chunk, pairs, args.threads)
    summary = summarize(scores)
    results = summary["configs"]
    for doc, (type_k, type_v) in zip(results, pairs):
        doc["bits_per_element"] = (TYPE_BITS[type_k] + TYPE_BITS[type_v]) / 2
        doc["type_k"], doc["type_v"] = type_k, type_v
        print(f"{doc['name']}: bits {doc['bits_per_element']:.2f}  mean KLD "
              f"{doc['mean_kld']['value']:.4f} {doc['mean_kld']['ci95']}  top-1 "
              f"{doc['top1_agreement']['value']:.4f}  ppl change "
              f"{100 * doc['ppl_change']['value']:+.2f}%", file=sys.stderr)
    out = {"engine": "llama-cpp-python", "version": llama_cpp.__version__, "model": path,
           "text_source": text_source, "tokens": len(ids), "chunk": args.chunk,
           "rotation": not args.no_rotation, "flash_attn": True,
           "extra_bufts": not args.no_extra_bufts,
           "protocol": summary["protocol"], "exact": summary["exact"], "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps([{k: r[k] for k in ("name", "bits_per_element")}
                      | {s: r[s]["value"] for s in ("mean_kld", "top1_agreement", "ppl_change")}
                      for r in results], indent=1))


if __name__ == "__main__":
    main()
