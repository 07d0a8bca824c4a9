"""Tiny random models built from transformers config classes, one per architecture family.

They exercise the hooking code across attention layouts (GQA, QK-norm, sliding windows, fused
QKV, partial rotary, no RoPE) in seconds; the real SmolLM2 model is tested separately.
``tiny_tokenizer()`` is a small real tokenizer trained offline, for tests that need a model
directory with a tokenizer but not SmolLM2's own.
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


def tiny_model(arch: str, seed: int = 0, max_positions: int | None = None):
    """A seeded random model of ``tiny_config(arch)`` in eval mode; ``max_positions`` overrides
    its ``max_position_embeddings``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    if max_positions is not None:
        config.max_position_embeddings = max_positions
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()


TINY_VOCAB = 4096
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def tiny_tokenizer(vocab_size: int = TINY_VOCAB):
    """A byte-level BPE tokenizer trained on kvlens' built-in texts (the calibration corpus and
    the held-out text): any text round-trips (like SmolLM2's), with pad/bos/eos tokens, built
    offline in about a second. On the built-in texts it needs about as many tokens as
    SmolLM2's, so prompts built to a token length fit a tiny model's positions. Training is
    deterministic, so token ids are the same in every session."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvlens.text.corpus import load_text
    from kvlens.text.heldout import heldout_text

    texts = [load_text(None)[0], heldout_text()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIAL_TOKENS)


def save_model_dir(path, config, tokenizer, seed: int = 0):
    """Save a random model built from ``config`` and ``tokenizer`` as a local HF directory
    (what ``--model DIR`` loads); returns ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
