"""Index selections such as ``--layers 0,4,8-11``: parsing them and writing index lists back in
the same syntax (one place for the syntax)."""

from __future__ import annotations

from collections.abc import Iterable

from kvlens.errors import InputError


def parse_index_spec(spec: str | None, limit: int, what: str = "layer") -> list[int]:
    """``"0,4,8-11"`` -> ``[0, 4, 8, 9, 10, 11]``; ``None``/``"all"`` -> ``range(limit)``;
    ``InputError`` for malformed items or indices outside ``[0, limit)``."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(range(limit))
    out: set[int] = set()
    for item in spec.split(","):
        item = item.strip()
        try:
            if "-" in item:
                lo_s, hi_s = item.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if lo > hi:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(item))
        except ValueError:
            raise InputError(
                f"Invalid {what} spec {spec!r}: {item!r} is not an index or a range like 8-11. "
                f"Example: 0,4,8-11."
            ) from None
    bad = sorted(i for i in out if i < 0 or i >= limit)
    if bad:
        raise InputError(f"Invalid {what} spec {spec!r}: {bad} outside 0-{limit - 1} "
                         f"(the model has {limit} {what}s).")
    return sorted(out)


def format_index_spec(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3, 5"`` (any order, repeats ignored; ``""`` for none): the
    inverse of ``parse_index_spec`` for non-negative indices."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
