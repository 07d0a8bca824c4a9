"""Models placed by accelerate (``kvlens.model.placement``): parsing and checking --device-map,
--max-memory and --offload-folder, and the real big-model path on CPU: a model loaded with a
``max_memory`` that forces part of it to disk must capture and generate exactly as the same
model loaded whole.

Why "exactly": on one machine accelerate's offload moves weights, it does not change them, and
every layer computes on the same device with the same kernels, so captures are compared bit for
bit and greedy tokens must be identical.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_models import save_model_dir, tiny_config

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.layout import config_device_bytes, config_part_bytes, shape_of
from kvlens.capture.run import capture_model
from kvlens.capture.store import open_capture
from kvlens.config import preset
from kvlens.errors import PlacementError
from kvlens.evaluation.decode import greedy
from kvlens.model.load import load_model
from kvlens.model.placement import (
    input_device,
    layer_devices,
    make_placement,
    parse_device_map,
    parse_max_memory,
    parse_size,
    plan_device_map,
    weights_by_device,
)
from kvlens.model.shape import ModelShape

NAMES = ("q", "k", "v", "q_pre", "k_pre")
GIB, GB = 2**30, 10**9


# -- parsing -------------------------------------------------------------------------------------

def test_parse_max_memory_accelerate_form():
    assert parse_max_memory("0=20GiB, 1=1.5GB,cpu=60GiB,disk=1TiB") == {
        0: 20 * GIB, 1: int(1.5 * GB), "cpu": 60 * GIB, "disk": 2**40}
    assert parse_max_memory("cuda:1=512MiB,CPU=1000") == {1: 512 * 2**20, "cpu": 1000}
    assert parse_size("2G") == 2 * GB


@pytest.mark.parametrize("spec, message", [
    ("cpu:20GiB", "expected DEVICE=SIZE"),
    ("cpu=20XB", "Invalid max_memory size for cpu"),
    ("cpu=0GiB", "more than 0 bytes"),
    ("tpu=1GiB", "Unknown device 'tpu'"),
    ("cpu=1GiB,cpu=2GiB", "twice"),
    (" , ", "empty"),
])
def test_parse_max_memory_errors(spec, message):
    with pytest.raises(PlacementError, match=message):
        parse_max_memory(spec)


def test_parse_device_map(tmp_path):
    assert parse_device_map("balanced") == "balanced"
    assert parse_device_map('{"model.layers.0": 0, "": "cpu"}') == {"model.layers.0": 0,
                                                                     "": "cpu"}
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"lm_head": "disk", "": "cuda:1"}))
    assert parse_device_map(str(path)) == {"lm_head": "disk", "": 1}
    with pytest.raises(PlacementError, match="allowed: auto, balanced"):
        parse_device_map("everywhere")
    with pytest.raises(PlacementError, match="not valid JSON"):
        parse_device_map("{model: 0")
    with pytest.raises(PlacementError, match="not a GPU index"):
        parse_device_map('{"": 1.5}')


def test_make_placement_errors(tmp_path):
    with pytest.raises(PlacementError, match="only applies with device_map"):
        make_placement(None, "cpu=1GiB")
    with pytest.raises(PlacementError, match="explicit device_map"):
        make_placement('{"": "cpu"}', "cpu=1GiB")
    with pytest.raises(PlacementError, match="disk limit but no offload_folder"):
        make_placement("auto", "cpu=1GiB,disk=2GiB")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(PlacementError, match="offload_folder .* is not a writable directory"):
        make_placement("auto", "cpu=1GiB", blocker / "offload")
    if torch.cuda.device_count() == 0:
        with pytest.raises(PlacementError, match="names GPU 0 but this machine has no CUDA GPU"):
            make_placement("auto", "0=20GiB,cpu=1GiB")
    assert make_placement(None) is None


# -- planning ------------------------------------------------------------------------------------

def _big_tiny_config(vocab: int = 49152):
    """A tiny Llama whose layers are big enough (6.4 MB each at float32) for byte limits to
    split it between memory and disk."""
    config = tiny_config("llama")
    config.vocab_size = vocab
    config.intermediate_size = 8192
    config.num_hidden_layers = 4
    return config


def test_plan_splits_memory_and_disk_and_sums_to_the_model(tmp_path):
    config = _big_tiny_config()
    plan = plan_device_map(config, torch.float32,
                           make_placement("auto", "cpu=40MB", tmp_path / "off"))
    assert set(plan.device_map.values()) == {"cpu", "disk"}
    assert plan.bytes_by_device["cpu"] <= 40 * 10**6
    model = _empty(config)
    weights = sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()])
    assert sum(plan.bytes_by_device.values()) == plan.total_bytes == weights


def _empty(config):
    from kvlens.model.placement import empty_model

    return empty_model(config, torch.float32)


def test_plan_refuses_what_cannot_be_held(tmp_path):
    config = _big_tiny_config()
    with pytest.raises(PlacementError) as err:
        plan_device_map(config, torch.float32, make_placement("auto", "cpu=40MB"))
    msg = str(err.value)
    assert "48.2 MiB at float32" in msg and "cpu: 24.1 MiB" in msg
    assert "24.1 MiB would go to disk" in msg and "offload_folder" in msg
    with pytest.raises(PlacementError, match=r"over the disk limit 9.5 MiB"):
        plan_device_map(config, torch.float32,
                        make_placement("auto", "cpu=40MB,disk=10MB", tmp_path / "off"))
    with pytest.raises(PlacementError, match=r"does not place 1 weight tensor\(s\), in modules lm_head"):
        plan_device_map(config, torch.float32, make_placement('{"model": "cpu"}'))
    with pytest.raises(PlacementError, match="modules the model does not have: model.vision"):
        plan_device_map(config, torch.float32, make_placement('{"": "cpu", "model.vision": '
                                                              '"cpu"}'))


# -- the real accelerate path on CPU -------------------------------------------------------------

@pytest.fixture(scope="module")
def big_tiny_dir(tmp_path_factory, tiny_tokenizer):
    # SmolLM2's vocabulary size (the default) keeps the model big enough to offload
    return save_model_dir(tmp_path_factory.mktemp("big-tiny-llama"), _big_tiny_config(),
                          tiny_tokenizer)


def _capture(model, windows, path, layers=None):
    capture_model(model, windows, path, layers=layers, storage_dtype="float32")
    with open_capture(path) as cap:
        return {(i, n): cap.layer(i).read(n) for i in cap.meta.layers for n in NAMES}


def _assert_same_capture(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


def _small_window(name: str, residual: int = 16):
    """A preset with a window short enough that a short prompt is really quantized (groups of
    8 fit the tiny head_dim 16)."""
    cfg = preset(name)
    d = cfg.default
    return replace(cfg, default=replace(
        d, residual_tokens=residual, flush_tokens=min(d.flush_tokens, residual // 2),
        key=replace(d.key, group_size=8), value=replace(d.value, group_size=8)))


def _generate_same_tokens(whole, offloaded, ids, config, new_tokens: int) -> dict:
    """Greedy compressed generation on both models must give the same tokens; returns the
    offloaded run's ``memory_report``."""
    with compressed_attention(whole, config) as s:
        ref, _ = greedy(whole, ids, s, new_tokens)
    with compressed_attention(offloaded, config) as s:
        got, cache = greedy(offloaded, ids, s, new_tokens)
    assert got.tolist() == ref.tolist()
    return memory_report(cache)


