"""Evaluation where KV quantization matters: long-context KL divergence against the exact
model (``kld``), a retrieval grid (``needles``), short-context checks (``short``) and intervals
(``stats``), run together by ``run.evaluate_configs`` with the options of ``options``
(docs/evaluation.md). ``decode`` is the one greedy loop; ``baselines`` are transformers' own
quantized caches as configs; the held-out text itself is ``kvlens.text.heldout``.
"""

from kvlens.evaluation.kld import TextScores, load_eval_text, score_text
from kvlens.evaluation.kld import summarize as summarize_kld
from kvlens.evaluation.needles import GridScores, build_grid, run_grid
from kvlens.evaluation.needles import summarize as summarize_grid
from kvlens.evaluation.options import EVALS, EvalOptions, parse_evals
from kvlens.evaluation.run import evaluate_configs
from kvlens.evaluation.short import agreement, decode_ppl, passkey_prompts
from kvlens.evaluation.stats import bootstrap_indices, paired_difference, wilson

__all__ = ["EVALS", "EvalOptions", "GridScores", "TextScores", "agreement", "bootstrap_indices",
           "build_grid", "decode_ppl", "evaluate_configs", "load_eval_text", "paired_difference",
           "parse_evals", "passkey_prompts", "run_grid", "score_text", "summarize_grid",
           "summarize_kld", "wilson"]
