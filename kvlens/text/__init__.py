"""Text inputs: the built-in corpus and held-out text (``data/``), token windows
(``corpus``, ``heldout``), prompt builders for probes and retrieval (``prompts``) and index
selections (``selection``)."""
