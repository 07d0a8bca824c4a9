"""The HDF5 capture format: self-description, atomic writes, refusing bad files."""

from __future__ import annotations

import h5py
import pytest
import torch
from helpers import write_capture
from tiny_models import tiny_model

from kvlens.capture.run import capture_model
from kvlens.capture.store import SCHEMA_VERSION, CaptureMeta, open_capture
from kvlens.errors import CaptureFileError, InputError, NumericalError
from kvlens.model.shape import ModelShape


def _meta(**over):
    base = dict(model="synthetic", shape=ModelShape(2, 4, 2, 8, has_rope=False),
                rope_layout="none", rotary_dim=0,
                compute_dtype="float32", storage_dtype="float32", num_samples=2, num_tokens=5,
                layers=(0, 1))
    base.update(over)
    return CaptureMeta(**base)


def _tensors(meta, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in meta.layers:
        out[layer] = {}
        for name in ("q", "k", "v", "q_pre", "k_pre"):
            shape = meta.shape
            h = shape.num_attention_heads if name.startswith("q") else shape.num_key_value_heads
            out[layer][name] = torch.randn(meta.num_samples, h, meta.num_tokens, shape.head_dim,
                                           generator=g)
    return out


def test_round_trip_and_self_description(tmp_path):
    meta = _meta()
    data = _tensors(meta)
    path = write_capture(tmp_path / "syn.h5", meta, data)
    with open_capture(path) as cap:
        assert cap.meta.schema_version == SCHEMA_VERSION
        assert cap.meta.shape.head_dim == 8 and cap.layers == (0, 1)
        assert torch.equal(cap.layer(1).read("v"), data[1]["v"])
        assert torch.equal(cap.layer(0).read("q", samples=[1], heads=[0, 2]),
                           data[0]["q"][[1]][:, [0, 2]])
    with h5py.File(path) as f:
        ds = f["layers/001/k"]
        assert [d.label for d in ds.dims] == ["sample", "head", "token", "channel"]
        assert f.attrs["kvlens_format"] == "kvlens-capture"


def test_bfloat16_is_stored_losslessly(tmp_path):
    meta = _meta(storage_dtype="bfloat16")
    data = _tensors(meta)
    path = write_capture(tmp_path / "bf.h5", meta, data)
    with open_capture(path) as cap:
        got = cap.layer(0).read("k")
    assert torch.equal(got, data[0]["k"].to(torch.bfloat16).float())


def test_refuses_missing_foreign_newer_and_corrupt_files(tmp_path):
    with pytest.raises(CaptureFileError, match="not found"):
        open_capture(tmp_path / "nope.h5")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"this is not hdf5" * 100)
    with pytest.raises(CaptureFileError, match="not a readable HDF5"):
        open_capture(junk)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = [1, 2, 3]
    with pytest.raises(CaptureFileError, match="not a kvlens capture"):
        open_capture(foreign)
    newer = write_capture(tmp_path / "newer.h5", _meta(), _tensors(_meta()))
    with h5py.File(newer, "a") as f:
        f.attrs["kvlens_schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(CaptureFileError, match="newer than this kvlens supports"):
        open_capture(newer)
    # A truncated file (e.g. a copy cut short) is reported as unreadable, not half-read.
    good = write_capture(tmp_path / "good.h5", _meta(), _tensors(_meta()))
    cut = tmp_path / "cut.h5"
    cut.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(CaptureFileError):
        open_capture(cut)


def test_incomplete_file_is_refused(tmp_path):
    path = write_capture(tmp_path / "x.h5", _meta(), _tensors(_meta()))
    with h5py.File(path, "a") as f:  # what a killed writer leaves behind
        f.attrs["complete"] = False
    with pytest.raises(CaptureFileError, match="incomplete capture"):
        open_capture(path)


def test_interrupted_capture_leaves_nothing(tmp_path):
    model = tiny_model("llama")
    windows = torch.randint(0, 128, (3, 9))

    def interrupt(done, total, note):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture_model(model, windows, tmp_path / "run.h5", progress=interrupt)
    assert list(tmp_path.iterdir()) == []
    assert not model.config._attn_implementation.startswith("kvlens")


def test_existing_output_needs_overwrite(tmp_path):
    model = tiny_model("llama")
    windows = torch.randint(0, 128, (1, 9))
    target = tmp_path / "run.h5"
    target.write_text("precious")
    with pytest.raises(InputError, match="pass overwrite to replace it"):
        capture_model(model, windows, target)
    assert target.read_text() == "precious"
    capture_model(model, windows, target, overwrite=True)
    with open_capture(target) as cap:
        assert cap.meta.num_tokens == 9


def test_nan_activation_names_the_layer(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="Layer 1 produced NaN/Inf in k") as err:
        capture_model(model, torch.randint(0, 128, (1, 9)), tmp_path / "nan.h5")
    assert err.value.fields == ("dtype",)  # the fix names the option by its field
    assert list(tmp_path.iterdir()) == []
