"""The generic dataclass codec (kvlens.recommend.codec) on a small document of its own with every
field kind it writes: the round trip keeps every value and type; every refusal path (on writing
and on reading: foreign, damaged, mistyped, unknown, missing, out of range, pickled) raises
CodecError and nothing else. Kept measurements through it: test_reuse.py."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import random
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from kvlens.recommend.codec import MAX_DEPTH, CodecError, DataclassCodec


@dataclass(frozen=True)
class Tag:
    """Shared: written once in the document's ``tags``, referred to by index."""

    name: str
    level: int = 0


class Point(NamedTuple):
    x: int
    y: float


@dataclass(frozen=True)
class Pin:
    """Shared too, and holding a shared ``Tag``: a table entry is written in full."""

    tag: Tag
    at: Point


@dataclass
class Box:
    """Nested, not shared (unhashable: a list field)."""

    items: list[int]
    note: str | None = None


@dataclass
class Sample:
    flag: bool
    count: int
    ratio: float
    whole: float  # an int where a float is declared stays an int
    name: str
    nothing: None
    maybe: int | None
    either: str | bool
    ints: tuple[int, ...]
    pair: tuple[int, float]
    empty: tuple[()]
    names: list[str]
    by_name: dict[str, float]
    by_tuple: dict[tuple[int, str], list[int]]
    by_tag: dict[Tag, Point | None]
    pin: Pin
    pins: list[Pin | None]
    box: Box
    no_box: Box | None
    tensors: dict[str, torch.Tensor]
    array: np.ndarray
    anything: Any
    loose: list  # an unparameterised list: its items are self-describing
    made: list = field(default_factory=list, init=False)  # the constructor's: never written


SHARED = {"tags": Tag, "all_pins": Pin}
CODEC = DataclassCodec(Sample, "kvlens.test-sample", 3, shared=SHARED)


def _sample() -> Sample:
    g = torch.Generator().manual_seed(0)
    a, b = Tag("a"), Tag("b", 2)
    return Sample(
        flag=True, count=-7, ratio=0.1, whole=3, name="ünï", nothing=None, maybe=None,
        either=False, ints=(1, 2, 3), pair=(4, 2.5), empty=(), names=["x", "y"],
        by_name={"nan": float("nan"), "inf": float("-inf"), "one": 1.0},
        by_tuple={(1, "a"): [1], (2, "b"): []},
        by_tag={a: Point(1, 0.5), b: None, Tag("c"): Point(-1, 1e300)},
        pin=Pin(a, Point(0, 0.0)), pins=[Pin(a, Point(0, 0.0)), None, Pin(b, Point(1, 1.0))],
        box=Box([1, 2], "n"), no_box=None,
        tensors={"f32": torch.randn(2, 3, 4, 5, generator=g),
                 "bf16": torch.randn(3, 7, generator=g).bfloat16(),
                 "f16": torch.randn(5, generator=g).half(),
                 "f64": torch.tensor(2.5, dtype=torch.float64),  # 0-d
                 "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
                 "none": torch.zeros(0, 3)},
        array=np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        anything={"k": [1, (2.5, "s", None)], "arr": np.array([True, False]), "t": ()},
        loose=[1, "two", (3,), {"four": 4}])