def test_tiny_model_offloaded_to_disk_captures_and_generates_exactly(big_tiny_dir, tmp_path):
    whole, tok, _ = load_model(str(big_tiny_dir), device="cpu")
    offl, _, _ = load_model(str(big_tiny_dir), device_map="auto", max_memory="cpu=40MB",
                            offload_folder=str(tmp_path / "off"))
    held = weights_by_device(offl)
    assert held["disk"] > 0 and held["cpu"] > 0
    assert sum(held.values()) == sum(weights_by_device(whole).values())
    assert any(p.device.type == "meta" for p in offl.parameters())  # really offloaded
    assert [str(d) for d in layer_devices(offl)] == ["cpu"] * 4
    assert input_device(offl) == torch.device("cpu")

    windows = torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(0))
    _assert_same_capture(_capture(whole, windows, tmp_path / "a.h5"),
                         _capture(offl, windows, tmp_path / "b.h5"))

    ids = windows[:1]
    config = _small_window("kivi-2")
    rep = _generate_same_tokens(whole, offl, ids, config, 12)
    shape = shape_of(offl)
    tokens = ids.shape[1] + 11
    assert rep["breakdown"]["codes"] > 0  # the prompt was really quantized
    assert rep["by_device"] == {"cpu": rep["kv_bytes"]}
    assert rep["kv_bytes"] == sum(config_part_bytes(config, shape, tokens).values())


