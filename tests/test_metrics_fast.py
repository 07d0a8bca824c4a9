"""The batched ``attention_errors_many`` against its one-variant-at-a-time reference loop
(``attention_errors_reference``) on odd shapes: GQA, chunks that do not divide the rows,
sliding windows, softcap, streaming exact masks, MiKV sets, mixed kinds of variants."""

import pytest
import torch
from helpers import rand

from kvlens.analysis import metrics
from kvlens.analysis.attention import streaming_exact_mask
from kvlens.analysis.metrics import Variant, attention_errors_many, attention_errors_reference

FIELDS = ("key_reconstruction", "value_reconstruction", "scores", "weights", "output")


def _mask(*shape, seed=0, p=0.3):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


def _variants(k, v, tq, seed=0):
    """Every kind of variant, some twice (so kinds batch), and lossless ones."""
    b, hkv, tk, _ = k.shape

    def near(x, s, scale):
        return x + scale * rand(*x.shape, seed=seed + s)

    in_set = _mask(b, hkv, tq, tk, seed=seed + 50)
    k_set, v_set = near(k, 60, 0.05), near(v, 61, 0.05)
    return [
        Variant(k_hat=near(k, 1, 0.1)),
        Variant(v_hat=near(v, 2, 0.1)),
        Variant(k_hat=near(k, 3, 0.3)),
        Variant(v_hat=near(v, 4, 0.05)),
        Variant(k_hat=near(k, 5, 0.1), v_hat=near(v, 6, 0.1)),
        Variant(k_hat=near(k, 7, 0.2), in_set=in_set, k_set=k_set),
        Variant(v_hat=near(v, 8, 0.2), in_set=_mask(*in_set.shape, seed=seed + 51), v_set=v_set),
        Variant(v_hat=near(v, 9, 0.2), in_set=in_set, v_set=v_set),
        Variant(in_set=in_set, k_set=k_set),  # only the set's keys differ
        Variant(in_set=in_set, v_set=v_set),
        Variant(k_hat=near(k, 10, 0.1), v_hat=near(v, 11, 0.1), in_set=in_set, k_set=k_set,
                v_set=v_set),
        Variant(k_hat=k.clone()),  # lossless
        Variant(v_hat=v.clone()),
        Variant(k_hat=k.clone(), v_hat=v.clone()),
    ]


def _check_equal(got, want, rtol=1e-5):
    """Per-head errors equal to ``rtol``. The reference subtracts two float32 attentions, so
    its own error is about ``eps * |o| / |o - o_hat|``: variants here change enough (a few
    percent) for that to stay below ``rtol``."""
    for g, w in zip(got, want, strict=True):
        for field in FIELDS:
            a, b = getattr(g, field), getattr(w, field)
            assert (a is None) == (b is None), field
            if a is None:
                continue
            assert not bool(a.isnan().any()), field
            assert a.dtype == torch.float64 and a.shape == b.shape, field
            torch.testing.assert_close(a, b, rtol=rtol, atol=1e-9, msg=field)


CASES = [
    # b, hq, hkv, tq, tk, chunk, window, softcap, exact
    (2, 6, 2, 13, 13, 4, 0, 0.0, None),
    (3, 3, 3, 11, 11, 5, 0, 0.0, (4, 2, 1)),
    (2, 9, 3, 10, 17, 3, 0, 0.0, (6, 0, 2)),
    (2, 6, 2, 14, 14, 4, 5, 0.0, (4, 4, 0)),
    (1, 4, 1, 9, 12, 256, 0, 7.0, (3, 0, 1)),
    (2, 6, 3, 15, 15, 6, 4, 5.0, None),
]


@pytest.mark.parametrize("b,hq,hkv,tq,tk,chunk,window,softcap,exact", CASES)
def test_batched_equals_reference(b, hq, hkv, tq, tk, chunk, window, softcap, exact):
    q = rand(b, hq, tk, 16, seed=1)[:, :, tk - tq:]  # queries from a later row, as recommend
    k, v = rand(b, hkv, tk, 16, seed=2), rand(b, hkv, tk, 16, seed=3)
    mask = None if exact is None else streaming_exact_mask(tk, *exact)[tk - tq:]
    variants = _variants(k, v, tq, seed=10)
    kw = dict(scaling=0.3, sliding_window=window, softcap=softcap, chunk_size=chunk, exact=mask)
    got = attention_errors_many(q, k, v, variants, **kw)
    _check_equal(got, attention_errors_reference(q, k, v, variants, **kw))
    for lossless in got[-3:]:
        assert float(lossless.output.abs().max()) == 0.0
        assert lossless.scores is None or float(lossless.scores.abs().max()) == 0.0
        assert lossless.weights is None or float(lossless.weights.abs().max()) == 0.0
    assert all(float(e.output.min()) > 0 for e in got[:-3])  # every lossy variant counted


