import os
import sys
from pathlib import Path

import pytest

# Triton kernels are tested on CPU through its interpreter; it must be set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (loaded once per test session)."""
    from kvlens.model.load import load_model

    model, tokenizer, source = load_model(None, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama saved as a local HF directory with SmolLM2's real tokenizer, so CLI
    tests exercise the directory-loading path in seconds."""
    import torch
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = tiny_config("llama")
    config.vocab_size = len(smollm2_tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path
