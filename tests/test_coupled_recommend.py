"""Coupled (CQ) candidates in ``recommend`` behind the research door (``--set coupled=on``,
issue #50): offered only when asked, measured held out with codebooks fitted on the capture, chosen into
a config that loads, runs in ``generate`` and holds the bits it reports, kept and read back
exactly, and dropped again when a kept measurement is allocated without the lever."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import rand, small_options
from test_reuse import _rezipped
from tiny_models import tiny_model
from typer.testing import CliRunner

import kvlens.recommend
from kvlens.analysis.metrics import per_head_rel_error
from kvlens.capture.run import capture_model
from kvlens.capture.store import open_capture
from kvlens.cli import app
from kvlens.errors import InputError, KvlensError
from kvlens.quant import (
    CoupledCodebooks,
    CoupledSpec,
    fake_quantize_coupled,
    fit_coupled,
    held_out_coupled,
)
from kvlens.recommend import Candidate, RecommendOptions, candidates, choose, family, measure
from kvlens.recommend.catalog import still_offered
from kvlens.recommend.kept_format import KeptFormatError, decode, encode
from kvlens.recommend.layer_errors import coupled_slot
from kvlens.recommend.options import COUPLED_SETTINGS, PER_VECTOR
from kvlens.recommend.reuse import measurement_key
from kvlens.research import describe, parse_settings

runner = CliRunner()
CONTEXT = 64  # tokens the tiny model's cache holds after the generation below (its codebooks
# cost about 5 bits per element at this length: the budget is 12)


def _coupled(tensors=("key", "value"), channels=(2, 4)):
    return {Candidate.coupled_codes(t, c, b) for t in tensors for c, b in COUPLED_SETTINGS
            if c in channels}


def _opts(**kw):
    kw = {"budget_bits": 12.0, "context": CONTEXT, "group_sizes": (16,), "residual_tokens": 16,
          "retrieval": "off", "coupled": True, **kw}
    return small_options(**kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (3 layers, 2 KV heads, head_dim 16), its capture of 64 tokens and
    the measurement with coupled candidates."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("coupled-rec") / "tiny.h5"
    capture_model(model, ids, path)
    return model, path, measure(path, _opts())


def _only_coupled(m):
    """``m`` with only coupled candidates for both tensors: the allocation must take them."""
    return replace(m, tables=[{cs: e for cs, e in t.items() if cs[0].coupled}
                              for t in m.tables])


def test_coupled_candidates_are_offered_only_behind_the_door():
    assert not RecommendOptions(budget_bits=3.0).coupled  # default off
    for opts in (RecommendOptions(budget_bits=3.0), small_options(budget_bits=3.0, codebooks=True),
                 small_options(budget_bits=3.0, gear=True, mikv=True, centering=True)):
        assert not any(c.coupled for c in candidates(64, opts, has_rope=True))
    opts = _opts()
    got = {c for c in candidates(64, opts, has_rope=True) if c.coupled}
    assert got == _coupled()
    # head_dim 6: pairs divide it, quads do not
    assert {c for c in candidates(6, opts, has_rope=True) if c.coupled} == _coupled(channels=(2,))
    key, value = Candidate.coupled_codes("key", 2, 5), Candidate.coupled_codes("value", 2, 5)
    assert key.spec() == CoupledSpec(2, 5, weighted=True) and key.granularity == PER_VECTOR
    assert value.spec() == CoupledSpec(2, 5) and not (key.rotate or key.center or key.mikv_set)
    assert key.short == "coupled c2b5+weighted" and value.short == "coupled c2b5"
    assert family(value) != family(Candidate.codebook_values(2)) != family(key)
    with pytest.raises(InputError, match="--set coupled=on offers coupled keys and values"):
        replace(opts, prefer_fast=True)  # asked for, cannot be offered
    # no MiKV set or centring is grafted onto them
    rich = _opts(mikv=True, centering=True, gear=True)
    assert {c for c in candidates(64, rich, has_rope=True) if c.coupled} == _coupled()


def test_coupled_candidates_are_measured_with_codebooks_fitted_on_the_capture(tiny):
    _, path, m = tiny
    opts = _opts()
    want = _coupled()
    with open_capture(path) as cap_:
        layer = cap_.layer(0)
        q, k, v = (layer.read(n)[:, :, :opts.tokens].float() for n in ("q", "k", "v"))
    for i, table in enumerate(m.tables):
        measured = {c for c, s in table if c.coupled}
        assert measured == want, i
        for c in want:
            book = m.codebooks[i][coupled_slot(c)]
            assert isinstance(book, CoupledCodebooks) and book.spec == c.spec()
            assert (book.channel_weights is not None) == (c.tensor == "key")
            out, _, recon = next(e for (o, s), e in table.items() if o == c)
            assert 0 <= out < 2 and 0 <= recon < 1
            # measured held out: c4b8's 256 centroids fit 128 points exactly in-sample, yet
            # each half of the samples is coded with codebooks fitted on the other half
            assert recon > 1e-2
    # the fit is on the capture's tokens (keys weighted by the queries), as the config keeps it
    for c in (Candidate.coupled_codes("key", 2, 4), Candidate.coupled_codes("value", 4, 8)):
        x = k if c.tensor == "key" else v
        fitted = fit_coupled(x, c.spec(), q if c.tensor == "key" else None)
        got = m.codebooks[0][coupled_slot(c)]
        assert torch.equal(got.centroids, fitted.centroids)
        if c.tensor == "key":
            assert torch.equal(got.channel_weights, fitted.channel_weights)
    # the recorded error is the cross-fitted one, not that of the kept (in-sample) codebooks
    c = Candidate.coupled_codes("value", 4, 8)
    inside = fake_quantize_coupled(v, books=m.codebooks[0][coupled_slot(c)])
    assert torch.allclose(inside, v, atol=1e-2)  # exact in-sample (float16 centroids)
    held = held_out_coupled(v, c.spec())
    stream = next(s for (o, s) in m.tables[0] if o == c)
    assert m.tables[0][(c, stream)][2] == pytest.approx(
        float(per_head_rel_error(v, held).mean()), rel=1e-4)
    # more index bits for the same channels: lower reconstruction error
    for t in ("key", "value"):
        lo, hi = Candidate.coupled_codes(t, 2, 4), Candidate.coupled_codes(t, 2, 6)
        for table in m.tables:
            err = {c: e[2] for (c, _), e in table.items() if c in (lo, hi)}
            assert err[hi] < err[lo]
    assert m.profile.stages.get("coupled fit", 0) > 0


def test_a_coupled_config_loads_generates_and_holds_the_bits_it_reports(tiny, tmp_path):
    from kvlens.cache import compressed_attention, memory_report
    from kvlens.cache.layout import config_part_bytes, shape_of
    from kvlens.config import load_config, save_config, validate_for
    from kvlens.evaluation.decode import greedy
    from kvlens.model.architecture import describe as describe_model

    model, _, m = tiny
    opts = _opts()
    rec = choose(_only_coupled(m), opts)
    cfg = rec.config
    assert cfg.format_version == 6
    assert all(ch.candidate.coupled for ch in rec.choices)
    assert set(cfg.coupled_codebooks) == {0, 1, 2}
    for ch in rec.choices:
        setting = cfg.layer(ch.layer)
        assert getattr(setting, ch.tensor) == ch.candidate.spec()
        book = m.codebooks[ch.layer][coupled_slot(ch.candidate)]
        entry = cfg.coupled_codebooks[ch.layer][ch.tensor]
        assert torch.equal(torch.tensor(entry["centroids"]), book.centroids)
        assert ("weights" in entry) == (ch.tensor == "key")
    out = tmp_path / "coupled.json"
    save_config(cfg, out)
    loaded = load_config(out)
    assert loaded.to_dict() == cfg.to_dict()
    validate_for(loaded, describe_model(model))
    prompt = torch.randint(0, 128, (1, CONTEXT - 7), generator=torch.Generator().manual_seed(1))
    with compressed_attention(model, loaded, backend="torch") as session:
        new, cache = greedy(model, prompt, session, 8)
    assert new.shape == (1, 8)
    assert cache.get_seq_length() == CONTEXT
    rep = memory_report(cache)
    shape = shape_of(model)
    assert rep["breakdown"] == config_part_bytes(loaded, shape, CONTEXT)
    assert rep["breakdown"]["codebooks"] > 0 and rep["breakdown"]["codes"] > 0
    held_bits = 16 * sum(rep["breakdown"].values()) / shape.fp16_bytes(CONTEXT)
    assert held_bits == pytest.approx(rec.mean_bits, rel=1e-12)
    assert rec.mean_bits <= opts.budget_bits


def test_allocation_without_the_lever_drops_measured_coupled_candidates(tiny):
    _, _, m = tiny
    opts = _opts()
    on = choose(_only_coupled(m), opts)
    assert any(ch.candidate.coupled for ch in on.choices)
    off = replace(opts, coupled=False)
    assert not still_offered(Candidate.coupled_codes("value", 2, 5), off)
    assert still_offered(Candidate.coupled_codes("value", 2, 5), opts)
    with pytest.raises(InputError, match="budget is too small"):  # nothing left to store them
        choose(_only_coupled(m), off)
    plain = choose(m, off)
    assert not any(ch.candidate.coupled for ch in plain.choices)
    assert not plain.config.coupled_codebooks


def _same_coupled(a: CoupledCodebooks, b: CoupledCodebooks) -> None:
    assert a.spec == b.spec and (a.kv_heads, a.head_dim) == (b.kv_heads, b.head_dim)
    for f in ("centroids", "permutation", "channel_weights"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f


def test_kept_measurement_round_trips_the_coupled_codebooks(tiny, tmp_path):
    _, path, m = tiny
    # a correlation-grouped codebook too: its int64 permutation must travel
    x = rand(1, 2, 64, 16, seed=3)
    corr = fit_coupled(x, CoupledSpec(2, 3, grouping="correlation", iters=2))
    books = {i: dict(b) for i, b in m.codebooks.items()}
    books[0][("coupled", "value", corr.spec.name)] = corr
    m2 = replace(m, codebooks=books)
    back = decode(encode(m2))
    assert back.tables == m2.tables and back.codebooks.keys() == m2.codebooks.keys()
    for i, row in m2.codebooks.items():
        assert list(back.codebooks[i]) == list(row)
        for slot, book in row.items():
            if isinstance(book, CoupledCodebooks):
                _same_coupled(book, back.codebooks[i][slot])
    assert back.codebooks[0][("coupled", "value", corr.spec.name)].permutation is not None
    opts = _opts()
    a, b = choose(_only_coupled(m), opts), choose(_only_coupled(back), opts)
    assert a.choices == b.choices and a.config.to_dict() == b.config.to_dict()
    # the lever is part of what a kept measurement is named by
    assert measurement_key(path, opts) != measurement_key(path, replace(opts, coupled=False))


def test_a_damaged_coupled_entry_is_refused(tiny):
    _, _, m = tiny
    data = encode(m)

    def edit(change) -> bytes:
        return _rezipped(data, change)

    def coupled_entry(doc):
        return next(e[2] for _, entries in doc["codebooks"] for e in entries
                    if e[1] == "coupled")

    decode(edit(lambda doc: None))  # the editing itself keeps a readable file
    for change, said in (
            (lambda d: coupled_entry(d).update(kv_heads=3), "3 rows"),
            (lambda d: coupled_entry(d)["spec"].update(channels=3), "channels"),
            (lambda d: coupled_entry(d).pop("weights"), "fields"),
            (lambda d: coupled_entry(d).update(permutation=coupled_entry(d)["centroids"]),
             "dtype")):
        with pytest.raises(KeptFormatError, match=said):
            decode(edit(change))


def test_set_coupled_parses_and_is_listed(tiny, monkeypatch):
    _, path, _ = tiny
    assert parse_settings(["coupled=on"])["recommend"] == {"coupled": True}
    with pytest.raises(InputError, match="on\\|off"):
        parse_settings(["coupled=2"])
    seen = []

    def stop(path, opts, progress=None, **kw):
        seen.append(opts)
        raise KvlensError("stopped")

    monkeypatch.setattr(kvlens.recommend, "measurement", stop)
    res = runner.invoke(app, ["recommend", str(path), "-b", "3.0", "--set", "coupled=on"])
    assert res.exit_code == 1 and "stopped" in res.output, res.output
    assert seen == [RecommendOptions(budget_bits=3.0, coupled=True)]
    res = runner.invoke(app, ["recommend", "--set", "list"])
    assert res.exit_code == 0
    line = next(ln for ln in res.output.splitlines() if ln.startswith("  coupled="))
    assert line.startswith("  coupled=on|off") and "(default off)" in line
    assert line.strip() in describe()


def test_model_stages_reuse_the_codebooks_fitted_on_the_capture(tmp_path, tiny_model_dir,
                                                                monkeypatch):
    """With the model loaded (layout sensitivity, retrieval probe), coupled codebooks are
    fitted once per layer and candidate, on the capture's text: the probe's prompt and the
    sensitivity's forwards reuse them; the coupled families get layout factors of their own."""
    from transformers import AutoModelForCausalLM

    import kvlens.recommend.layer_errors as layer_errors

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "c.h5"
    capture_model(model, ids, path, storage_dtype="float32")
    fits = []
    real = layer_errors.fit_coupled
    monkeypatch.setattr(layer_errors, "fit_coupled",
                        lambda x, spec, q=None: fits.append(x.shape) or real(x, spec, q))
    opts = _opts(sensitivity="layout", retrieval="on", retrieval_tokens=160,
                 model=str(tiny_model_dir),
                 workers=1, tokens=None)
    m = measure(path, opts)
    assert len(fits) == 3 * len(_coupled())  # per layer and candidate, not again per stage
    assert all(shape[2] == 64 for shape in fits)  # the capture's 64 tokens
    assert any("retrieval" in n for n in m.notes), m.notes
    coupled_families = {family(c) for c in _coupled()}
    for row in m.factors:
        assert coupled_families <= set(row)
