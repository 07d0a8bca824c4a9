"""Malformed KV configs end in ``ConfigError``, never another exception (property tests).

Valid configs of every feature are written to their JSON form, then broken (a value replaced by
JSON garbage or by a value of the wrong type, a key removed or added, the version changed, a
layer index made invalid) and parsed again: ``config_from_dict`` / ``load_config`` must return a
config or raise ``ConfigError`` with a message, and must raise it whenever the break is one that
no valid config has. ``validate_for`` is checked the same way against random model shapes.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from kvlens.config import (
    FORMAT,
    PRESETS,
    VERSION,
    KVConfig,
    LayerKV,
    ProtectSettings,
    config_from_dict,
    load_config,
    save_config,
    validate_for,
)
from kvlens.errors import ConfigError
from kvlens.model.shape import ModelShape
from kvlens.quant import CodebookSpec, QuantSpec, RotationSpec
from kvlens.research.sets import mikv_settings

FAST = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _valid_configs() -> list[dict]:
    """JSON forms that use every part of the format (all versions)."""
    kivi = PRESETS["kivi-2"]
    spec = QuantSpec(2, "per-token", 32, fit="mse")
    out = [PRESETS[n].to_dict() for n in ("exact", "kivi-2", "mikv-2-int4", "kivi-2-prerope",
                                          "kivi-2-sinks", "per-token-2-rot")]
    out.append(KVConfig("overrides", kivi.default,
                        {0: LayerKV(), 3: LayerKV(spec, spec, 64, flush_tokens=32)},
                        protect=mikv_settings(0.1, 4, "fixed", layers=(1, 3)),
                        balancers={1: ((1.0, 2.0), (0.5, 4.0))}, scale_dtype="8bit",
                        rotation_seed=7,
                        model={"num_layers": 4, "head_dim": 64, "num_key_value_heads": 2},
                        description="every feature").to_dict())
    out.append(KVConfig("engine", LayerKV(key_format="fp8_e4m3@head", value_format="q4_0+norot"),
                        {2: LayerKV(key_format="f16", value_format="f16")},
                        kv_scales={0: {"key": (0.5, 0.25)}, 1: {"key": (1.0, 2.0)}},
                        fp_dtype="float8_e4m3fn").to_dict())
    out.append(KVConfig("llamacpp", LayerKV(key_format="q8_0", value_format="q4_0"),
                        engine_attention="llamacpp-cpu-fa").to_dict())
    kbook = CodebookSpec(2, "lloyd-max-normal", RotationSpec(2))
    out.append(KVConfig("codebook-keys", LayerKV(CodebookSpec(3, renormalize=True, rotation=(
        RotationSpec(2))), QuantSpec(4, "per-token")),
                        {0: LayerKV(key_format="f16", value_format="f16"),
                         1: LayerKV(kbook, spec)}, rotation_seed=2,
                        write_before_attention=True).to_dict())
    return [json.loads(json.dumps(d)) for d in out]


VALID = _valid_configs()

# JSON values of every kind, nested a few levels (what a hand-edited file can hold)
SCALARS = (st.none() | st.booleans() | st.integers(-2**40, 2**40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
GARBAGE = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


def _kind(value) -> str:
    if value is None:
        return "null"
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str),
                        ("list", list), ("object", dict)):
        if isinstance(value, types):
            return kind
    raise AssertionError(value)


# The JSON kinds each field accepts ("number": int or float). Anything else must be refused.
NUMBER = {"int", "float"}
# QuantSpec.from_dict (kvlens.quant.spec) reads a bool spec version as 1: tolerated here
SPEC = {"version": {"int", "bool"}, "bits": {"int"}, "granularity": {"str"},
        "group_size": {"int", "null"}, "symmetric": {"bool"}, "fit": {"str"}}
LAYER = {"key": {"object", "null"}, "value": {"object", "null"},
         "residual_tokens": {"int"}, "flush_tokens": {"int"}, "pre_rope_keys": {"bool"},
         "rotate_keys": {"bool"}, "rotate_values": {"bool"}, "key_format": {"str", "null"},
         "value_format": {"str", "null"}}
PROTECT = {"sink_tokens": {"int"}, "balancer": {"str"}, "balancer_exponent": NUMBER}
IMPORTANCE = {"heavy_fraction": NUMBER, "set_bits": {"int", "null"}, "layers": {"list", "null"}}
TOP = {"format": {"str"}, "version": {"int"}, "name": {"str"}, "description": {"str", "null"},
       "default": {"object"}, "layers": {"object", "null"}, "protect": {"object", "null"},
       "balancers": {"object", "null"}, "scale_dtype": {"str"},
       "fp_dtype": {"str"}, "rotation_seed": {"int", "null"}, "model": {"object", "null"},
       "kv_scales": {"object", "null"}, "engine_attention": {"str", "null"}}


def _typed_fields(doc: dict):
    """``(path, allowed kinds)`` for every field of ``doc`` whose type the format fixes."""
    for key, kinds in TOP.items():
        if key in doc:
            yield (key,), kinds
    layers = [("default",)] + [("layers", k) for k in (doc.get("layers") or {})]
    for base in layers:
        layer = _get(doc, base)
        for key, kinds in LAYER.items():
            if key in layer:
                yield (*base, key), kinds
        for tensor in ("key", "value"):
            if isinstance(layer.get(tensor), dict):
                for key, kinds in SPEC.items():
                    if key in layer[tensor]:
                        yield (*base, tensor, key), kinds
    for section, keys in (("protect", PROTECT), ("importance", IMPORTANCE)):
        if isinstance(doc.get(section), dict):
            for key, kinds in keys.items():
                if key in doc[section]:
                    yield (section, key), kinds


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _set(doc, path, value):
    doc = json.loads(json.dumps(doc))
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _paths(node, prefix=()):
    """Every path to a value inside ``node`` (dict keys and list indices)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _parse(data):
    """A config, or None after a ``ConfigError`` with a message; any other exception fails."""
    try:
        cfg = config_from_dict(data)
    except ConfigError as exc:
        assert str(exc).strip()
        return None
    assert isinstance(cfg, KVConfig)
    return cfg


