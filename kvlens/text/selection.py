"""Parsing of index selections such as ``--layers 0,4,8-11`` (one place for the syntax)."""

from __future__ import annotations

from kvlens.errors import InputError


def parse_index_spec(spec: str | None, limit: int, what: str = "layer") -> list[int]:
    """``"0,4,8-11"`` -> ``[0, 4, 8, 9, 10, 11]``; ``None``/``"all"`` -> ``range(limit)``.

    Raises ``InputError`` for malformed items or indices outside ``[0, limit)``.
    """
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
