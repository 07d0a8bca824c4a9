"""Analysis of captured tensors: error metrics (``metrics``), per-axis quantization error
(``compare``), outlier channels (``outliers``), MiKV set simulation (``heavy_hitters``) and the
real model's per-layer sensitivity (``sensitivity``)."""
