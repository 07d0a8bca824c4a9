"""The ``coupled`` variant of ``compare-axes``: keys and values under coupled (vector)
quantization (``kvlens.quant.coupled``, CQ), beside the uniform layouts of the same sweep.

Codebooks are fitted per layer on calibration text and then code other text. With at least 2
samples the sweep splits the capture: the codebooks are fitted on the first half of the samples
(``fit_samples``) and **every** variant of the sweep, uniform ones included, is measured on the
rest, so coupled and scalar errors come from the same held-out tokens. With one sample the
codebooks are fitted on the sample they code (in-sample), and the summary says so.

Records carry ``format = "coupled:<setting>"`` (``coupled_record_name``), ``axis =
"per-vector"``, ``bits`` = the index bits ``b`` and ``group_size`` = the channels ``c``; they are
summarised with the engine formats and codebooks (``format_means``), and ``coupled_info``
gives each setting's held bits.
"""

from __future__ import annotations

from kvlens.analysis.compare.config import CompareConfig
from kvlens.quant.coupled import CoupledSpec, fake_quantize_coupled, fit_coupled, parse_coupled

COUPLED = "coupled"
AMORTISE_TOKENS = 4096  # the context the codebooks' bytes are also amortised over in the summary


def uses_coupled(config: CompareConfig) -> bool:
    return COUPLED in config.variants


def coupled_specs(config: CompareConfig) -> tuple[CoupledSpec, ...]:
    return tuple(parse_coupled(n, config.coupled_iters) for n in config.coupled)


def fit_samples(n_samples: int) -> tuple[slice, slice]:
    """``(fit, measured)`` sample slices: the first half fits, the rest is measured; one
    sample fits and is measured (in-sample)."""
    if n_samples < 2:
        return slice(0, n_samples), slice(0, n_samples)
    half = n_samples // 2
    return slice(0, half), slice(half, n_samples)


def split_note(n_samples: int) -> dict:
    fit, measured = fit_samples(n_samples)
    held_out = n_samples >= 2
    return {
        "fitted_on_samples": [fit.start, fit.stop - 1],
        "measured_on_samples": [measured.start, measured.stop - 1],
        "held_out": held_out,
        "note": ("codebooks fitted on the first half of the capture's samples; every variant "
                 "measured on the rest (held-out)" if held_out else
                 "one sample: codebooks fitted on the sample they code (in-sample)"),
    }


def coupled_record_name(spec: CoupledSpec) -> str:
    """``Record.format`` of a coupled setting, e.g. ``"coupled:c4b8+corr"``."""
    return f"{COUPLED}:{spec.name}"


def coupled_approximations(config: CompareConfig, fit, measured):
    """Yield ``(tensor, spec, approximation)`` for every coupled setting of one layer: codebooks
    fitted on ``fit = (q, k, v)`` and applied to ``measured = (q, k, v)`` (post-RoPE keys, as
    cached; ``weighted`` settings weight by the fit samples' queries and are for keys only)."""
    q_fit, k_fit, v_fit = fit
    _, k, v = measured
    for spec in coupled_specs(config):
        for tensor, x_fit, x in (("key", k_fit, k), ("value", v_fit, v)):
            if tensor not in config.tensors or (tensor == "value" and spec.weighted):
                continue
            books = fit_coupled(x_fit, spec, q_fit if spec.weighted else None)
            yield tensor, spec, fake_quantize_coupled(x, books=books)


def coupled_info(config: CompareConfig, kv_heads: int, tokens: int, head_dim: int) -> list[dict]:
    """Per coupled setting: index and codebook bytes, and held bits per element with the
    codebooks amortised over one sequence of the capture's length and over
    ``AMORTISE_TOKENS`` tokens."""
    out = []
    for spec in coupled_specs(config):
        out.append({
            "format": coupled_record_name(spec),
            "family": COUPLED,
            "shares_scale": "nothing: one index per group of channels into a per-model codebook",
            "code_bits": spec.index_bits,
            "channels": spec.channels,
            "code_bits_per_element": spec.bits_per_channel,
            "bits_per_element": spec.bits_per_element(tokens, kv_heads, head_dim),
            f"bits_per_element_at_{AMORTISE_TOKENS}": spec.bits_per_element(
                AMORTISE_TOKENS, kv_heads, head_dim),
            "codebook_bytes_per_layer": spec.codebook_bytes(kv_heads, head_dim),
            "rotated": spec.grouping == "hadamard",
            "calibration": f"k-means ({spec.iters} Lloyd rounds, seed {spec.seed}) per layer and "
                           f"tensor, {spec.scope} scope, {spec.grouping} grouping"
                           + (", query-weighted" if spec.weighted else ""),
        })
    return out