def test_valid_configs_round_trip():
    for doc in VALID:
        cfg = config_from_dict(doc)
        assert cfg.to_dict() == doc
    assert VERSION == 1 and {d["version"] for d in VALID} == {VERSION}  # one version


@FAST
@given(st.sampled_from(VALID), st.data(), GARBAGE)
def test_garbage_anywhere_is_a_config_error_or_a_config(doc, data, garbage):
    path = data.draw(st.sampled_from(list(_paths(doc))))
    cfg = _parse(_set(doc, path, garbage))
    if cfg is not None:  # whatever was accepted writes and reads back the same
        assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@FAST
@given(st.sampled_from(VALID), st.data(), GARBAGE)
def test_a_value_of_the_wrong_type_is_refused(doc, data, garbage):
    path, kinds = data.draw(st.sampled_from(list(_typed_fields(doc))))
    assume(_kind(garbage) not in kinds)
    with pytest.raises(ConfigError):
        config_from_dict(_set(doc, path, garbage))


@FAST
@given(st.sampled_from(VALID), st.data())
def test_a_removed_key_is_a_config_error_or_a_config(doc, data):
    path = data.draw(st.sampled_from([p for p in _paths(doc)
                                      if isinstance(_get(doc, p[:-1]), dict)]))
    broken = json.loads(json.dumps(doc))
    del _get(broken, path[:-1])[path[-1]]
    cfg = _parse(broken)
    if path in (("default",), ("version",)) or path[-1] in ("bits", "granularity"):
        assert cfg is None  # required


INDEX_TABLES = ("layers", "balancers", "kv_scales")  # objects keyed by layer index


@FAST
@given(st.sampled_from(VALID), st.data(), st.text(min_size=1, max_size=8), GARBAGE)
def test_an_unknown_key_is_refused(doc, data, key, value):
    where = data.draw(st.sampled_from([()] + [p for p in _paths(doc)
                                              if isinstance(_get(doc, p), dict)]))
    assume(key not in _get(doc, where))
    if where in [(t,) for t in INDEX_TABLES]:
        assume(not (key.isascii() and key.isdigit()))  # that would be a new layer, not garbage
    broken = json.loads(json.dumps(doc))
    _get(broken, where)[key] = value
    with pytest.raises(ConfigError):
        config_from_dict(broken)