def test_groups_of_samples_and_variants_give_the_same_errors(monkeypatch):
    """A block budget that fits one sample and one variant (or a few) splits the work into
    many groups and pieces; the errors do not depend on the split."""
    q, k, v = rand(3, 6, 12, 8, seed=4), rand(3, 2, 12, 8, seed=5), rand(3, 2, 12, 8, seed=6)
    variants = _variants(k, v, 12, seed=20)
    kw = dict(scaling=0.4, sliding_window=0, softcap=0.0, chunk_size=5,
              exact=streaming_exact_mask(12, 4, 2, 1), reconstruction=False)
    real, calls = metrics._group_sums, []

    def counted(*args):
        calls.append(len(args[2]))  # variants in the group
        return real(*args)

    monkeypatch.setattr(metrics, "_group_sums", counted)
    whole = attention_errors_many(q, k, v, variants, **kw)
    kinds = len({metrics._Kind.of(var) for var in variants})
    assert len(calls) == 3 * kinds  # every sample and variant of a kind at once, 3 chunks
    per_unit = 4 * 6 * 5 * 12  # one sample, one variant: [Hq, chunk, keys] float32
    for units in (1, 3):
        calls.clear()
        monkeypatch.setattr(metrics, "BLOCK_BYTES", units * per_unit)
        _check_equal(attention_errors_many(q, k, v, variants, **kw), whole, rtol=1e-6)
        assert max(calls) <= units and sum(calls) > 3 * len(variants)
    _check_equal(whole, attention_errors_reference(q, k, v, variants, **kw))


def test_an_unwritten_piece_shows_as_nan(monkeypatch):
    """The per-piece sums start as NaN: a chunk whose sums were not written poisons the
    result instead of counting as no error."""
    q, k, v = rand(1, 2, 9, 8, seed=7), rand(1, 2, 9, 8, seed=8), rand(1, 2, 9, 8, seed=9)
    real = metrics._group_sums
    calls = []

    def skip_first(*args):
        calls.append(1)
        return {} if len(calls) == 1 else real(*args)

    monkeypatch.setattr(metrics, "_group_sums", skip_first)
    got = attention_errors_many(q, k, v, [Variant(v_hat=v + 0.1)], scaling=0.3, chunk_size=4)
    assert len(calls) == 3 and bool(got[0].output.isnan().all())


def test_half_precision_inputs_match_the_reference():
    q = rand(2, 4, 10, 8, seed=11).bfloat16()
    k, v = rand(2, 2, 10, 8, seed=12).bfloat16(), rand(2, 2, 10, 8, seed=13).bfloat16()
    variants = [Variant(k_hat=(k.float() * 1.1).bfloat16()), Variant(v_hat=(v.float() * 0.9))]
    kw = dict(scaling=0.3, chunk_size=3)
    _check_equal(attention_errors_many(q, k, v, variants, **kw),
                 attention_errors_reference(q, k, v, variants, **kw))


@pytest.mark.parametrize("chunk", [4, 256])
def test_several_masks_share_the_work_and_give_each_masks_errors(chunk):
    """``attention_errors_streams``: one call for several exact masks (and per-mask subsets of
    the variants) equals one ``attention_errors_many`` call per mask, bit for bit, though the
    logit changes and value differences are computed once for all masks."""
    from kvlens.analysis.metrics import attention_errors_streams

    b, hq, hkv, tk, tq = 2, 6, 2, 20, 12
    q = rand(b, hq, tk, 16, seed=1)[:, :, tk - tq:]
    k, v = rand(b, hkv, tk, 16, seed=2), rand(b, hkv, tk, 16, seed=3)
    variants = _variants(k, v, tq, seed=20)
    masks = [streaming_exact_mask(tk, r, f, s)[tk - tq:] for r, f, s in
             ((4, 0, 1), (8, 4, 0), (6, 2, 2))] + [None]
    n = len(variants)
    select = [range(n), [0, 2, 4, 5], [1, 3, 7, 9, 12], [2]]  # subsets first and last
    kw = dict(scaling=0.3, softcap=0.0, chunk_size=chunk)
    got = attention_errors_streams(q, k, v, variants, masks, select=select, **kw)
    for m, (mask, sel) in enumerate(zip(masks, select)):
        want = attention_errors_many(q, k, v, variants, exact=mask, **kw)
        for i in range(n):
            if i not in sel:
                assert got[m][i] is None
                continue
            for field in FIELDS:
                a, w = getattr(got[m][i], field), getattr(want[i], field)
                assert (a is None) == (w is None) and (a is None or torch.equal(a, w)), (m, i)
