"""Index selections (``kvlens.text.selection``): ``format_index_spec`` writes what
``parse_index_spec`` reads."""

from __future__ import annotations

import random

import pytest

from kvlens.errors import InputError
from kvlens.text.selection import format_index_spec, parse_index_spec


@pytest.mark.parametrize(("values", "text"), [
    ([], ""),
    ([7], "7"),
    ([0, 1, 2, 3, 5], "0-3, 5"),
    ([5, 3, 2, 2, 0, 1], "0-3, 5"),  # any order, repeats ignored
    ([1, 3, 5], "1, 3, 5"),
    ([8, 9], "8-9"),
    ([0, 1, 2, 10, 11, 30], "0-2, 10-11, 30"),
])
def test_format_index_spec(values, text):
    assert format_index_spec(values) == text


def test_format_then_parse_round_trips():
    rng = random.Random(0)
    for _ in range(500):
        limit = rng.randint(1, 64)
        values = [rng.randrange(limit) for _ in range(rng.randint(1, 2 * limit))]
        text = format_index_spec(values)
        assert parse_index_spec(text, limit) == sorted(set(values)), text
        # and back: a parsed spec written again is the same text
        assert format_index_spec(parse_index_spec(text, limit)) == text


def test_parse_refuses_what_format_never_writes():
    with pytest.raises(InputError, match="not an index or a range"):
        parse_index_spec("3-1", 8)
