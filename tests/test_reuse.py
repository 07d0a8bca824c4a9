"""Kept measurements (kvlens.recommend.reuse and its file format, reuse.CODEC): a measurement read
back allocates exactly as the one measured; a file that is not one this format wrote (a planted
pickle, an npz that needs pickle, a truncated, corrupted or other-version file) is refused
unexecuted and measured again. The CLI's reuse (budgets, options, LRU) is in
test_recommend.py::test_recommend_reuses_a_kept_measurement."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import small_options
from test_recommend import _planted_capture

import kvlens.research  # noqa: F401  (registers the MiKV set twins these tests measure)
from kvlens.model.mla import MlaShape
from kvlens.recommend import reuse
from kvlens.recommend.catalog import family
from kvlens.recommend.codec import CodecError
from kvlens.recommend.options import Stream
from kvlens.recommend.pipeline import Measurements, choose, measure
from kvlens.recommend.profile import Profile
from kvlens.recommend.run import recommend

encode, decode, VERSION = reuse.CODEC.encode, reuse.CODEC.decode, reuse.CODEC.version

KVLENS = Path(__file__).resolve().parents[1] / "kvlens"


def _opts(**kw):
    """MiKV set twins, balanced and rotated candidates, both key fits, two windows (two streams
    per candidate): every kind of candidate field the format carries."""
    kw = {"budget_bits": 3.0, "extensions": ("mikv",), "key_fits": ("minmax", "mse"),
          "windows": (32, 64), "group_sizes": (32,), **kw}
    return small_options(**kw)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = _planted_capture(tmp_path_factory.mktemp("reuse") / "p.h5")
    return path, measure(path, _opts())


def _same(a: Measurements, b: Measurements) -> None:
    """Every field equal, tensors bit for bit with their dtype."""
    for f in ("meta", "tables", "weights", "notes", "factors"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.profile.stages == b.profile.stages
    assert a.balancers.keys() == b.balancers.keys()
    for i in a.balancers:
        assert a.balancers[i].dtype == b.balancers[i].dtype
        assert torch.equal(a.balancers[i], b.balancers[i])


def _same_choice(a: Measurements, b: Measurements, opts) -> list[tuple[str, str]]:
    ra, rb = choose(a, opts), choose(b, opts)
    assert ra.choices == rb.choices
    assert ra.config.to_dict() == rb.config.to_dict()
    assert ra.mean_bits == rb.mean_bits and ra.notes == rb.notes
    return [(c.tensor, c.candidate.short) for c in ra.choices]


def test_read_back_allocates_as_measured(measured):
    """The round trip on a real measurement with MiKV set twins, balanced and rotated
    candidates and fitted keys: the same fields and, at several budgets, the same
    recommendation."""
    _, m = measured
    back = decode(encode(m))
    _same(m, back)
    cands = {c for t in back.tables for c, _ in t}
    assert back.balancers and any(c.twin for c in cands) and any(c.rotate for c in cands)
    assert any(c.fit == "mse" and c.tensor == "key" for c in cands)
    for budget in (2.7, 3.0, 3.2, 4.0):
        _same_choice(m, back, _opts(budget_bits=budget))
    # with only set twins (or balanced candidates) for keys, the allocation takes them from the
    # read-back file as from the measurement: what the format carries beyond plain candidates
    # is used (a layer takes a set for both tensors; the balancer is the keys' alone)
    for keep, word, tensors in ((lambda c: c.twin, " set", ("key", "value")),
                                (lambda c: c.balancer, " bal", ("key",))):
        a, b = (_only_keys(x, keep) for x in (m, back))
        chosen = _same_choice(a, b, _opts(budget_bits=4.0))
        assert all(word in c for t, c in chosen if t in tensors), chosen


def _only_keys(m: Measurements, keep) -> Measurements:
    """``m`` with every key candidate but those with ``keep(c)`` dropped."""
    return dataclasses.replace(m, tables=[{cs: e for cs, e in t.items()
                                           if cs[0].tensor == "value" or keep(cs[0])}
                                          for t in m.tables])


def test_encoder_carries_weights_factors_and_odd_values(measured):
    """Layer weights, per-layout factors (hand-made: `--sensitivity layout` needs a model),
    a None score error, an unwindowed probe entry, NaN, half and bfloat16 tensors and the
    capture's extra metadata (nested, tuples, arrays) read back exactly; the factors and
    weights steer the allocation the same way after the round trip."""
    _, m = measured
    tables = [dict(t) for t in m.tables]
    (c, s), (out, _, recon) = next(iter(tables[0].items()))
    tables[0][c, s] = (out, None, recon)
    tables[1][c, None] = (float("nan"), None, float("inf"))  # a probe entry
    fams = [dict.fromkeys(family(k[0]) for k in t) for t in tables]
    factors = tuple({f: 0.25 + (i + j) % 3 for j, f in enumerate(fs)}
                    for i, fs in enumerate(fams))
    extra = {"vocab_size": 49152, "note": "x", "ratio": 0.1, "flag": True, "none": None,
             "nested": {"a": [1, (2.5, "b")], "t": ()},
             "arr": np.arange(6, dtype=np.int32).reshape(2, 3)}
    shape = dataclasses.replace(m.meta.shape, windows=(None, 64), mla=MlaShape(8, 24, 16, 16))
    odd = dataclasses.replace(
        m, meta=dataclasses.replace(m.meta, extra=extra, shape=shape), tables=tables,
        weights=(1.0, 2.5), factors=factors, profile=Profile({"candidate errors": 0.125}),
        balancers={0: m.balancers[0].half(), 1: m.balancers[1].bfloat16()},
        notes=["ünïcode note"])
    back = decode(encode(odd))
    assert back.tables[1][c, None][1] is None and np.isnan(back.tables[1][c, None][0])
    back.tables[1][c, None] = odd.tables[1][c, None] = (0.5, None, 0.5)  # NaN != NaN
    arr = back.meta.extra.pop("arr")
    assert arr.dtype == np.int32 and np.array_equal(arr, extra.pop("arr"))
    assert type(back.meta.extra["nested"]["a"][1]) is tuple
    _same(odd, back)
    assert type(back.weights[0]) is float
    assert all(type(x) is float for row in back.factors for x in row.values())
    for budget in (2.9, 3.2):
        _same_choice(odd, back, _opts(budget_bits=budget))


def _rezipped(data: bytes, edit) -> bytes:
    """A kept file with its JSON document passed through ``edit`` (arrays unchanged)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name in src.namelist():
            raw = src.read(name)
            if name == "document.npy":
                doc = json.loads(np.load(io.BytesIO(raw)).tobytes())
                edit(doc)
                buf = io.BytesIO()
                np.save(buf, np.frombuffer(json.dumps(doc).encode(), np.uint8))
                raw = buf.getvalue()
            z.writestr(name, raw)
    return out.getvalue()


