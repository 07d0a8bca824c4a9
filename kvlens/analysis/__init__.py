"""Analysis of captured tensors: error metrics (``metrics``), per-axis quantization error
(``compare``), outlier channels (``outliers``) and the real model's per-layer sensitivity
(``sensitivity``). (MiKV's set simulation is research: ``kvlens.research.heavy_hitters``.)"""