def _parts(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The document and arrays of a file, read by numpy without pickle."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files if name != "document"}
        return json.loads(z["document"].tobytes()), arrays


def _file(doc, arrays: dict[str, np.ndarray], **members) -> bytes:
    """A file of ``doc`` and ``arrays`` (numpy's own writer: uncompressed)."""
    buf = io.BytesIO()
    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    np.savez(buf, document=np.frombuffer(text, np.uint8), **arrays, **members)
    return buf.getvalue()


def test_every_field_kind_reads_back_with_its_type():
    s = _sample()
    s.made.append("not written")
    back = CODEC.decode(CODEC.encode(s))
    assert back.made == []
    for f in dataclasses.fields(Sample):
        if f.name not in ("tensors", "array", "anything", "by_name", "made"):
            assert getattr(back, f.name) == getattr(s, f.name), f.name
    assert type(back.whole) is int and type(back.ratio) is float and back.either is False
    assert type(back.ints) is tuple and type(back.names) is list and back.empty == ()
    assert type(back.pin.at) is Point and type(back.by_tag[Tag("a")]) is Point
    assert list(back.by_tag) == list(s.by_tag)  # dict order kept
    assert np.isnan(back.by_name["nan"]) and back.by_name["inf"] == float("-inf")
    assert list(back.by_name) == ["nan", "inf", "one"]
    assert back.tensors.keys() == s.tensors.keys()
    for k, t in s.tensors.items():
        assert back.tensors[k].dtype == t.dtype and back.tensors[k].shape == t.shape, k
        assert torch.equal(back.tensors[k], t), k
    assert back.tensors["f64"].shape == ()
    assert back.array.dtype == np.int32 and np.array_equal(back.array, s.array)
    assert back.anything["k"] == [1, (2.5, "s", None)] and back.anything["t"] == ()
    assert type(back.anything["k"][1]) is tuple
    arr = back.anything["arr"]
    assert arr.dtype == np.bool_ and arr.tolist() == [True, False]
    assert back.loose == [1, "two", (3,), {"four": 4}]


def test_shared_values_are_written_once_and_referred_to_by_index():
    doc, arrays = _parts(CODEC.encode(_sample()))
    assert set(doc) == {"format", "version", "tags", "all_pins",
                        *(f.name for f in dataclasses.fields(Sample) if f.init)}
    assert doc["format"] == "kvlens.test-sample" and doc["version"] == 3
    # Tag("a") is a key, in two pins and in the pin field: written once
    assert doc["tags"] == [{"name": "a", "level": 0}, {"name": "b", "level": 2},
                           {"name": "c", "level": 0}]
    assert [k for k, _ in doc["by_tag"]] == [0, 1, 2]
    # equal pins once; a table's pin holds its tag in full
    assert doc["pin"] == 0 and doc["pins"] == [0, None, 1] and len(doc["all_pins"]) == 2
    assert doc["all_pins"][0] == {"tag": {"name": "a", "level": 0}, "at": {"x": 0, "y": 0.0}}
    assert doc["by_tuple"] == [[[1, "a"], [1]], [[2, "b"], []]]
    ref = dict(doc["tensors"])["bf16"]
    assert ref["dtype"] == "bfloat16" and arrays[f"a{ref['array']}"].dtype == np.int16
    assert all(a.dtype.kind in "biuf" for a in arrays.values())


# -- refused on writing ----------------------------------------------------------------------


@pytest.mark.parametrize("edit, where", [
    (lambda s: dataclasses.replace(s, count=True), "count"),  # a bool is no int
    (lambda s: dataclasses.replace(s, flag=1), "flag"),
    (lambda s: dataclasses.replace(s, ratio="0.1"), "ratio"),
    (lambda s: dataclasses.replace(s, nothing=0), "nothing"),
    (lambda s: dataclasses.replace(s, either=1), "either"),
    (lambda s: dataclasses.replace(s, ints=[1, 2]), "ints"),  # a list for a tuple
    (lambda s: dataclasses.replace(s, pair=(1, 2.0, 3)), "pair"),
    (lambda s: dataclasses.replace(s, names=["x", 1]), "names[1]"),
    (lambda s: dataclasses.replace(s, by_tuple={(1, 2): []}), "by_tuple[0].key[1]"),
    (lambda s: dataclasses.replace(s, box=Tag("x")), "box"),
    (lambda s: dataclasses.replace(s, pin=Pin(Tag("x"), (0, 0.0))), "all_pins[0].at"),
    (lambda s: dataclasses.replace(s, pin=Pin(Tag("x"), Point([0], 0.0))), "pin"),  # unhashable
    (lambda s: dataclasses.replace(s, tensors={"i": torch.zeros(2, dtype=torch.int64)}), "tensor"),
    (lambda s: dataclasses.replace(s, tensors={"n": np.zeros(2, np.float32)}), "tensor"),
    (lambda s: dataclasses.replace(s, array=np.array([object()])), "array"),
    (lambda s: dataclasses.replace(s, array=torch.zeros(2)), "array"),
    (lambda s: dataclasses.replace(s, anything={"s": {1, 2}}), "anything[0].value"),
    (lambda s: dataclasses.replace(s, anything={1: "int key"}), "anything"),
    (lambda s: dataclasses.replace(s, anything=_nested(MAX_DEPTH)), "nested"),
    (lambda s: Box([1]), "Sample"),
])
def test_a_value_its_annotation_does_not_allow_is_refused(edit, where):
    with pytest.raises(CodecError, match="cannot be written") as e:
        CODEC.encode(edit(_sample()))
    assert where in str(e.value)


def _nested(depth: int):
    x = 0
    for _ in range(depth):
        x = [x]
    return x


def test_nesting_up_to_the_limit_is_written():
    """``anything`` is one level down: a value in it nests one level less."""
    s = dataclasses.replace(_sample(), anything=_nested(MAX_DEPTH - 1))
    assert CODEC.decode(CODEC.encode(s)).anything == _nested(MAX_DEPTH - 1)


@dataclass
class _SetField:
    values: set[int]


@dataclass
class _RecordUnion:
    either: Tag | Box


@dataclass
class _PlainClass:
    thing: zipfile.ZipInfo


@dataclass
class _Unresolved:
    thing: NotImported  # noqa: F821


@dataclass
class _Clash:
    tags: int
    version: int


@pytest.mark.parametrize("codec, match", [
    (DataclassCodec(_SetField, "x", 1), "set"),
    (DataclassCodec(_RecordUnion, "x", 1), r"Tag \| \S*Box"),
    (DataclassCodec(_PlainClass, "x", 1), "ZipInfo"),
    (DataclassCodec(_Unresolved, "x", 1), "do not resolve"),
    (DataclassCodec(_Clash, "x", 1, shared={"tags": Tag}), r"\['tags', 'version'\] clash"),
    (DataclassCodec(Point, "x", 1, shared={"points": Point}), "not one of its shared"),
    (DataclassCodec(int, "x", 1), "dataclasses or NamedTuples"),
])
def test_an_annotation_the_codec_does_not_know_is_refused(codec, match):
    with pytest.raises(CodecError, match=match):
        codec.check()
    with pytest.raises(CodecError, match=match):
        codec.encode(None)
    with pytest.raises(CodecError, match=match):
        codec.decode(CODEC.encode(_sample()))


def test_the_codec_checks_every_annotation_up_front():
    CODEC.check()  # every kind above is known


# -- refused on reading ----------------------------------------------------------------------


def _edited(edit) -> bytes:
    doc, arrays = _parts(CODEC.encode(_sample()))
    out = edit(doc, arrays)
    return out if isinstance(out, bytes) else _file(doc, arrays)


def _set(path: str, value):
    """An edit that sets the document's value at ``path`` (keys and indices, ``/``-separated)."""
    def edit(doc, arrays):
        *parents, last = [int(p) if p.lstrip("-").isdigit() else p for p in path.split("/")]
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value
    return edit


def _tensor_ref(doc, name: str) -> dict:
    return dict(doc["tensors"])[name]


READ_REFUSALS = {
    # the container
    "a pickle": lambda d, a: pickle.dumps(_sample()),
    "empty": lambda d, a: b"",
    "truncated": lambda d, a: CODEC.encode(_sample())[:1000],
    "a zip of other members": lambda d, a: _file(d, a, extra=np.zeros(1)),
    "a zip without its document": lambda d, a: _zip({"a0.npy": b""}),
    "a zip with a member twice": lambda d, a: _zip({"document.npy": _npy(_doc_array(d))},
                                                  twice="document.npy"),
    "a compressed member": lambda d, a: _recompressed(_file(d, a)),
    "an object array": lambda d, a: _file(d, {**a, "a0": np.array([Tag("x")], dtype=object)}),
    "a Fortran-order array": lambda d, a: _zip({"document.npy": _npy(_doc_array(d)),
                                               **{f"{k}.npy": _npy(v) for k, v in a.items()},
                                               "a0.npy": _npy(np.zeros((2, 3), order="F"))}),
    "an array shorter than its header": lambda d, a: _zip(
        {"document.npy": _npy(_doc_array(d)), **{f"{k}.npy": _npy(v) for k, v in a.items()},
         "a0.npy": _npy(np.zeros(8))[:-8]}),
    "a document of floats": lambda d, a: _zip(
        {"document.npy": _npy(np.zeros(3)), **{f"{k}.npy": _npy(v) for k, v in a.items()}}),
    "a document that is no JSON": lambda d, a: _file(b"{not json", a),
    "a document that is no UTF-8": lambda d, a: _file(b"\xff\xfe", a),
    "a document that is a list": lambda d, a: _file([d], a),
    "a key twice in an object": lambda d, a: _file(
        json.dumps(d).replace('"flag": true', '"flag": true, "flag": false').encode(), a),
    # the header
    "another format": _set("format", "kvlens.other"),
    "another version": _set("version", 4),
    "a version that is a string": _set("version", "3"),
    "no shared table": lambda d, a: d.pop("tags") and None,
    # the fields
    "an unknown field": _set("code", "print(1)"),
    "a missing field": lambda d, a: d.pop("count") and None,
    "a bool for an int": _set("count", True),
    "an int for a bool": _set("flag", 1),
    "a float for an int": _set("count", 1.0),
    "a string for a float": _set("ratio", "0.1"),
    "a value for None": _set("nothing", 0),
    "a number for a str | bool": _set("either", 0),
    "a dict for a list": _set("names", {"x": 1}),
    "a tuple too long": _set("pair", [1, 2.0, 3]),
    "a tuple for ()": _set("empty", [1]),
    "a pair that is no pair": _set("by_name/0", ["nan"]),
    "a key twice in a dict": _set("by_name/1", ["nan", 1.0]),
    "a tuple key too short": _set("by_tuple/0/0", [1]),
    "an unknown field of a record": _set("tags/0/color", "red"),
    "a missing field of a record": lambda d, a: d["box"].pop("items") and None,
    "a wrong field type in a table": _set("tags/1/level", "2"),
    "a record for a shared reference": _set("pin", {"tag": 0, "at": {"x": 0, "y": 0.0}}),
    "a reference for a record in a table": _set("all_pins/0/tag", 0),
    "a NamedTuple's unknown field": _set("all_pins/0/at/z", 1),
    # the references
    "a shared index out of range": _set("by_tag/0/0", 3),
    "a negative shared index": _set("pins/0", -1),
    "a bool as a shared index": _set("pin", False),
    "an array index out of range": lambda d, a: _tensor_ref(d, "f32").update(array=10**6),
    "an array index that is a float": lambda d, a: _tensor_ref(d, "f32").update(array=0.0),
    "a tensor of an unknown dtype": lambda d, a: _tensor_ref(d, "f32").update(dtype="int64"),
    "a tensor declared of another dtype": lambda d, a: _tensor_ref(d, "f32").update(
        dtype="float16"),
    "a tensor declared of another shape": lambda d, a: _tensor_ref(d, "f32").update(shape=[120]),
    "a tensor reference with another key": lambda d, a: _tensor_ref(d, "f32").update(code=1),
    "a tensor that is a number": _set("tensors/0/1", 0),
    "an array declared of another dtype": lambda d, a: d["array"].update(dtype="<i8"),
    # self-describing values
    "an unknown tag": _set("anything", {"set": [1]}),
    "two tags": _set("anything", {"list": [], "tuple": []}),
    "a plain dict with a key that is no string": _set("anything", {"dict": [[1, 2]]}),
    "a plain dict with a key twice": _set("anything", {"dict": [["k", 1], ["k", 2]]}),
    "nested too deep": _set("anything", json.loads(
        '{"list": [' * MAX_DEPTH + "0" + "]}" * MAX_DEPTH)),
    "nested deeper than Python reads": lambda d, a: _file(b"[" * 10**5 + b"]" * 10**5, a),
}


def _doc_array(doc) -> np.ndarray:
    return np.frombuffer(json.dumps(doc).encode(), np.uint8)


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a, allow_pickle=False)
    return buf.getvalue()