@FAST
@given(st.sampled_from(VALID), GARBAGE | st.integers())
@example(VALID[0], 0)
@example(VALID[0], VERSION + 1)
@example(VALID[0], 6)  # the development builds' versions 2-6
@example(VALID[0], True)
@example(VALID[0], 1.0)
@example(VALID[0], "1")
def test_unknown_and_malformed_versions_are_refused(doc, version):
    assume(not (_kind(version) == "int" and version == VERSION))
    with pytest.raises(ConfigError, match="version"):
        config_from_dict(_set(doc, ("version",), version))


def test_a_development_version_is_refused_naming_the_one_version():
    """The development builds before 0.1.0 wrote versions 2-6, each adding fields to version 1,
    which now holds them all: such a file is refused naming version 1, and reads once it says
    so (a removed layout in it is refused by name: the tests below)."""
    for doc in VALID:
        for version in range(2, 7):
            with pytest.raises(ConfigError, match=r"version 1 \(a file of the development "
                                                  r'builds .* "version": 1\)'):
                config_from_dict(doc | {"version": version})
        assert config_from_dict(doc).to_dict() == doc


BAD_INDICES = st.sampled_from(["-1", "x", "1.5", "", " 1", "+1", "1_0", "1e3", "0x1", "\u0661"]) \
    | st.text(max_size=4).filter(lambda s: not (s.isascii() and s.isdigit()))


@FAST
@given(st.sampled_from(VALID), st.sampled_from(INDEX_TABLES), BAD_INDICES)
def test_bad_layer_indices_are_refused(doc, section, key):
    broken = json.loads(json.dumps(doc))
    table = broken.get(section) or {}
    entry = next(iter(table.values()), {"key": None} if section == "layers" else
                 [[1.0]] if section == "balancers" else {"key": [1.0]})
    broken[section] = {key: entry}
    with pytest.raises(ConfigError):
        config_from_dict(broken)


@FAST
@given(GARBAGE)
@example([-1])
@example([0, 0])
@example([1.0])
@example([True])
def test_bad_mikv_layer_lists_are_refused(layers):
    assume(not (isinstance(layers, list) and all(_kind(x) == "int" and x >= 0 for x in layers)
                and len(set(layers)) == len(layers)) and layers is not None)
    doc = VALID[6]  # uses importance.layers
    with pytest.raises(ConfigError, match="importance.layers"):
        config_from_dict(_set(doc, ("importance", "layers"), layers))


@FAST
@given(GARBAGE)
def test_a_top_level_that_is_not_an_object_is_refused(data):
    assume(not isinstance(data, dict))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        config_from_dict(data)


def test_the_reported_case_names_the_field():
    """`{"version": 1, "layers": "oops"}` used to end in AttributeError."""
    with pytest.raises(ConfigError, match="'layers' must be an object"):
        config_from_dict({"version": 1, "layers": "oops"})
    with pytest.raises(ConfigError, match="'balancers' must be an object"):
        config_from_dict({**VALID[1], "balancers": [1, 2]})
    with pytest.raises(ConfigError, match="given twice"):
        config_from_dict({**VALID[1], "layers": {"1": {}, "01": {}}})


# -- files --------------------------------------------------------------------------------------

TMP = Path(tempfile.mkdtemp(prefix="kvlens-test-config-"))


def _load_bytes(data: bytes):
    path = TMP / "c.json"
    path.write_bytes(data)
    try:
        return load_config(path)
    except ConfigError as exc:
        assert str(exc).strip()
        return None


@FAST
@given(st.binary(max_size=64))
@example(b"\xff\xfe{}")
@example(b'{"version": 1, "name": "\xe9"}')
@example(b"")
@example(b"[" * 100_000)
@example(b'{"a": ' * 50_000)
@example(b"NaN")
def test_load_config_refuses_any_bytes_that_are_not_a_config(data):
    assert _load_bytes(data) is None


