"""Tiny random models built from transformers config classes, one per architecture family.

They exercise the hooking code across attention layouts (GQA, QK-norm, sliding windows, fused
QKV, partial rotary, no RoPE) in seconds; the real SmolLM2 model is tested separately.
"""

from __future__ import annotations

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gpt_neox", "phi3", "gpt2")


def tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=8)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention",
                                                "sliding_attention"])
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=3, num_attention_heads=4, rotary_pct=0.5,
                                max_position_embeddings=256)
    if arch == "phi3":
        return tf.Phi3Config(**common, pad_token_id=0)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=256)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
    return model.eval()