class _Payload:
    """Unpickled, it creates ``marker``: what a planted file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_not_run_and_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_MEASUREMENT_CACHE", str(tmp_path / "kept"))
    path = _planted_capture(tmp_path / "p.h5")
    opts = small_options(budget_bits=3.0, windows=(64,), group_sizes=(32,))
    kept = reuse.kept_file(path, opts)
    assert kept.suffix == ".npz"
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Payload(marker))
    kept.parent.mkdir()
    kept.write_bytes(payload)
    assert reuse.read_kept(kept) is None and not marker.exists()
    notes = []
    rec = recommend(path, opts, log=notes.append)
    assert not marker.exists() and rec.predicted is not None  # measured, not reused
    assert not any("reused" in n for n in notes)
    assert reuse.read_kept(kept) is not None  # replaced by the fresh measurement
    # an npz whose array needs pickle (an object array), at the kept path: refused unread
    np.savez(buf := io.BytesIO(), document=np.zeros(3, np.uint8),
             a0=np.array([_Payload(marker)], dtype=object))
    kept.write_bytes(buf.getvalue())
    assert reuse.read_kept(kept) is None and not marker.exists()
    # the payload is live: the refusal, not a dud, kept the marker away
    pickle.loads(payload)
    assert marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "version", "format",
                                    "typed field", "unknown key", "index", "compressed",
                                    "empty"])
def test_a_damaged_or_foreign_file_is_measured_again(measured, tmp_path, damage):
    _, m = measured
    data = encode(m)
    assert decode(_rezipped(data, lambda doc: None)).tables == m.tables  # the edit fails it
    bad = {
        "truncated": lambda: data[: len(data) // 2],
        "flipped byte": lambda: data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1])
        + data[len(data) // 2 + 1:],
        "version": lambda: _rezipped(data, lambda d: d.update(version=VERSION + 1)),
        "format": lambda: _rezipped(data, lambda d: d.update(format="other")),
        "typed field": lambda: _rezipped(data, lambda d: d["candidates"][0].update(bits="2")),
        "unknown key": lambda: _rezipped(data, lambda d: d.update(code="print(1)")),
        "index": lambda: _rezipped(data, lambda d: d["balancers"][0][1].update(array=10**6)),
        "compressed": lambda: _recompressed(data),
        "empty": lambda: b"",
    }[damage]()
    with pytest.raises(CodecError):
        decode(bad)
    kept = tmp_path / "k.npz"
    kept.write_bytes(bad)
    assert reuse.read_kept(kept) is None


def _recompressed(data: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name in src.namelist():
            z.writestr(name, src.read(name))
    return out.getvalue()


def test_a_kept_file_is_a_plain_npz(measured, tmp_path):
    """numpy opens it without pickle: the document and numeric arrays only."""
    _, m = measured
    kept = tmp_path / "k.npz"
    reuse.keep(m, kept)
    with np.load(kept, allow_pickle=False) as z:
        doc = json.loads(z["document"].tobytes())
        assert doc["format"] == "kvlens.measurements" and doc["version"] == VERSION
        assert all(z[n].dtype.kind in "biuf" for n in z.files)


def test_a_measurement_the_format_cannot_hold_is_not_kept(measured, tmp_path):
    _, m = measured
    odd = dataclasses.replace(m, balancers={0: m.balancers[0].to(torch.int64)})
    with pytest.raises(CodecError, match="tensor"):
        encode(odd)
    with pytest.warns(UserWarning, match="not kept"):
        reuse.keep(odd, tmp_path / "k.npz")
    assert not list(tmp_path.iterdir())


def test_kvlens_reads_nothing_with_pickle():
    """No module of kvlens imports pickle (or its kin) or loads with it."""
    pattern = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|shelve|marshal)"
                         r"\b|\b(pickle|dill|cloudpickle|marshal)\.loads?\(", re.M)
    found = [f"{f.relative_to(KVLENS)}: {hit.group(0).strip()}"
             for f in sorted(KVLENS.rglob("*.py")) for hit in pattern.finditer(f.read_text())]
    assert found == []
    # the pattern finds what it is for
    assert pattern.search("import pickle\n") and pattern.search("x = pickle.loads(b)")


@pytest.mark.slow  # a tiny model's layout sensitivity: about 10 s
def test_a_layout_measurement_reads_back(tmp_path, tiny_tokenizer):
    """`--sensitivity layout` on a tiny model: its measured weights and factors read back and
    allocate the same."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    from kvlens.capture.run import capture_model

    config = tiny_config("llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    mdir = tmp_path / "model"
    model.save_pretrained(mdir)
    tiny_tokenizer.save_pretrained(mdir)
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "c.h5"
    capture_model(model, ids, path, storage_dtype="float32")
    opts = small_options(budget_bits=5.0, context=512, residual_tokens=16, group_sizes=(16,),
                         bits=(2, 4), tokens=None, sensitivity="layout", model=str(mdir),
                         retrieval="off")
    m = measure(path, opts)
    assert m.factors and all(m.factors)
    back = decode(encode(m))
    _same(m, back)
    for budget in (4.0, 4.5, 5.0):
        _same_choice(m, back, dataclasses.replace(opts, budget_bits=budget))


def test_stream_keys_read_back_as_streams(measured):
    _, m = measured
    back = decode(encode(m))
    assert all(type(s) is Stream for t in back.tables for _, s in t)
