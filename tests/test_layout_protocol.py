"""The storage-layout protocol (``kvlens.layouts``): every store the cache keeps implements
``Store``, every registered spec is a ``Layout`` whose store reads back its reference and holds
its predicted bytes, and the registry refuses what it does not know."""

from __future__ import annotations

import pytest
import torch

from kvlens.cache.engine import EngineStore
from kvlens.errors import ConfigError
from kvlens.layouts import (
    DenseTensor,
    Layout,
    Store,
    kinds,
    layout_from_dict,
    layout_of,
    reference,
)
from kvlens.layouts.blockfloat import Fp4E2M1, MxFp8, NvFp4
from kvlens.quant import CodebookSpec, QuantSpec
from kvlens.quant.cachetypes import parse_cache_type

SPECS = [QuantSpec(2, "per-channel", 8), QuantSpec(4, "per-token", 16), QuantSpec(3, "per-token"),
         QuantSpec(4, "per-tensor"), CodebookSpec(3, "lloyd-max"), NvFp4(0.5), Fp4E2M1(),
         MxFp8()]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_a_layout_store_reads_back_its_reference_and_holds_its_bytes(spec):
    """Blocks of 8 tokens, 3 appended then the first dropped: the store reads back exactly
    ``reconstruct`` (float16 metadata) and holds exactly ``part_bytes``."""
    layout = layout_of(spec)
    assert isinstance(layout, Layout) and layout.kind in kinds()
    x = torch.randn(2, 3, 24, 32, generator=torch.Generator().manual_seed(0)) * 3
    block = layout.flush_block(8)
    store = layout.new_store(32, block)
    assert isinstance(store, Store)
    want = layout.reconstruct(x, block)
    if isinstance(spec, CodebookSpec):  # the cache layer rotates: its store sees x R
        r = spec.rotation.matrix(32)
        x, want = x @ r, want @ r
    for t0 in range(0, 24, block):
        store.append(x[:, :, t0:t0 + block])
    assert torch.allclose(store.dequantize_range(0, 24), want, atol=1e-5)
    store.drop_front(block)
    assert torch.allclose(store.dequantize_range(0, 24 - block), want[:, :, block:],
                          atol=1e-5)
    held = sum(t.numel() * t.element_size() for t in store.named_tensors().values())
    assert held == 6 * sum(layout.part_bytes(24 - block, 32, block).values())
    assert layout_from_dict(layout.to_dict(), layout.kind) == spec


def test_reference_composes_the_same_quantizer():
    x = torch.randn(1, 2, 16, 32, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec(2, "per-token", 16)
    from kvlens.quant import fake_quantize

    assert torch.equal(reference(spec, "8bit")(x), fake_quantize(x, spec, "8bit"))
    # float16 metadata: the scales the store keeps, not the float32 ones
    assert not torch.equal(reference(spec, "float16")(x), fake_quantize(x, spec))


def test_every_cache_store_is_a_store():
    stores = [DenseTensor(torch.float16),
              EngineStore(parse_cache_type("q8_0"), 64),
              EngineStore(parse_cache_type("fp8_ds_mla"), 656)]
    assert all(isinstance(s, Store) for s in stores)
    x = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(2))
    q8 = stores[1]
    q8.append(x)
    assert torch.equal(q8.dequantize_range(1, 3), q8.read()[:, :, 1:3])
    assert set(q8.named_tensors()) == {"blocks"}


def test_the_registry_refuses_what_it_does_not_know():
    with pytest.raises(ConfigError, match="Unknown layout 'nf4'; allowed: .*uniform"):
        layout_from_dict({"layout": "nf4"}, "uniform")
    with pytest.raises(ConfigError, match="Not a storage layout"):
        layout_of("q4_0")
