"""Coupled (CQ) key and value specs in a KV config (research, issue #50; version 6).

A layer's ``key`` or ``value`` may be a ``kvlens.quant.coupled.CoupledSpec``: each vector of the
quantized history is stored as one ``b``-bit index per group of ``c`` channels into fitted
codebooks (``kvlens.cache.coupled``). The codebooks live in the config, per layer and tensor, in
``coupled_codebooks``::

    "coupled_codebooks": {"3": {"key": {"centroids": [[[x_0, .., x_c-1] per centroid]
                                                      per codebook],
                                        "permutation": [[d_0, .., d_D-1] per KV head],
                                        "weights": [[w_0, .., w_D-1] per KV head]}}}

``centroids`` is ``[num_codebooks][2^b][c]`` (``CoupledSpec.num_codebooks``: 1, ``D / c`` or
``Hkv * D / c`` by scope), float16 values; ``permutation`` (``"correlation"`` grouping only) the
channels of each KV head in group order; ``weights`` (``weighted`` only) the float16 channel
weights the encoder's nearest-centroid search uses. Their shapes against the model (head_dim,
KV heads) are checked by ``validate_for`` (``check_for_model``).

Rules: a coupled tensor is not rotated by the layer (``rotate_keys`` / ``rotate_values``: its
grouping is its basis, ``"hadamard"`` rotates), and coupled keys are post-RoPE, uncentred, with no
channel balancer; GEAR is refused (its terms correct uniform codes). Not a default anywhere: the
lever is reached through a config file (``kvlens generate --config``), its ablation in
docs/lab-notes/coupled.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvlens.errors import ConfigError, is_int
from kvlens.quant.coupled import CoupledCodebooks, CoupledSpec, coupled_codebooks

ENTRY_KEYS = ("centroids", "permutation", "weights")
TENSORS = ("key", "value")


def check_layer(layer) -> None:
    """``ConfigError`` unless a ``LayerKV`` with coupled specs meets the rules (module doc)."""
    for tensor, flag in (("key", "rotate_keys"), ("value", "rotate_values")):
        if isinstance(getattr(layer, tensor), CoupledSpec) and getattr(layer, flag):
            raise ConfigError(f"{flag} cannot be combined with a coupled {tensor} spec (its "
                              "grouping is its basis; grouping \"hadamard\" rotates); set "
                              f"{flag}: false.")
    if isinstance(layer.key, CoupledSpec):
        for flag in ("pre_rope_keys", "center_keys"):
            if getattr(layer, flag):
                raise ConfigError(f"A coupled key spec cannot be combined with {flag} (its "
                                  "codebooks code post-RoPE, uncentred keys); set "
                                  f"{flag}: false.")


def _numbers(row: Any, positive: bool = False) -> bool:
    return isinstance(row, (list, tuple)) and len(row) > 0 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        and (x > 0 or not positive) for x in row)


def _entry(spec: CoupledSpec, entry: Any, where: str) -> dict[str, tuple]:
    """One tensor's ``coupled_codebooks`` entry in its one form (tuples of floats / ints)."""
    if not isinstance(entry, Mapping) or "centroids" not in entry or set(entry) - set(ENTRY_KEYS):
        raise ConfigError(f"{where}: allowed: an object with \"centroids\" and, as the spec "
                          f"needs, \"permutation\" and \"weights\" ({', '.join(ENTRY_KEYS)}).")
    books = entry["centroids"]
    ok = isinstance(books, (list, tuple)) and len(books) > 0 and all(
        isinstance(b, (list, tuple)) and len(b) == spec.levels
        and all(_numbers(c) and len(c) == spec.channels for c in b) for b in books)
    if not ok:
        raise ConfigError(f"{where}.centroids: allowed: a list of codebooks, each "
                          f"{spec.levels} centroids of {spec.channels} finite numbers "
                          f"(coupled {spec.name}).")
    out: dict[str, tuple] = {"centroids": tuple(tuple(tuple(float(x) for x in c) for c in b)
                                                for b in books)}
    for name, needed, what in (("permutation", spec.grouping == "correlation",
                                "correlation grouping"),
                               ("weights", spec.weighted, "weighted")):
        if needed != (name in entry):
            raise ConfigError(f"{where}: coupled {spec.name} {'needs' if needed else 'takes no'} "
                              f"\"{name}\" (only the {what} stores one).")
    rows = []
    if "permutation" in entry:
        perm = entry["permutation"]
        if not isinstance(perm, (list, tuple)) or not perm or not all(
                isinstance(r, (list, tuple)) and r and all(is_int(x, 0) for x in r)
                and sorted(r) == list(range(len(r))) and len(r) % spec.channels == 0
                for r in perm):
            raise ConfigError(f"{where}.permutation: allowed: one list per KV head, each a "
                              "permutation of 0..head_dim-1 (head_dim a multiple of "
                              f"{spec.channels}).")
        out["permutation"] = tuple(tuple(int(x) for x in r) for r in perm)
        rows.append(out["permutation"])
    if "weights" in entry:
        weights = entry["weights"]
        if not isinstance(weights, (list, tuple)) or not weights or not all(
                _numbers(r, positive=True) for r in weights):
            raise ConfigError(f"{where}.weights: allowed: one list per KV head of head_dim "
                              "positive finite numbers.")
        out["weights"] = tuple(tuple(float(x) for x in r) for r in weights)
        rows.append(out["weights"])
    shapes = {(len(r), len(r[0])) for r in rows} | {(len(r), len(x)) for r in rows for x in r}
    if len(shapes) > 1:
        raise ConfigError(f"{where}: permutation and weights must both be [KV heads][head_dim] "
                          "(one row per KV head, equally long).")
    return out


