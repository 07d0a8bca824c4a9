"""llama.cpp's CPU matrix products as a model run (kvlens.model.engine_matmul) and the run plan
that applies them (kvlens.deploy.engine_run)."""

import pytest
import torch

import kvlens.model.engine_matmul as em
from kvlens.config.engine import parse_engine_setting
from kvlens.deploy.engine_run import llamacpp_matmul_plan
from kvlens.model.load import ModelSource
from kvlens.quant.ggml import GGML_FORMATS, dequantize_ggml, quantize_ggml


def _model():
    import transformers as tf
    from transformers import AutoModelForCausalLM

    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


FAKE_GGUF = {f"blk.{i}.{t}.weight": "q4_1" for i in range(2)
             for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
FAKE_GGUF |= {"blk.0.ffn_down.weight": "q8_0", "blk.1.ffn_down.weight": "iq2_xs",
              "token_embd.weight": "q8_0", "blk.0.attn_norm.weight": "f32"}


def test_gguf_names_map_to_linear_modules(monkeypatch):
    monkeypatch.setattr(em, "gguf_tensor_types", lambda path: FAKE_GGUF)
    types, unmodelled = em.matmul_types(_model(), "x.gguf")
    assert types["model.layers.0.self_attn.q_proj"] == "q4_1"
    assert types["model.layers.1.mlp.up_proj"] == "q4_1"
    assert types["model.layers.0.mlp.down_proj"] == "q8_0"
    assert types["lm_head"] == "q8_0"  # tied: the embedding's type
    assert "model.layers.1.mlp.down_proj" not in types
    assert unmodelled == ["model.layers.1.mlp.down_proj: iq2_xs"]
    assert len(types) == 2 * 7 - 1 + 1


def test_hooked_linears_see_q8_rows_and_hooks_are_removed():
    model = _model()
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    types = {"model.layers.0.self_attn.q_proj": "q4_0", "lm_head": "q8_0"}
    seen = {}
    with torch.no_grad():
        plain = model(ids).logits
        with em.engine_matmuls(model, types) as n:
            assert n == 2
            h = model.model.layers[0].self_attn.q_proj.register_forward_hook(
                lambda m, a, o: seen.__setitem__("q_in", a[0].detach().clone()))
            hooked = model(ids).logits
            h.remove()
        after = model(ids).logits
    x = seen["q_in"]
    ref = dequantize_ggml(quantize_ggml(x[None].float(), GGML_FORMATS["q8_0"]))[0]
    assert torch.equal(x, ref)  # the module's input is already on the q8_0 grid
    assert (hooked - plain).abs().max() > 1e-5
    torch.testing.assert_close(after, plain)  # hooks gone


def test_plan_applies_only_to_pure_llamacpp_runs_on_gguf(monkeypatch):
    monkeypatch.setattr(em, "gguf_tensor_types", lambda path: FAKE_GGUF)
    import kvlens.deploy.engine_run as er
    monkeypatch.setattr(er, "matmul_types", em.matmul_types)
    model = _model()
    gguf = ModelSource("gguf", "/tmp", "m.gguf", "m")
    from kvlens.config import preset

    llama = parse_engine_setting("llamacpp:q8_0/q4_0").kvconfig("a")
    from kvlens.evaluation.baselines import Baseline

    types, notes = llamacpp_matmul_plan([preset("exact"), llama, Baseline("hf-fp8", "fp8", None)],
                                        gguf, model)
    assert len(types) == 14 and "every config, exact" in notes[0]
    assert "does not model" in notes[1]
    off = parse_engine_setting("llamacpp:q8_0:noarith").kvconfig("b")
    types, notes = llamacpp_matmul_plan([llama, off], gguf, model)
    assert types == {} and "not simulated" in notes[0]
    assert llamacpp_matmul_plan([preset("exact")], gguf, model) == ({}, [])
    types, notes = llamacpp_matmul_plan([llama], ModelSource("dir", "/tmp"), model)
    assert types == {} and "not a GGUF" in notes[0]


def test_llamacpp_results_of_a_run_without_its_matrix_products_are_marked_partial():
    from kvlens.config import preset
    from kvlens.deploy.engine_run import mark_partial_llamacpp
    from kvlens.evaluation.frontier import points_from_results

    configs = [preset("kivi-2"), parse_engine_setting("llamacpp:q8_0/q4_0").kvconfig("a"),
               parse_engine_setting("vllm:fp8_e4m3").kvconfig("b")]
    kld = {"mean_kld": {"value": 0.01, "ci95": [0.009, 0.011]}}
    results = [{"name": c.name, "bits_per_element": 4.0, "kld": kld} for c in configs]
    mark_partial_llamacpp(results, configs, {"blk.0.attn_q": "q8_0"})  # simulated
    assert all("engine_arithmetic" not in r for r in results)
    mark_partial_llamacpp(results, configs, {})
    assert [r.get("engine_arithmetic") for r in results] == [None, "partial", None]
    points = points_from_results(results, ["preset", "engine", "engine"])
    assert [p.partial for p in points] == [False, True, False]


@pytest.mark.parametrize("vdt", ["q8_0", "q8_1"])
def test_convert_rows_q8_matches_ggml_q8_0_grid(vdt):
    from kvlens.quant.llamacpp_cpu import convert_rows

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    got, s = convert_rows(x, vdt)
    assert torch.equal(got, dequantize_ggml(quantize_ggml(x[None, None], GGML_FORMATS["q8_0"]))
                       [0, 0])
    assert (s is None) == (vdt == "q8_0")


def test_q8_k_follows_quantize_row_q8_k_ref():
    from kvlens.quant.llamacpp_cpu import convert_rows, quantize_q8_k

    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    x[0, 7] = -9.0  # the signed maximum: iscale = -127 / -9, code -127
    got = quantize_q8_k(x)
    blocks = x.reshape(2, 2, 256)
    for r in range(2):
        for b in range(2):
            row = blocks[r, b]
            top = row[row.abs().argmax()]
            iscale = -127.0 / top
            codes = torch.round(iscale * row).clamp(max=127)
            assert torch.equal(got[r, b], codes * (1 / iscale))
    assert abs(float(got[0, 0, 7]) + 9.0) < 1e-5  # a float32 scale: no fp16 rounding
    assert torch.equal(convert_rows(x, "q8_k")[0], got.reshape(2, 512))
    with pytest.raises(Exception, match="256"):
        quantize_q8_k(torch.zeros(1, 64))
