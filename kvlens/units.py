"""How kvlens writes quantities for people, one way each: bytes, durations and a value with
its 95% interval. The CLI's tables, the report and the library's messages all use these."""

from __future__ import annotations

_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float) -> str:
    """``512 B``, ``12.3 KiB``, ``4.5 MiB``, ``1.2 GiB`` (binary units, one decimal)."""
    for unit, size in _BYTE_UNITS:
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"


def format_bytes_by_device(by_device: dict[str, int]) -> str:
    """``cpu 270.1 MiB, disk 243.1 MiB``."""
    return ", ".join(f"{dev} {format_bytes(n)}" for dev, n in by_device.items()) or "-"


def format_seconds(s: float) -> str:
    """A duration for progress and profile lines: seconds below two minutes, else minutes."""
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def format_interval(stat: dict, fmt: str = ".4f", *, scale: float = 1.0, sign: str = "",
                    key: str = "value", sep: str = " ", unit: str = "") -> str:
    """``value[unit] [lo, hi]`` of a statistic ``{key: v, "ci95": [lo, hi]}`` (``scale``
    multiplies all three; ``sign="+"`` shows a difference's sign). A value too small for
    ``fmt`` keeps 3 significant digits instead of printing zeros; table cells put the interval
    on a second line (``sep="\\n"``)."""
    v, (lo, hi) = stat[key] * scale, stat["ci95"]
    if fmt.endswith("f") and 0 < abs(v) < 10 ** -int(fmt[1:-1] or 0):
        fmt = ".3g"
    return f"{v:{sign}{fmt}}{unit}{sep}[{lo * scale:{sign}{fmt}}, {hi * scale:{sign}{fmt}}]"