def normalise_codebooks(config) -> dict[int, dict[str, dict[str, tuple]]]:
    """``config.coupled_codebooks`` (a ``KVConfig``) checked on its own and in one form: int
    layers, tuples; every entry for a layer storing that tensor with a coupled spec."""
    raw = config.coupled_codebooks
    if not isinstance(raw, Mapping):
        raise ConfigError("'coupled_codebooks' must map layer indices to {\"key\"|\"value\": "
                          "{\"centroids\": [...], ...}}.")
    out: dict[int, dict[str, dict[str, tuple]]] = {}
    for idx, entry in raw.items():
        if not is_int(idx, 0) or not isinstance(entry, Mapping) or not entry:
            raise ConfigError(f"coupled_codebooks.{idx}: allowed: a layer index >= 0 mapping to "
                              '{"key": {...}, "value": {...}} (either or both).')
        out[int(idx)] = {}
        for tensor, books in entry.items():
            if tensor not in TENSORS:
                raise ConfigError(f"coupled_codebooks.{idx}: unknown tensor {tensor!r}; allowed: "
                                  f"{', '.join(TENSORS)}.")
            spec = getattr(config.layer(idx), tensor)
            if not isinstance(spec, CoupledSpec):
                raise ConfigError(f"coupled_codebooks.{idx}.{tensor}: layer {idx} does not store "
                                  f"its {tensor}s with a coupled spec, so these codebooks would "
                                  "be unused; remove them.")
            out[int(idx)][tensor] = _entry(spec, books, f"coupled_codebooks.{idx}.{tensor}")
    return out


def codebooks_to_dict(codebooks: Mapping) -> dict[str, Any]:
    """The JSON form of normalised ``coupled_codebooks`` (lists, string layer keys)."""
    def lists(x):
        return [lists(v) for v in x] if isinstance(x, tuple) else x

    return {str(i): {t: {k: lists(v) for k, v in e.items()} for t, e in sorted(entry.items())}
            for i, entry in sorted(codebooks.items())}


def books_for(config, idx: int, tensor: str, kv_heads: int, head_dim: int
              ) -> CoupledCodebooks | None:
    """The ``CoupledCodebooks`` layer ``idx`` stores ``tensor`` with (``None``: not coupled);
    ``ConfigError`` when the config gives none or their shapes do not fit the model."""
    spec = getattr(config.layer(idx), tensor)
    if not isinstance(spec, CoupledSpec):
        return None
    entry = config.coupled_codebooks.get(idx, {}).get(tensor)
    where = f"Config {config.name!r} layer {idx}"
    if entry is None:
        raise ConfigError(f"{where} stores {tensor}s with coupled {spec.name} but gives no "
                          f"codebooks; add coupled_codebooks.{idx}.{tensor} (fitted on a "
                          "capture, kvlens.quant.coupled.fit_coupled / coupled_arrays).")
    try:
        return coupled_codebooks(spec, entry["centroids"], kv_heads, head_dim,
                                 entry.get("permutation"), entry.get("weights"))
    except ConfigError as exc:
        raise ConfigError(f"{where} {tensor}: {exc}") from None


def check_for_model(config, idx: int, kv_heads: int, head_dim: int) -> None:
    """``ConfigError`` unless layer ``idx``'s coupled specs fit the model (``validate_for``)."""
    layer = config.layer(idx)
    for tensor in TENSORS:
        books_for(config, idx, tensor, kv_heads, head_dim)
    if isinstance(layer.key, CoupledSpec) and config.mikv is not None and (
            config.mikv.balancer == "online" or idx in config.balancers):
        raise ConfigError(f"Config {config.name!r} layer {idx}: a coupled key spec cannot be "
                          "combined with the MiKV channel balancer (its codebooks code the "
                          "unbalanced keys); set mikv.balancer to \"off\".")