@FAST
@given(st.sampled_from(VALID), st.data(), GARBAGE)
def test_load_config_of_broken_json_files(doc, data, garbage):
    path = data.draw(st.sampled_from(list(_paths(doc))))
    text = json.dumps(_set(doc, path, garbage))
    cut = data.draw(st.integers(0, len(text)))
    for payload in (text, text[:cut]):
        _load_bytes(payload.encode())


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not UTF-8"):
        (tmp_path / "latin1.json").write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
        load_config(tmp_path / "latin1.json")
    with pytest.raises(ConfigError, match="nested too deeply"):
        (tmp_path / "deep.json").write_text("[" * 100_000)
        load_config(tmp_path / "deep.json")
    with pytest.raises(ConfigError, match="Cannot read KV config"):
        load_config(tmp_path)  # a directory
    with pytest.raises(ConfigError, match="Cannot read KV config"):
        load_config(tmp_path / "missing.json")
    good = tmp_path / "good.json"
    save_config(PRESETS["mikv-2-int4"], good)
    assert load_config(good) == PRESETS["mikv-2-int4"]
    assert json.loads(good.read_text())["format"] == FORMAT


# -- validate_for ------------------------------------------------------------------------------

INDICES = st.lists(st.integers(0, 9), max_size=4, unique=True)


@FAST
@given(st.integers(1, 8), st.sampled_from([32, 64, 80, 128]), st.integers(1, 4), INDICES,
       st.one_of(st.none(), INDICES.filter(bool)), INDICES, INDICES)
def test_validate_for_refuses_bad_layer_indices_with_config_error(
        num_layers, head_dim, kv_heads, overrides, mikv_layers, balancer_layers, scale_layers):
    doc = {"format": FORMAT, "version": VERSION, "name": "x", "default": VALID[1]["default"],
           "layers": {str(i): {"key": None} for i in overrides},
           "protect": {"sink_tokens": 4, "balancer": "fixed" if balancer_layers else "off"},
           "importance": {"heavy_fraction": 0.1, "layers": mikv_layers},
           "balancers": {str(i): [[1.0] * head_dim] * kv_heads for i in balancer_layers}
           or None}
    cfg = config_from_dict(doc)
    if scale_layers:  # kv_scales for layers that are, or are not, engine layers
        cfg = KVConfig("e", LayerKV(key_format="fp8_e4m3", value_format="fp8_e4m3:s1"),
                       kv_scales={i: {"key": (1.0,)} for i in scale_layers})
    info = ModelShape(num_layers, kv_heads, kv_heads, head_dim, architecture="Synthetic")
    used = set(cfg.layers) | set(cfg.balancers) | set(cfg.kv_scales) | set(
        (cfg.protect.importance.layers if cfg.protect and cfg.protect.importance else None) or ())
    try:
        validate_for(cfg, info)
    except ConfigError as exc:
        assert str(exc).strip()
    else:
        assert all(i < num_layers for i in used), used
        if scale_layers:
            assert set(scale_layers) == set(range(num_layers))


# -- codebook keys (version 5: vLLM TurboQuant's) --------------------------------------------------

TOK = QuantSpec(2, "per-token", 32)


def _key_book_config(**kw) -> KVConfig:
    base = dict(name="ck", default=LayerKV(CodebookSpec(3, "lloyd-max-normal", renormalize=True),
                                           QuantSpec(4, "per-token")))
    return KVConfig(**(base | kw))


