"""The retrieval probe `recommend` adds to its text errors."""

from __future__ import annotations

import pytest
from helpers import small_options

from kvlens.errors import InputError
from kvlens.evaluation.short import passkey_prompts
from kvlens.text.prompts import FILLER, QUESTION, retrieval_text


def test_probe_prompt_states_the_code_once_at_a_seeded_depth(tiny_tokenizer):
    tok = tiny_tokenizer
    text, code = retrieval_text(tok, 960, seed=7)
    n = len(tok(text).input_ids)
    assert 800 <= n <= 960
    assert text.count(code) == 1 and text.endswith(QUESTION)
    assert text == retrieval_text(tok, 960, seed=7)[0]  # deterministic
    other, other_code = retrieval_text(tok, 960, seed=8)
    assert other.index(other_code) != text.index(code) or other_code != code
    # not the evaluation's passkey prompt: different filler and wording
    assert FILLER.strip() not in text and "pass key" not in text
    passkey, _ = passkey_prompts(tok, 1, 1000, 0)[0]
    assert text[:200] not in passkey
    with pytest.raises(InputError, match="retrieval probe"):
        retrieval_text(tok, 40)


def test_recommend_adds_weighted_probe_errors(tiny_model_dir, tmp_path):
    """tables(weight w) = text errors + w * probe errors, exactly linear in w."""
    from kvlens.capture.run import capture_model
    from kvlens.model.load import load_model
    from kvlens.recommend import measure

    model, tok, _ = load_model(str(tiny_model_dir))
    import torch

    windows = torch.randint(3, 500, (1, 200), generator=torch.Generator().manual_seed(0))
    cap = tmp_path / "tiny.h5"
    capture_model(model, windows, cap, model_source=f"dir:{tiny_model_dir}")
    base = dict(budget_bits=4.0, residual_tokens=32, group_sizes=(16,), bits=(2, 4),
                tokens=128, retrieval_tokens=256)
    m0 = measure(cap, small_options(**base, retrieval="off"))
    m1 = measure(cap, small_options(**base, retrieval="on", retrieval_weight=1.0))
    m2 = measure(cap, small_options(**base, retrieval="on", retrieval_weight=2.0))
    assert any("retrieval probe" in n for n in m1.notes)
    diffs = 0
    for t0, t1, t2 in zip(m0.tables, m1.tables, m2.tables):
        assert t0.keys() == t1.keys() == t2.keys()
        for key in t0:
            e0, e1, e2 = t0[key][0], t1[key][0], t2[key][0]
            assert e2 - e0 == pytest.approx(2 * (e1 - e0), rel=1e-6, abs=1e-9)
            assert e1 >= e0
            diffs += e1 > e0
    assert diffs > 0
    with pytest.raises(InputError, match="Unknown retrieval="):
        small_options(budget_bits=3.0, retrieval="maybe")


def test_probe_required_without_a_model_is_a_clear_error(tmp_path):
    from test_recommend import _planted_capture

    from kvlens.recommend import measure

    path = _planted_capture(tmp_path / "p.h5")
    with pytest.raises(InputError, match="does not say which model"):
        measure(path, small_options(budget_bits=4.0, retrieval="on"))
    m = measure(path, small_options(budget_bits=4.0))  # auto: goes on without, says so
    assert any("no retrieval probe" in n for n in m.notes)
