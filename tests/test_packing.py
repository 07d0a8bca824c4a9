"""Bit packing: exact round trips, the documented little-endian byte layout, bad input."""

import pytest
import torch

from kvlens.errors import ConfigError, InputError
from kvlens.quant import codes_per_byte, container_bits, pack_codes, packed_length, unpack_codes


def _codes(shape, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, shape, generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("length", [1, 3, 7, 13, 64])
def test_round_trip_exact_for_odd_lengths(bits, length):
    codes = _codes((2, 3, 5, length), bits, seed=bits * 100 + length)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 3, 5, packed_length(length, bits))
    assert torch.equal(unpack_codes(packed, bits, length), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_round_trip_along_token_dim(bits):
    codes = _codes((1, 2, 11, 6), bits, seed=7)
    packed = pack_codes(codes, bits, dim=2)
    assert packed.shape == (1, 2, packed_length(11, bits), 6)
    assert torch.equal(unpack_codes(packed, bits, 11, dim=2), codes)


def test_byte_layout_first_element_in_lowest_bits():
    two = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    # 1 | 2<<2 | 3<<4 | 0<<6 = 57; the lone 5th code is padded with zeros -> 3.
    assert pack_codes(two, 2).tolist() == [57, 3]
    one = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert pack_codes(one, 1).tolist() == [129, 1]
    four = torch.tensor([0xA, 0x3], dtype=torch.uint8)
    assert pack_codes(four, 4).tolist() == [0x3A]
    # 3-bit codes live in 4-bit containers.
    assert pack_codes(torch.tensor([5, 7], dtype=torch.uint8), 3).tolist() == [0x75]


def test_containers():
    assert [container_bits(b) for b in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [codes_per_byte(b) for b in (1, 2, 3, 4, 8)] == [8, 4, 2, 2, 1]


def test_bad_input_raises():
    with pytest.raises(ConfigError, match="allowed bits: 1-8"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(InputError, match="does not fit in 2 bits"):
        pack_codes(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(InputError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(InputError, match="cannot hold"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 2, 5)
