"""Matplotlib figures: ``outliers`` for ``plot-outliers``, ``compare`` for ``compare-axes``."""
