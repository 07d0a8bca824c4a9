"""Evaluation where KV quantization matters: long-context KL divergence against the exact
model, a retrieval grid, a held-out text, short-context checks, and intervals
(docs/evaluation.md).

- ``options``: what ``kvlens generate --eval`` runs (``EVALS``, ``EvalOptions``,
  ``parse_evals``), checked before a model loads;
- ``run``: ``evaluate_configs`` runs the requested evaluations for every config;
- ``kld``: teacher-forced chunked scoring of a long text through compressed caches and the
  exact model in lockstep (``score_text``, ``summarize``; ``load_eval_text`` reads the text);
- ``needles``: passkey and key-value retrieval over lengths x depths (``build_grid``,
  ``run_grid``, ``summarize``);
- ``short``: the short-context checks, decode-mode perplexity, passkey and agreement;
- ``decode``: greedy decoding through a compressed cache; ``baselines``: transformers' own
  quantized caches as configs; ``stats``: Wilson intervals, seeded (paired) bootstrap.

The held-out text itself is ``kvlens.text.heldout``.
"""

from kvlens.evaluation.kld import TextScores, load_eval_text, score_text
from kvlens.evaluation.kld import summarize as summarize_kld
from kvlens.evaluation.needles import GridScores, build_grid, run_grid
from kvlens.evaluation.needles import summarize as summarize_grid
from kvlens.evaluation.options import EVALS, EvalOptions, parse_evals
from kvlens.evaluation.run import evaluate_configs
from kvlens.evaluation.short import agreement, decode_ppl, passkey_prompts
from kvlens.evaluation.stats import bootstrap_indices, paired_difference, wilson
from kvlens.text.heldout import HELDOUT_NAME, heldout_text

__all__ = ["EVALS", "HELDOUT_NAME", "EvalOptions", "GridScores", "TextScores", "agreement",
           "bootstrap_indices", "build_grid", "decode_ppl", "evaluate_configs", "heldout_text",
           "load_eval_text", "paired_difference", "parse_evals", "passkey_prompts", "run_grid",
           "score_text", "summarize_grid", "summarize_kld", "wilson"]