def _zip(members: dict[str, bytes], twice: str | None = None) -> bytes:
    """A zip of ``members`` (``twice``: that member written again)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name
        for name, raw in [*members.items(), *([(twice, members[twice])] if twice else [])]:
            z.writestr(name, raw)
    return out.getvalue()


def _recompressed(data: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    return _zip_deflated({name: src.read(name) for name in src.namelist()})


def _zip_deflated(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, raw in members.items():
            z.writestr(name, raw)
    return out.getvalue()


def test_an_unedited_file_reads_back():
    """The refusals' edits start from a file that reads: the edit, not the rebuild, fails it."""
    back = CODEC.decode(_edited(lambda d, a: None))
    assert back.by_tuple == _sample().by_tuple


@pytest.mark.parametrize("damage", list(READ_REFUSALS))
def test_a_damaged_or_foreign_file_is_refused(damage):
    with pytest.raises(CodecError):
        CODEC.decode(_edited(READ_REFUSALS[damage]))


def test_a_pickle_is_refused_unread(tmp_path):
    """The zip magic is checked before anything is parsed: a planted pickle does not run."""
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Payload(marker))
    with pytest.raises(CodecError, match="no zip header"):
        CODEC.decode(payload)
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live
    assert marker.exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_random_damage_raises_codec_errors_only():
    """Byte flips anywhere in a file, and random values planted anywhere in its document: each
    reads back as written or raises CodecError, never another exception."""
    rng = random.Random(0)
    data = CODEC.encode(_sample())
    refused = 0
    for _ in range(150):
        bad = bytearray(data)
        for i in rng.sample(range(len(bad)), 3):
            bad[i] ^= 1 << rng.randrange(8)
        refused += _reads_or_refuses(bytes(bad))
    doc, arrays = _parts(data)
    plants = [None, True, -1, 0, 2**70, 1.5, float("nan"), "x", [], [0], [[0, 1]], {},
              {"list": []}, {"array": 0, "dtype": "float32", "shape": [1]}]
    for _ in range(300):
        bad = json.loads(json.dumps(doc))
        _plant(bad, rng.choice(plants), rng)
        refused += _reads_or_refuses(_file(bad, arrays))
    assert refused > 300  # the damage was mostly caught, not mostly harmless


def _reads_or_refuses(data: bytes) -> int:
    try:
        CODEC.decode(data)
    except CodecError:
        return 1
    return 0


def _plant(node, value, rng: random.Random) -> None:
    """Replace one value somewhere in ``node`` (a random walk down) with ``value``."""
    while True:
        keys = list(node) if type(node) is dict else list(range(len(node)))
        if not keys:
            return
        k = rng.choice(keys)
        child = node[k]
        if type(child) not in (dict, list) or not child or rng.random() < 0.3:
            node[k] = value
            return
        node = child
