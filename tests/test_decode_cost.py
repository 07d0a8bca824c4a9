"""`recommend`'s decode cost: the bytes-read model per layout (`kvlens.cache.decode_cost`) and
`--prefer-fast` (only layouts the fused Triton decode kernel reads)."""

from __future__ import annotations

import json

import pytest
from helpers import small_options
from test_recommend import _planted_capture, runner

import kvlens.research  # noqa: F401  (registers the mikv-* presets these tests price)
from kvlens.cli import app
from kvlens.errors import InputError
from kvlens.recommend import recommend


def test_decode_cost_model_counts_bytes_read_per_step():
    """The bytes-read model on SmolLM2's shape: kivi-2 at 4096 tokens reads exactly its codes
    and scales (window empty after the flush), 3/16 of fp16; a partly filled window adds only
    its filled tokens; layouts without a fused kernel path say why."""
    from kvlens.cache.decode_cost import config_decode_cost
    from kvlens.config import preset
    from kvlens.model.shape import ModelShape

    shape = ModelShape(30, 3, 3, 64)
    c = config_decode_cost(preset("kivi-2"), shape, 4096)
    per_head = 2 * 4096 * 64 // 4 + 4 * 4096 * 64 * 2 // 32  # codes K+V, scale+zero K+V
    assert c.read_bytes == 30 * 3 * per_head
    assert c.fp16_bytes == 30 * 2 * 3 * 4096 * 64 * 2
    assert c.ratio_fp16 == pytest.approx(3 / 16)
    assert c.torch_unpack_bytes == 2 * c.fp16_bytes  # float32 K and V, one chunk at a time
    assert c.fused and c.to_dict()["fused"]
    c2 = config_decode_cost(preset("kivi-2"), shape, 4000)  # 3968 packed + 32 in the window
    per_head = (2 * 3968 * 64 // 4 + 4 * 3968 * 64 * 2 // 32) + 2 * 32 * 64 * 2
    assert c2.read_bytes == 30 * 3 * per_head
    # 8-bit metadata: the kernel reads one byte per scale and per zero (decoded in registers)
    from dataclasses import replace

    c8 = config_decode_cost(replace(preset("kivi-2"), scale_dtype="8bit"), shape, 4096)
    assert c8.read_bytes == 30 * 3 * (2 * 4096 * 64 // 4 + 2 * 4096 * 64 * 2 // 32)
    assert c8.fused
    pre = config_decode_cost(preset("kivi-2-prerope"), shape, 4096)
    assert not pre.fused and "pre-RoPE" in pre.unfused[0]
    assert pre.read_bytes > c.read_bytes  # + the RoPE positions
    assert "heavy hitters" in config_decode_cost(preset("mikv-2"), shape, 4096).unfused[0]


def test_prefer_fast_keeps_only_fused_layouts(tmp_path):
    path = _planted_capture(tmp_path / "p.h5")
    opts = small_options(budget_bits=3.5, group_sizes=(32,), bits=(2, 4), prefer_fast=True)
    rec = recommend(path, opts)
    assert all(c.candidate.stage == "post" for c in rec.choices)
    names = [n for n, _ in rec.decode_cost]
    assert names[0] == rec.config.name and "kivi-2" in names and "fp16" in names
    assert rec.decode_cost[0][1].fused
    assert "per-token-4" not in names  # G64 per-token groups do not fit head_dim 32
    with pytest.raises(InputError, match="prefer_fast=on keeps only"):
        small_options(budget_bits=3.5, pre_rope="on", prefer_fast=True)
    res = runner.invoke(app, ["recommend", str(path), "-b", "3.5", "--set", "group-sizes=32",
                              "--set", "bits=2,4", "--set", "prefer-fast=on", "--json", "--windows", "128"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["decode_cost"][0]["fused"] and doc["decode_cost"][0]["read_vs_fp16"] < 0.5
    assert doc["config"]["scale_dtype"] == "8bit"  # the kernel reads 8-bit metadata too
    res = runner.invoke(app, ["recommend", str(path), "-b", "3.5", "--set", "group-sizes=32",
                              "--set", "bits=2,4", "--windows", "128"])
    assert res.exit_code == 0 and "Decode cost at 4,096 tokens" in res.output
