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


# -- the architecture matrix: one tiny config per causal-LM family transformers ships with a KV
# cache (tests/test_architectures.py runs each through the commands;
# docs/reference/architectures.md is generated from the same table by docs/gen_architectures.py)

MATRIX_HEAD_DIM = 64
MATRIX_WINDOW = 48  # sliding window / attention chunk of the families that have one (> 32:
# recommend's smallest full-precision window must fit inside it)


def _common(**kw) -> dict:
    base = dict(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=192,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=1024)
    base.update(kw)
    return base


def _moe(**kw) -> dict:
    return _common(num_experts_per_tok=2, **kw)


# family -> (kind, transformers config builder)
MATRIX = {
    # dense
    "llama": ("dense", lambda tf: tf.LlamaConfig(**_common())),
    "mistral": ("dense", lambda tf: tf.MistralConfig(**_common(sliding_window=2 * MATRIX_WINDOW))),
    "qwen2": ("dense", lambda tf: tf.Qwen2Config(**_common())),
    "qwen3": ("dense", lambda tf: tf.Qwen3Config(**_common(head_dim=MATRIX_HEAD_DIM))),
    "gemma": ("dense", lambda tf: tf.GemmaConfig(**_common(head_dim=MATRIX_HEAD_DIM))),
    "gemma2": ("dense", lambda tf: tf.Gemma2Config(**_common(
        head_dim=MATRIX_HEAD_DIM, sliding_window=MATRIX_WINDOW))),
    "gemma3": ("dense", lambda tf: tf.Gemma3TextConfig(**_common(
        head_dim=MATRIX_HEAD_DIM, sliding_window=MATRIX_WINDOW,
        layer_types=["sliding_attention", "full_attention"]))),
    "phi": ("dense", lambda tf: tf.PhiConfig(**_common(num_key_value_heads=2,
                                                        partial_rotary_factor=0.5))),
    "phi3": ("dense", lambda tf: tf.Phi3Config(**_common(pad_token_id=0))),
    "gpt_neox": ("dense", lambda tf: tf.GPTNeoXConfig(**_common(
        num_key_value_heads=1, rotary_pct=0.5))),  # a KV-head count the architecture ignores
    "gpt2": ("dense", lambda tf: tf.GPT2Config(vocab_size=TINY_VOCAB, n_embd=128, n_layer=2,
                                               n_head=2, n_positions=1024)),
    "starcoder2": ("dense", lambda tf: tf.Starcoder2Config(**_common())),
    "cohere": ("dense", lambda tf: tf.CohereConfig(**_common())),
    "olmo2": ("dense", lambda tf: tf.Olmo2Config(**_common())),
    "olmo3": ("dense", lambda tf: tf.Olmo3Config(**_common(
        sliding_window=MATRIX_WINDOW, layer_types=["sliding_attention", "full_attention"]))),
    "granite": ("dense", lambda tf: tf.GraniteConfig(**_common())),
    "glm": ("dense", lambda tf: tf.GlmConfig(**_common(head_dim=MATRIX_HEAD_DIM,
                                                        pad_token_id=0))),
    "exaone4": ("dense", lambda tf: tf.Exaone4Config(**_common(
        sliding_window=MATRIX_WINDOW, layer_types=["sliding_attention", "full_attention"]))),
    "smollm3": ("dense", lambda tf: tf.SmolLM3Config(**_common(
        pad_token_id=0, no_rope_layers=[1, 0]))),  # layer 1 without RoPE (NoPE)
    # mixture of experts
    "mixtral": ("moe", lambda tf: tf.MixtralConfig(**_moe(num_local_experts=4))),
    "qwen3_moe": ("moe", lambda tf: tf.Qwen3MoeConfig(**_moe(
        head_dim=MATRIX_HEAD_DIM, num_experts=4, moe_intermediate_size=64))),
    "gpt_oss": ("moe", lambda tf: tf.GptOssConfig(**_moe(
        head_dim=MATRIX_HEAD_DIM, num_local_experts=4, sliding_window=MATRIX_WINDOW,
        layer_types=["sliding_attention", "full_attention"]))),
    # multi-head latent attention
    "deepseek_v2": ("mla", lambda tf: tf.DeepseekV2Config(**_moe(
        num_key_value_heads=2, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=4, moe_intermediate_size=64,
        first_k_dense_replace=1, n_shared_experts=1))),
    "deepseek_v3": ("mla", lambda tf: tf.DeepseekV3Config(**_moe(
        num_key_value_heads=2, kv_lora_rank=64, q_lora_rank=48, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=4, moe_intermediate_size=64,
        first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1))),
    # hybrid: only some layers hold a KV cache
    "qwen3_next": ("hybrid", lambda tf: tf.Qwen3NextConfig(**_moe(
        head_dim=MATRIX_HEAD_DIM, num_experts=4, moe_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32))),
    "qwen3_5": ("hybrid", lambda tf: tf.Qwen3_5TextConfig(**_common(
        head_dim=MATRIX_HEAD_DIM, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32))),
    "granitemoehybrid": ("hybrid", lambda tf: tf.GraniteMoeHybridConfig(**_common(
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=32,
        mamba_d_state=16, mamba_expand=2, num_local_experts=4, num_experts_per_tok=2))),
    "falcon_h1": ("hybrid", lambda tf: tf.FalconH1Config(**_common(
        head_dim=MATRIX_HEAD_DIM, mamba_n_heads=8, mamba_d_head=32, mamba_d_ssm=256,
        mamba_d_state=16))),
    "jamba": ("hybrid", lambda tf: tf.JambaConfig(**_moe(
        num_experts=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, mamba_d_state=16))),
    "nemotron_h": ("hybrid", lambda tf: tf.NemotronHConfig(**_moe(
        head_dim=MATRIX_HEAD_DIM, n_routed_experts=4, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64, n_shared_experts=1, n_group=1, topk_group=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))),
    "lfm2": ("hybrid", lambda tf: tf.Lfm2Config(**_common(
        layer_types=["conv", "full_attention"], full_attn_idxs=[1]))),
    # chunked attention
    "llama4": ("chunked", lambda tf: tf.Llama4TextConfig(**_common(
        head_dim=MATRIX_HEAD_DIM, num_local_experts=4, num_experts_per_tok=1,
        attention_chunk_size=MATRIX_WINDOW, interleave_moe_layer_step=2,
        intermediate_size_mlp=192, no_rope_layers=[1, 0]))),
}
#: families transformers runs only with its eager attention (no sdpa)
EAGER_ONLY = frozenset({"gemma2", "gpt_oss"})