def test_per_device_bytes_sum_to_the_total_and_are_predicted():
    """Per-device prediction on a layer split across two (named) devices: each device's
    layers, one rotation copy per device with rotating layers, the sum is the total."""
    config = preset("kivi-2-rot")
    one = ModelShape(4, 2, 2, 64, dtype_bytes=2)
    split = replace(one, devices=("cuda:0", "cuda:0", "cuda:1", "cuda:1"))
    whole = config_part_bytes(config, one, 1000)
    per = config_device_bytes(config, split, 1000)
    rot = 64 * 64 * 4
    assert per["cuda:0"] == per["cuda:1"]
    assert sum(per.values()) == sum(config_part_bytes(config, split, 1000).values()) \
        == sum(whole.values()) + rot
    assert config_device_bytes(config, one, 1000) == {"all": sum(whole.values())}


def test_smollm2_offloaded_to_disk_matches_the_whole_model(smollm2, tmp_path):
    """SmolLM2 from its GGUF conversion with 300 MB of CPU memory: half its layers on disk."""
    whole, tok = smollm2
    offl, _, _ = load_model(None, device_map="auto", max_memory="cpu=300MB",
                            offload_folder=str(tmp_path / "off"))
    held = weights_by_device(offl)
    assert held["disk"] > 200 * 10**6 and 0 < held["cpu"] <= 300 * 10**6
    assert sum(held.values()) == sum(weights_by_device(whole).values())
    assert offl.hf_device_map["model.layers.29"] == "disk"

    ids = tok("The lighthouse keeper climbed the stairs at dusk, " * 12,
              return_tensors="pt").input_ids[:, :48]
    layers = [0, 15, 29]
    _assert_same_capture(_capture(whole, ids, tmp_path / "a.h5", layers),
                         _capture(offl, ids, tmp_path / "b.h5", layers))

    rep = _generate_same_tokens(whole, offl, ids, _small_window("kivi-2"), 8)
    assert rep["breakdown"]["codes"] > 0 and sum(rep["by_device"].values()) == rep["kv_bytes"]


def test_gguf_device_map_needs_a_writable_conversion_cache(monkeypatch, tmp_path):
    """A GGUF model is placed from its safetensors conversion: without a writable cache the
    error comes at once, before the slow dequantization."""
    from kvlens.errors import ModelLoadError

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("KVLENS_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelLoadError, match="cannot be written under .*Set KVLENS_CACHE"):
        load_model(None, device_map="auto")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_neox", "qwen3"])
def test_tiny_architectures_split_between_memory_and_disk(arch, tmp_path):
    """GQA, sliding + full layers with QK-norm, fused QKV with partial rotary: each placed by
    the planned map with part of it on disk captures bit for bit and generates the same tokens
    as the model loaded whole."""
    from tiny_models import tiny_model
    from transformers import AutoModelForCausalLM

    tiny_model(arch).save_pretrained(tmp_path / "m")
    load = dict(dtype=torch.float32, attn_implementation="sdpa")
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "m", **load).eval()
    total = sum(t.numel() * 4 for t in [*whole.parameters(), *whole.buffers()])
    placement = make_placement("sequential", {"cpu": int(0.7 * total)}, tmp_path / "off")
    plan = plan_device_map(whole.config, torch.float32, placement)
    assert plan.bytes_by_device.get("disk", 0) > 0 and plan.bytes_by_device.get("cpu", 0) > 0
    offl = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=plan.device_map,
                                                offload_folder=placement.offload_folder,
                                                **load).eval()
    held = weights_by_device(offl)  # non-persistent buffers (RoPE) stay in memory: measured
    assert sum(held.values()) == plan.total_bytes
    assert 0 < held["disk"] <= plan.bytes_by_device["disk"]

    windows = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    _assert_same_capture(_capture(whole, windows, tmp_path / "a.h5"),
                         _capture(offl, windows, tmp_path / "b.h5"))
    rep = _generate_same_tokens(whole, offl, windows, _small_window("kivi-2"), 10)
    assert rep["breakdown"]["codes"] > 0
