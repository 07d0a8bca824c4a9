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
    from kvlens.models import load_model

    model, tokenizer, source = load_model(None, device="cpu")
    return model, tokenizer
