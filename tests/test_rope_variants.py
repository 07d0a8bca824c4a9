"""Every RoPE form and scaling transformers ships, captured exactly before and after RoPE.

Tiny random models (2 layers, odd head counts and rotary widths, T = 37): the captured pre-RoPE
key equals the tensor the model rotates (taken independently, from the projection output);
re-applying the stored tables with ``kvlens.rope.apply_rope`` gives the captured post-RoPE key;
and the model's own rotary function on the captured pre-RoPE tensors gives the captured
post-RoPE ones. A model whose RoPE no known form reproduces is refused in one line.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from helpers import write_capture

from kvlens.analysis.compare.rope_tables import checked_layer_tables, layer_rope_tables
from kvlens.cache import compressed_attention
from kvlens.capture.run import capture_model
from kvlens.capture.store import CaptureMeta, open_capture
from kvlens.config import KVConfig, LayerKV, preset
from kvlens.errors import InputError, ModelLoadError
from kvlens.model.hooks import cache_argument_name, rope_inputs
from kvlens.model.shape import ModelShape
from kvlens.quant import QuantSpec
from kvlens.rope import FORMS, RopeForm, apply_rope, deinterleave, matching_form

S, T = 2, 37
COMMON = dict(vocab_size=128, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
              pad_token_id=0)


def _rope_parameters(rope_type: str, half_dim: int) -> dict:
    """What each of transformers' RoPE types needs; T = 37 is past every original length
    (16), so dynamic scaling and LongRoPE's long factors are the ones used."""
    base = {"rope_type": rope_type, "rope_theta": 10000.0}
    long = {"original_max_position_embeddings": 16}
    params = {
        "default": {},
        "linear": {"factor": 2.0},
        "dynamic": {"factor": 2.0},
        "yarn": {"factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, **long},
        "longrope": {"short_factor": [1.0 + i / half_dim for i in range(half_dim)],
                     "long_factor": [1.5 + i for i in range(half_dim)], **long},
        "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, **long},
        "proportional": {"partial_rotary_factor": 0.5},
    }
    if rope_type not in params:
        pytest.fail(f"transformers has a new rope_type {rope_type!r}: give it parameters here")
    return {**base, **params[rope_type]}


def _rope_types() -> list[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ["default", *ROPE_INIT_FUNCTIONS]


def _llama_config(rope_type: str):
    import transformers as tf

    head_dim = 20
    # dynamic grows past max_position_embeddings; the others past their original length
    max_pos = 16 if rope_type == "dynamic" else 64
    return tf.LlamaConfig(**{**COMMON, "max_position_embeddings": max_pos}, head_dim=head_dim,
                          rope_parameters=_rope_parameters(rope_type, head_dim // 2))


def _arch_config(arch: str):
    import transformers as tf

    if arch == "gpt_oss":  # YaRN by default; compact tables (one column per pair)
        return tf.GptOssConfig(**COMMON, head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2)
    if arch == "glm":  # cat(f, f) tables applied interleaved, partial (10 of 20)
        return tf.GlmConfig(**COMMON, head_dim=20)
    if arch == "glm4":
        return tf.Glm4Config(**COMMON, head_dim=20)
    if arch == "cohere":  # interleaved tables and pairs
        return tf.CohereConfig(**COMMON)
    if arch == "phi":  # the attention forward rotates the first 6 of 20 channels
        return tf.PhiConfig(**{**COMMON, "hidden_size": 120}, partial_rotary_factor=0.3)
    if arch == "gpt_neox":  # fused QKV, partial (6 of 24)
        return tf.GPTNeoXConfig(vocab_size=128, hidden_size=72, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=3, rotary_pct=0.25,
                                pad_token_id=0)
    if arch == "llama4":  # complex freqs_cis, chunked attention, layer 1 NoPE, L2 QK-norm
        return tf.Llama4TextConfig(**COMMON, head_dim=16, num_local_experts=2,
                                   interleave_moe_layer_step=1, no_rope_layers=[1, 0],
                                   attention_chunk_size=8)
    if arch == "smollm3":  # layer 1 NoPE (no_rope_layers)
        return tf.SmolLM3Config(**COMMON, no_rope_layers=[1, 0])
    if arch == "cohere2":  # interleaved; its full-attention layer (1) applies no RoPE
        return tf.Cohere2Config(**COMMON, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])
    raise ValueError(arch)


def _model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    impl = "eager" if config.model_type == "gpt_oss" else "sdpa"
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def _windows(seed: int = 0):
    return torch.randint(0, 128, (S, T), generator=torch.Generator().manual_seed(seed))


def _attn(model, layer: int):
    layers = model.gpt_neox.layers if hasattr(model, "gpt_neox") else model.model.layers
    block = layers[layer]
    return block.attention if hasattr(block, "attention") else block.self_attn


def _true_keys(model, run) -> dict[int, torch.Tensor]:
    """Per layer, ``[S, Hkv, T, D]``: the tensor the model rotates, from its projection's
    output while ``run`` runs the model once per window: split from the fused QKV (GPT-NeoX),
    L2-normalised where Llama 4 normalises (its norm commutes with RoPE's rotation)."""
    seen: dict[int, list] = {0: [], 1: []}
    handles = []
    for layer in seen:
        attn = _attn(model, layer)
        source = getattr(attn, "query_key_value", None) or attn.k_proj
        handles.append(source.register_forward_hook(
            lambda m, a, out, _seen=seen[layer]: _seen.append(out.detach())))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    truth = {}
    for layer, outs in seen.items():
        attn = _attn(model, layer)
        outs = [o for o in outs if o.shape[1] == T]  # the windows' forwards, not shorter probes
        assert len(outs) == S
        if hasattr(attn, "query_key_value"):
            d = attn.head_size
            keys = [o.view(1, T, -1, 3 * d).transpose(1, 2).chunk(3, -1)[1] for o in outs]
        else:
            keys = [o.view(1, T, -1, attn.head_dim) for o in outs]
            if hasattr(attn, "qk_norm"):
                keys = [attn.qk_norm(k) for k in keys]
            keys = [k.transpose(1, 2) for k in keys]
        truth[layer] = torch.cat(keys)
    return truth


def _model_rope(model, layer: int, q, k, pe):
    """The model's own rotary function on ``q``, ``k`` ``[S, H, T, D]``, called as its
    attention forward calls it (written out per architecture, independent of kvlens)."""
    attn = _attn(model, layer)
    module = sys.modules[type(attn).__module__]
    if model.config.model_type == "llama4_text":
        qo, ko = module.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2),
                                         pe[0].expand(q.shape[0], -1, -1))
        return qo.transpose(1, 2), ko.transpose(1, 2)
    cos, sin = (t.expand(q.shape[0], -1, -1) for t in pe[:2])
    r = getattr(attn, "rotary_ndims", None)
    if model.config.model_type == "phi":  # the forward rotates the first rotary_ndims only
        qr, kr = module.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
        return torch.cat((qr, q[..., r:]), -1), torch.cat((kr, k[..., r:]), -1)
    return module.apply_rotary_pos_emb(q, k, cos, sin)


def _raw_tables(model, windows) -> dict:
    """Per layer, the ``position_embeddings`` (and position_ids) the model passes, recorded
    without kvlens capture."""
    with torch.no_grad(), rope_inputs(model) as seen:
        model(input_ids=windows[:1], use_cache=False)
        return dict(seen)


def _check_capture(model, tmp_path):
    windows = _windows()
    raw = _raw_tables(model, windows)
    path = tmp_path / "cap.h5"
    truth = _true_keys(model, lambda: capture_model(model, windows, path,
                                                    storage_dtype="float32"))
    with open_capture(path) as cap:
        assert cap.meta.rope_layout in ("half", "interleaved")
        for layer in map(cap.layer, cap.layers):
            q, k, q_pre, k_pre = (layer.read(n) for n in ("q", "k", "q_pre", "k_pre"))
            # (a) the captured pre-RoPE key is the tensor the model rotated
            torch.testing.assert_close(k_pre, truth[layer.index], atol=2e-5, rtol=1e-5)
            stored = layer.rope()
            if not stored.applies:  # a NoPE layer: nothing rotated, no pre-RoPE candidates
                assert torch.equal(k_pre, k) and torch.equal(q_pre, q)
                assert layer_rope_tables(cap.meta, k, k_pre, stored=stored) == (None, None)
                with pytest.raises(InputError, match="applies no RoPE"):
                    checked_layer_tables(k, k_pre, cap.meta, layer.index, stored)
                continue
            assert stored.cos.shape == (T, cap.meta.rotary_dim)
            assert not torch.allclose(k_pre, k)  # RoPE did something at positions > 0
            # (b) the stored tables re-applied by kvlens give the captured post-RoPE tensors
            cos, sin = (t.expand(S, -1, -1) for t in (stored.cos, stored.sin))
            torch.testing.assert_close(apply_rope(k_pre, cos, sin, cap.meta.rope_layout), k,
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(apply_rope(q_pre, cos, sin, cap.meta.rope_layout), q,
                                       atol=1e-5, rtol=1e-5)
            # (c) the model's own rotary function on the captured pre-RoPE tensors, too
            q_re, k_re = _model_rope(model, layer.index, q_pre, k_pre, raw[layer.index])
            torch.testing.assert_close(q_re, q, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k_re, k, atol=1e-5, rtol=1e-5)
            # the analysis reads the stored tables: exact for every scaling
            tables, _ = layer_rope_tables(cap.meta, k, k_pre, stored=stored)
            assert torch.equal(tables[0], cos) and torch.equal(tables[1], sin)
        return cap.meta


@pytest.mark.parametrize("rope_type", _rope_types())
def test_llama_every_rope_type_is_captured_exactly(rope_type, tmp_path):
    model = _model(_llama_config(rope_type))
    meta = _check_capture(model, tmp_path)
    assert meta.rope_layout == "half" and meta.rotary_dim == 20
    with open_capture(tmp_path / "cap.h5") as cap:
        layer = cap.layer(0)
        searched, theta = layer_rope_tables(cap.meta, layer.read("k"), layer.read("k_pre"))
    if rope_type in ("yarn", "longrope", "llama3"):
        # scaled tables: no plain theta re-creates them, only the stored ones
        assert searched is None
    if rope_type == "dynamic":  # past its length, dynamic NTK is default RoPE at a larger theta
        assert theta > 10000.0


@pytest.mark.parametrize("arch, layout, rotary_dim, form", [
    ("gpt_oss", "half", 16, RopeForm("compact", "half")),
    ("glm", "interleaved", 10, RopeForm("half", "interleaved")),
    ("glm4", "interleaved", 10, RopeForm("half", "interleaved")),
    ("cohere", "interleaved", 16, RopeForm("interleaved", "interleaved")),
    ("phi", "half", 6, RopeForm("half", "half")),
    ("gpt_neox", "half", 6, RopeForm("half", "half")),
    ("llama4", "interleaved", 16, RopeForm("complex", "interleaved")),
    ("smollm3", "half", 16, RopeForm("half", "half")),
    ("cohere2", "interleaved", 16, RopeForm("interleaved", "interleaved")),
])
def test_architecture_rope_forms_are_captured_exactly(arch, layout, rotary_dim, form, tmp_path):
    model = _model(_arch_config(arch))
    meta = _check_capture(model, tmp_path)
    assert (meta.rope_layout, meta.rotary_dim) == (layout, rotary_dim)
    notes = meta.extra["notes"]
    assert (form.name in notes) == (form not in FORMS[:2])
    assert ("layers [1] apply no RoPE" in notes) == (arch in ("llama4", "smollm3", "cohere2"))


@pytest.mark.parametrize("patch, reason", [
    ("reversed", "none of the RoPE forms kvlens knows"),
    ("float32_only", "calling it on a probe failed (RuntimeError: float32 only)"),
])
def test_unreproducible_rope_is_refused_in_one_line(patch, reason, tmp_path, monkeypatch):
    """A rotary function no known form reproduces (here: rotating the other way) or that cannot
    be called on the probe is refused with a ModelLoadError naming the model type, not a
    traceback and not a guess."""
    model = _model(_llama_config("default"))
    module = sys.modules[type(_attn(model, 0)).__module__]
    original = module.apply_rotary_pos_emb

    def patched(q, k, cos, sin, unsqueeze_dim=1):
        if patch == "reversed":
            return original(q, k, cos, -sin)
        if q.dtype != torch.float32:
            raise RuntimeError("float32 only")
        return original(q, k, cos, sin)

    monkeypatch.setattr(module, "apply_rotary_pos_emb", patched)
    with pytest.raises(ModelLoadError) as err:
        capture_model(model, _windows(), tmp_path / "c.h5")
    message = str(err.value)
    assert "\n" not in message and "'llama'" in message and "pre-RoPE" in message
    assert reason in message
    assert not (tmp_path / "c.h5").exists()


def test_rope_forms_normalise_to_the_reference_rotation():
    """Each form's tables, built from planted angles, normalise to tables whose kvlens
    application equals an independent reference (complex multiply on the pairs the form
    names), and ``matching_form`` picks that form from the reference alone."""
    g = torch.Generator().manual_seed(3)
    b, h, t, r = 1, 3, 11, 10
    angles = torch.rand(b, t, r // 2, generator=g, dtype=torch.float64) * 6
    c, s = angles.cos() * 1.3, angles.sin() * 1.3  # attention scaling multiplies both
    x = torch.randn(b, h, t, r + 4, generator=g, dtype=torch.float64)
    tables = {"half": (torch.cat((c, c), -1), torch.cat((s, s), -1)),
              "interleaved": (c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)),
              "compact": (c, s), "complex": torch.complex(c, s)}

    def reference(form):
        """The rotation as a complex multiply on the pairs the model reads, written back as
        it writes them (DeepSeek V3: read interleaved, written half)."""
        rot = x[..., :r]
        read = "interleaved" if form.deinterleaves_input else form.layout
        pairs = (torch.stack((rot[..., : r // 2], rot[..., r // 2:]), -1) if read == "half"
                 else rot.view(b, h, t, r // 2, 2))
        z = torch.view_as_complex(pairs.contiguous()) * torch.complex(c, s)[:, None]
        out = torch.view_as_real(z)
        out = (torch.cat((out[..., 0], out[..., 1]), -1) if form.layout == "half"
               else out.flatten(-2))
        return torch.cat((out, x[..., r:]), -1)

    for form in FORMS:
        pe = tables[form.tables]
        assert form.accepts(pe) and form.rotary_dim(pe) == r
        norm = form.normalise(pe)
        pre = deinterleave(x, r) if form.deinterleaves_input else x
        torch.testing.assert_close(norm.apply(pre), reference(form), rtol=0, atol=1e-12)
        torch.testing.assert_close(norm.invert(norm.apply(pre)), pre, rtol=0, atol=1e-12)
        assert matching_form(pe, (x,), (reference(form),)) == form
    # duplicated tables of the wrong kind are not accepted
    assert not RopeForm("half", "half").accepts(tables["interleaved"])
    assert not RopeForm("interleaved", "interleaved").accepts(tables["half"])


def test_captures_without_stored_tables_still_read(tmp_path):
    """Files written before the tables were stored: no rope(), the theta search still finds
    default RoPE."""
    from kvlens.quant import rope_tables_for

    d = 16
    g = torch.Generator().manual_seed(1)
    k_pre = torch.randn(1, 2, T, d, generator=g)
    cos, sin = rope_tables_for(torch.arange(T).expand(1, -1), d, 10000.0)
    k = apply_rope(k_pre, cos, sin)
    meta = CaptureMeta(model="m", shape=ModelShape(1, 2, 2, d, architecture="A",
                                                   model_type="llama",
                                                   rope={"rope_theta": 10000.0}),
                       rope_layout="half",
                       rotary_dim=d, compute_dtype="float32", storage_dtype="float32",
                       num_samples=1, num_tokens=T, layers=(0,))
    path = write_capture(tmp_path / "old.h5", meta,
                         {0: {"q": k, "k": k, "v": k, "q_pre": k_pre, "k_pre": k_pre}})
    with open_capture(path) as cap:
        layer = cap.layer(0)
        assert layer.rope() is None
        tables, theta = layer_rope_tables(cap.meta, layer.read("k"), layer.read("k_pre"),
                                          stored=layer.rope())
        assert theta == 10000.0
        torch.testing.assert_close(tables[0], cos)


@pytest.mark.parametrize("arch", ["gpt_oss", "glm"])
def test_cache_pre_rope_keys_on_other_rope_forms(arch):
    """The cache's pre-RoPE keys re-rotate with the normalised tables (gpt-oss: compact
    tables; GLM: half tables applied interleaved): 8-bit codes give near-exact logits."""
    model = _model(_arch_config(arch))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    out = {}
    for name in ("fp16", "pre"):
        cfg = preset("fp16") if name == "fp16" else KVConfig(
            name, LayerKV(QuantSpec(8, "per-channel", 8), None, 8, pre_rope_keys=True))
        with compressed_attention(model, cfg) as session, torch.no_grad():
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            model(ids[:, :39], **kw)
            out[name] = model(ids[:, 39:40], **kw).logits[0, -1]
            if name == "pre":
                assert all(layer.stores_pre_rope and layer.quantized_length > 0
                           for layer in cache.layers)
    rel = (out["pre"] - out["fp16"]).norm() / out["fp16"].norm()
    assert rel < 5e-3
