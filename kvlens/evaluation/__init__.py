"""Evaluation where KV quantization matters: long-context KL divergence against the exact
model (``kld``), a retrieval grid (``needles``), short-context checks (``short``) and intervals
(``stats``), run together by ``run.evaluate_configs`` with the options of ``options``
(docs/evaluation.md). ``decode`` is the one greedy loop; ``baselines`` are transformers' own
quantized caches as configs; the held-out text itself is ``kvlens.text.heldout``.
"""

from kvlens.evaluation.kld import load_eval_text
from kvlens.evaluation.kld import summarize as summarize_kld
from kvlens.evaluation.options import EvalOptions, parse_evals
from kvlens.evaluation.run import evaluate_configs

# what other packages use; the rest is imported from its module (kvlens.evaluation.needles...)
__all__ = ["EvalOptions", "evaluate_configs", "load_eval_text", "parse_evals", "summarize_kld"]
