"""Bit packing: exact round trips, the documented dense little-endian layout, bad input."""

import pytest
import torch

from kvlens.errors import ConfigError, InputError
from kvlens.quant import pack_codes, pack_unit, packed_length, unpack_codes


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


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
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
    # 3 bits: 8 codes in 3 bytes; code 2 (0b001) straddles bytes 0 and 1.
    three = torch.tensor([5, 7, 1, 6, 2, 3, 4, 0], dtype=torch.uint8)
    assert pack_codes(three, 3).tolist() == [0x7D, 0xAC, 0x11]
    # a partial unit is padded to whole bytes of the unit
    assert pack_codes(torch.tensor([5, 7], dtype=torch.uint8), 3).tolist() == [0x3D, 0, 0]


def _bitstream(codes: list[int], bits: int) -> list[int]:
    """Independent reference: write each code LSB first into one bit stream, 8 bits a byte."""
    stream = [(c >> i) & 1 for c in codes for i in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(stream[k + i] << i for i in range(8)) for k in range(0, len(stream), 8)]


@pytest.mark.parametrize("bits", range(1, 9))
def test_dense_layout_is_one_lsb_first_bit_stream(bits):
    u, w = pack_unit(bits)
    assert u * bits == 8 * w  # a unit fills whole bytes exactly: no container padding
    codes = _codes((3 * u,), bits, seed=bits)
    assert pack_codes(codes, bits).tolist() == _bitstream(codes.tolist(), bits)
    assert packed_length(3 * u, bits) == 3 * u * bits // 8


def test_pack_units():
    assert [pack_unit(b) for b in range(1, 9)] == [
        (8, 1), (4, 1), (8, 3), (2, 1), (8, 5), (4, 3), (8, 7), (1, 1)]


def test_bad_input_raises():
    with pytest.raises(ConfigError, match="allowed bits: 1-8"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(InputError, match="does not fit in 2 bits"):
        pack_codes(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(InputError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(InputError, match="cannot hold"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 2, 5)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(1, 3, 512, 64), (2, 1, 40, 32), (1, 2, 8, 256)])
def test_torch_path_unpack_equals_unpack_codes(bits, shape):
    """The decode path's chunk unpack (one broadcast shift into a reused workspace) returns the
    codes ``unpack_codes`` does, along tokens and along channels, on chunk-like shapes."""
    from kvlens.cache.torch_read import unpack_cols, unpack_rows

    u, _ = pack_unit(bits)
    shape = (*shape[:2], -(-shape[2] // u) * u, shape[3])  # tokens: whole units, as stored
    codes = _codes(shape, bits, seed=bits + shape[2])
    rows = unpack_rows(pack_codes(codes, bits, dim=2), bits)
    assert rows.is_contiguous() and torch.equal(rows, codes.float())
    cols = unpack_cols(pack_codes(codes, bits, dim=3), bits, shape[3])
    assert torch.equal(cols, codes.float().transpose(-1, -2))
