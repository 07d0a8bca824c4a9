"""Evaluation where KV quantization matters: long-context KL divergence against the exact
model, a retrieval grid, a held-out text, and intervals (docs/evaluation.md).

- ``kld``: teacher-forced chunked scoring of a long text through compressed caches and the
  exact model in lockstep (``score_text``, ``summarize``);
- ``needles``: passkey and key-value retrieval over lengths x depths (``build_grid``,
  ``run_grid``, ``summarize``);
- ``heldout``: the built-in held-out text (``heldout_text``);
- ``stats``: Wilson intervals, seeded (paired) bootstrap.

``kvlens.evaluation.evaluate.evaluate_configs`` runs these for ``kvlens generate --eval kld,retrieval``.
"""

from kvlens.evaluation.kld import TextScores, score_text
from kvlens.evaluation.kld import summarize as summarize_kld
from kvlens.evaluation.needles import GridScores, build_grid, run_grid
from kvlens.evaluation.needles import summarize as summarize_grid
from kvlens.evaluation.stats import bootstrap_indices, paired_difference, wilson
from kvlens.text.heldout import HELDOUT_NAME, heldout_text

__all__ = ["HELDOUT_NAME", "GridScores", "TextScores", "bootstrap_indices", "build_grid",
           "heldout_text", "paired_difference", "run_grid", "score_text", "summarize_grid",
           "summarize_kld", "wilson"]