def matrix_config(family: str):
    """The tiny transformers config of ``family`` (``MATRIX``)."""
    import transformers as tf

    config = MATRIX[family][1](tf)
    if family in EAGER_ONLY:
        config._attn_implementation = "eager"
    return config

#: what each family exercises (docs/reference/architectures.md)
MATRIX_NOTES = {
    "mistral": "every layer sliding-window",
    "gemma2": "logit soft-capping, alternating sliding/full layers, eager attention only",
    "gemma3": "QK-norm, sliding and full layers",
    "phi": "partial rotary (half the channels)",
    "gpt_neox": "partial rotary, fused QKV; the config's num_key_value_heads is ignored by "
                "the architecture (multi-head)",
    "gpt2": "no RoPE (learned positions)",
    "cohere": "interleaved RoPE",
    "olmo2": "QK-norm",
    "olmo3": "sliding and full layers",
    "glm": "partial rotary applied interleaved",
    "exaone4": "sliding and full layers",
    "smollm3": "a NoPE layer beside RoPE layers",
    "qwen3_moe": "QK-norm",
    "gpt_oss": "learned attention sinks, alternating sliding/full layers, YaRN RoPE, eager "
               "attention only",
    "deepseek_v2": "MLA: latent rows cached (absorbed form), complex RoPE",
    "deepseek_v3": "MLA: latent rows cached (absorbed form), interleaved RoPE, q LoRA",
    "qwen3_next": "Gated DeltaNet linear-attention layer beside a full-attention layer",
    "qwen3_5": "Gated DeltaNet linear-attention layer beside a full-attention layer",
    "granitemoehybrid": "Mamba-2 layer beside an attention layer without RoPE",
    "falcon_h1": "attention and a Mamba-2 mixer side by side in every layer",
    "jamba": "Mamba layer beside an attention layer",
    "nemotron_h": "Mamba-2, MoE-only, attention and MLP-only layers (layers without a mixer)",
    "lfm2": "short-convolution layer beside an attention layer",
    "llama4": "chunked attention, complex RoPE, a NoPE layer, QK L2-norm",
}