@pytest.mark.parametrize("make,message", [
    (lambda: LayerKV(CodebookSpec(2), None, 32, pre_rope_keys=True), "pre_rope_keys"),
    (lambda: LayerKV(CodebookSpec(2, rotation=None), None, 32, rotate_keys=True),
     "has no rotation"),
    (lambda: _key_book_config(rotation_seed=3), "rotation seed None is not the config's "
                                                "rotation_seed 3"),
    (lambda: _key_book_config(default=LayerKV(CodebookSpec(2, rotation=RotationSpec(1)), TOK)),
     "the key codebook's rotation seed 1 is not the config's rotation_seed None"),
    (lambda: LayerKV(TOK, CodebookSpec(2), 32), "A codebook value spec .* removed from kvlens"),
])
def test_codebook_configs_refused_with_the_reason(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_codebook_keys_set_the_key_rotation():
    """Codebook keys: the key rotation follows the codebook, the config writes and reads back
    (at the one version), and the layout is checked against the model."""
    for kind in ("lloyd-max", "lloyd-max-normal"):
        keys = CodebookSpec(3, kind)
        cfg = KVConfig("ck", LayerKV(keys, QuantSpec(4, "per-token")))
        assert cfg.default.rotate_keys and cfg.default.key_codebook == keys
        doc = cfg.to_dict()
        assert doc["version"] == VERSION and config_from_dict(doc) == cfg
    info = ModelShape(3, 2, 2, 64, architecture="Synthetic")
    validate_for(cfg, info)
    with pytest.raises(ConfigError, match="No Hadamard rotation for head_dim 63"):
        validate_for(cfg, replace(info, head_dim=63))
    first = KVConfig("wf", LayerKV(QuantSpec(4, "per-token"), QuantSpec(4, "per-token")),
                     {0: LayerKV(), 1: LayerKV(key_format="q8_0", value_format="q8_0")},
                     write_before_attention=True)
    assert first.to_dict()["write_before_attention"] is True
    assert config_from_dict(first.to_dict()) == first
    assert "write_before_attention" not in KVConfig("u", LayerKV(TOK, TOK, 32)).to_dict()
    for bad, message in ((dict(default=LayerKV(QuantSpec(4, "per-token"), None, 16)),
                          "default: write_before_attention codes every token at once"),
                         (dict(layers={2: LayerKV(None, QuantSpec(4, "per-token"), 8)}),
                          "layer 2: write_before_attention .* residual_tokens=8, allowed: 0"),
                         (dict(protect=ProtectSettings(4, "off")), "cannot be combined with 'protect'"),
                         (dict(write_before_attention=1), "allowed: true, false")):
        with pytest.raises(ConfigError, match=message):
            replace(first, **bad)


# -- removed research layouts: codebook values, fitted codebooks, centred keys (issue #57) ---------

# A version-4 file as kvlens wrote it (fitted codebook values and their centroids, 8-bit
# metadata) and a version-5 one (centred keys, a fitted key codebook), before issue #57 removed
# them (docs/lab-notes/codebooks.md names the last commit that had them).
V4_FILE = """{"format": "kvlens.kvconfig", "version": 4, "name": "cb", "description": "",
 "default": {"key": {"version": 1, "bits": 2, "granularity": "per-channel", "group_size": 32,
   "symmetric": false}, "value": {"version": 1, "bits": 2, "codebook": "fitted",
   "rotation": {"version": 1, "seed": null}, "renormalize": true}, "residual_tokens": 32,
   "flush_tokens": 0, "pre_rope_keys": false, "rotate_keys": false, "rotate_values": true},
 "layers": {}, "protect": null, "balancers": null, "scale_dtype": "8bit", "fp_dtype": "float16",
 "rotation_seed": null, "model": null, "codebooks": {"0": {"value": [-1.5, -0.5, 0.5, 1.5]}}}"""
V5_FILE = """{"format": "kvlens.kvconfig", "version": 5, "name": "centred", "description": "",
 "default": {"key": {"version": 1, "bits": 2, "granularity": "per-token", "group_size": 32,
   "symmetric": false}, "value": {"version": 1, "bits": 2, "granularity": "per-token",
   "group_size": 32, "symmetric": false}, "residual_tokens": 64, "flush_tokens": 0,
   "pre_rope_keys": false, "rotate_keys": false, "rotate_values": false, "center_keys": true},
 "layers": {"1": {"key": {"version": 1, "bits": 2, "codebook": "weighted", "rotation": {
   "version": 1, "seed": null}, "renormalize": true}, "center_keys": false}},
 "protect": null, "balancers": null, "scale_dtype": "float16", "fp_dtype": "float16",
 "rotation_seed": null, "model": null, "codebooks": {"1": {"key": [-1.5, -0.5, 0.5, 1.5]}},
 "key_means": {"0": [[0.5, -0.25], [1.0, 2.0]]}}"""
REMOVED_CB = (r"removed from kvlens by issue #57 \(a negative result, "
              r"docs/lab-notes/codebooks\.md\)")


def test_a_config_with_a_removed_layout_is_refused_naming_the_removal(tmp_path):
    """Codebook values, fitted codebooks and centred keys were removed (issue #57): a file that
    stores any of them, alone or together, whatever its version, is one ``ConfigError`` that
    names what it stores and the lab note, not an unknown-key error."""
    plain = json.loads(V5_FILE)
    plain["default"].pop("center_keys")
    plain = {k: v for k, v in plain.items() if k not in ("codebooks", "key_means")} | {
        "layers": {}, "version": VERSION}
    assert config_from_dict(plain).default.key == TOK
    value_book = {"version": 1, "bits": 3, "codebook": "lloyd-max", "rotation": None,
                  "renormalize": False}
    fitted_key = json.loads(V5_FILE)["layers"]["1"]["key"]
    for bad, what in (
            (json.loads(V4_FILE), r"fitted codebook centroids \('codebooks'\), a codebook value "
                                  r"spec, a fitted codebook spec"),
            (json.loads(V5_FILE), r"centred keys \('key_means'\), centred keys "
                                  r"\('center_keys': true\), fitted codebook centroids"),
            (plain | {"key_means": {"0": [[0.5, -0.25]]}}, r"centred keys \('key_means'\),"),
            (_set(plain, ("default", "center_keys"), True), r"\('center_keys': true\),"),
            (plain | {"layers": {"2": {"center_keys": True}}}, r"\('center_keys': true\),"),
            (plain | {"codebooks": {"0": {"key": [0.0, 1.0]}}}, "centroids \\('codebooks'\\),"),
            (_set(plain, ("default", "value"), value_book), "a codebook value spec,"),
            (_set(plain, ("default", "key"), fitted_key), "a fitted codebook spec,")):
        with pytest.raises(ConfigError, match=f"This config stores .*{what}.*{REMOVED_CB}"):
            config_from_dict(bad)
    path = tmp_path / "centred.json"
    path.write_text(V5_FILE)
    with pytest.raises(ConfigError, match=rf"centred\.json: .*{REMOVED_CB}"):
        load_config(path)


def test_center_keys_false_reads_as_absent():
    """``"center_keys": false`` (which older versions wrote into the layer overrides of a
    centred default) asks for nothing removed: the config reads as without it."""
    doc = VALID[6]
    flagged = _set(_set(doc, ("default", "center_keys"), False),
                   ("layers", "3", "center_keys"), False)
    assert config_from_dict(flagged) == config_from_dict(doc)
    with pytest.raises(ConfigError, match="unknown keys"):
        config_from_dict(_set(doc, ("default", "centre_keys"), False))


# A version-6 file with coupled (CQ) keys and values, as kvlens wrote it before issue #57 removed
# them (docs/lab-notes/coupled.md names the last commit that had them).
V6_COUPLED_FILE = """{"format": "kvlens.kvconfig", "version": 6, "name": "coupled",
 "description": "", "default": {"key": {"version": 1, "channels": 2, "index_bits": 1,
   "grouping": "correlation", "scope": "layer", "weighted": true, "iters": 20, "seed": 0},
   "value": {"version": 1, "channels": 2, "index_bits": 2, "grouping": "consecutive",
   "scope": "layer", "weighted": false, "iters": 20, "seed": 0}, "residual_tokens": 64,
   "flush_tokens": 32, "pre_rope_keys": false, "rotate_keys": false, "rotate_values": false},
 "layers": {"1": {"key": {"version": 1, "bits": 2, "granularity": "per-token", "group_size": 32,
   "symmetric": false}, "value": {"version": 1, "bits": 2, "granularity": "per-token",
   "group_size": 32, "symmetric": false}, "residual_tokens": 32, "flush_tokens": 0,
   "pre_rope_keys": false, "rotate_keys": false, "rotate_values": false}},
 "mikv": {"heavy_fraction": 0.0, "sink_tokens": 4, "balancer": "off", "balancer_exponent": 0.5},
 "balancers": null, "scale_dtype": "float16", "fp_dtype": "float16", "rotation_seed": null,
 "model": null, "coupled_codebooks": {"0": {"key": {"centroids": [[[-1.0, 0.5], [1.0, -0.5]]],
   "permutation": [[1, 0, 3, 2]], "weights": [[1.0, 2.0, 0.5, 1.0]]},
   "value": {"centroids": [[[-1.0, -1.0], [-0.25, 0.5], [0.25, -0.5], [1.0, 1.0]]]}}}}"""
REMOVED = (r"coupled layouts were removed from kvlens \(a negative result, "
           r"docs/lab-notes/coupled\.md\)")


def test_a_coupled_config_is_refused_naming_the_removal(tmp_path):
    """Coupled layouts were removed (issue #57): a file that stores them, through its specs
    (default or a layer override), its ``coupled_codebooks`` or both, whatever its version, is
    one ``ConfigError`` that says so and names the lab note, not an unknown-key error."""
    doc = json.loads(V6_COUPLED_FILE)
    coupled_default, plain = doc["default"], doc["layers"]["1"]
    no_books = {k: v for k, v in doc.items() if k != "coupled_codebooks"}
    for bad in (doc, doc | {"version": 1}, no_books,
                doc | {"default": plain, "layers": {}},  # the codebooks alone
                no_books | {"default": plain, "layers": {"0": coupled_default}}):
        with pytest.raises(ConfigError, match=REMOVED):
            config_from_dict(bad)
    path = tmp_path / "coupled.json"
    path.write_text(V6_COUPLED_FILE)
    with pytest.raises(ConfigError, match=rf"coupled\.json: .*{REMOVED}"):
        load_config(path)


# The gear-2 preset as kvlens wrote it (version 2; its description shortened) before issue #57
# removed GEAR (docs/lab-notes/gear-mikv.md names the last commit that had it).
V2_GEAR_FILE = """{"format": "kvlens.kvconfig", "version": 2, "name": "gear-2", "description":
 "GEAR on KIVI 2-bit grouping", "default": {"key": {"version": 1, "bits": 2, "granularity":
   "per-channel", "group_size": 32, "symmetric": false}, "value": {"version": 1, "bits": 2,
   "granularity": "per-token", "group_size": 32, "symmetric": false}, "residual_tokens": 64,
   "flush_tokens": 0, "pre_rope_keys": false, "rotate_keys": false, "rotate_values": false},
 "layers": {}, "mikv": null, "gear": {"rank": 4, "outlier_fraction": 0.02, "power_iters": 3,
   "layers": null}, "balancers": null, "scale_dtype": "float16", "fp_dtype": "float16",
 "rotation_seed": null, "model": null}"""
REMOVED_GEAR = (r"GEAR was removed from kvlens by issue #57 \(a negative result, "
                r"docs/lab-notes/gear-mikv\.md\)")


def test_the_old_section_name_is_refused_naming_the_new_keys():
    """The sinks-and-balancer section was called ``mikv`` before issue #57 named it
    ``protect``; a file with the old name is refused saying what to rename (``null`` asks for
    nothing), and the research importance set is its own key."""
    doc = PRESETS["kivi-2-sinks"].to_dict()
    old = {k: v for k, v in doc.items() if k != "protect"} | {"mikv": doc["protect"]}
    with pytest.raises(ConfigError, match="'mikv' section was renamed 'protect'"):
        config_from_dict(old)
    assert config_from_dict(doc | {"mikv": None}) == PRESETS["kivi-2-sinks"]
    mikv = PRESETS["mikv-2-int4"].to_dict()
    assert mikv["importance"] == {"heavy_fraction": 0.2, "set_bits": 4}
    assert set(mikv["protect"]) == {"sink_tokens", "balancer", "balancer_exponent"}
    with pytest.raises(ConfigError, match="'importance' needs a 'protect' section"):
        config_from_dict(mikv | {"protect": None})


def test_a_gear_config_is_refused_naming_the_removal(tmp_path):
    """GEAR was removed (issue #57): a file with a ``gear`` section, whatever its version or
    settings, is one ``ConfigError`` that says so and names the lab note, not an unknown-key
    error; ``"gear": null`` asks for nothing removed and reads as absent."""
    doc = json.loads(V2_GEAR_FILE)
    for bad in (doc, doc | {"version": 1}, _set(doc, ("gear", "layers"), [0, 3]),
                doc | {"gear": {}}, doc | {"gear": "on"}):
        with pytest.raises(ConfigError, match=REMOVED_GEAR):
            config_from_dict(bad)
    off = doc | {"version": VERSION}
    assert config_from_dict(off | {"gear": None}) == config_from_dict(
        {k: v for k, v in off.items() if k != "gear"})
    path = tmp_path / "gear.json"
    path.write_text(V2_GEAR_FILE)
    with pytest.raises(ConfigError, match=rf"gear\.json: .*{REMOVED_GEAR}"):
        load_config(path)
