"""The model side: loading a ``--model`` spec (``load``), where weights live (``placement``),
what kvlens needs of an architecture (``architecture``) and the attention hooks (``hooks``)."""
