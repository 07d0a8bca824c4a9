"""The bits-vs-KLD frontier (``kvlens.evaluation.frontier``) on synthetic points with a known
Pareto front, and its chart (``kvlens.plots.frontier``)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from kvlens.evaluation.frontier import (
    FrontierPoint,
    frontier_doc,
    pareto_front,
    points_from_results,
    setting_kind,
)


def _p(name, bits, kld, kind="preset"):
    return FrontierPoint(name, kind, bits, kld, (kld * 0.8, kld * 1.2))


def _names(points):
    return [p.name for p in pareto_front(points)]


def test_front_of_a_staircase_with_dominated_points():
    points = [_p("b", 4.0, 0.01), _p("a", 2.0, 0.2), _p("c", 8.0, 0.001),
              _p("worse-than-b", 5.0, 0.02),  # more bits and more KLD than b
              _p("worse-than-a", 3.0, 0.3),  # more bits and more KLD than a
              _p("fp16", 16.0, 0.0)]
    assert _names(points) == ["a", "b", "c", "fp16"]  # in order of bits


def test_ties():
    # equal bits: only the lower KLD; equal KLD: only the fewer bits
    assert _names([_p("lo", 4.0, 0.01), _p("hi", 4.0, 0.05)]) == ["lo"]
    assert _names([_p("few", 3.0, 0.01), _p("many", 6.0, 0.01)]) == ["few"]
    # exact duplicates dominate neither the other: both stay (sorted by name)
    assert _names([_p("y", 4.0, 0.01), _p("x", 4.0, 0.01), _p("z", 5.0, 0.02)]) == ["x", "y"]


def test_one_point_and_none():
    assert _names([_p("only", 3.0, 0.1)]) == ["only"]
    assert pareto_front([]) == []


def test_doc_keeps_the_order_given_and_marks_the_front():
    doc = frontier_doc([_p("b", 4.0, 0.01, "engine"), _p("d", 5.0, 0.02, "config"),
                        _p("a", 2.0, 0.2, "baseline")])
    assert [q["name"] for q in doc["points"]] == ["b", "d", "a"]
    assert [q["on_front"] for q in doc["points"]] == [True, False, True]
    assert doc["front"] == ["a", "b"]
    assert doc["points"][0] == {"name": "b", "kind": "engine", "bits": 4.0, "mean_kld": 0.01,
                                "ci95": [0.008, 0.012], "on_front": True}


def test_points_from_results_skip_unscored_configs():
    results = [{"name": "kivi-2", "bits_per_element": 3.5,
                "kld": {"mean_kld": {"value": 0.1, "ci95": [0.09, 0.11]}}},
               {"name": "unfinished"},  # Ctrl-C before its kld
               {"name": "no-bits", "kld": {"mean_kld": {"value": 0.2, "ci95": [0.1, 0.3]}}}]
    points = points_from_results(results, ["preset", "config", "engine"])
    assert points == [FrontierPoint("kivi-2", "preset", 3.5, 0.1, (0.09, 0.11))]


def test_partial_llamacpp_points_are_flagged_and_drawn_hollow(tmp_path):
    from kvlens.plots.frontier import frontier_figure

    q = FrontierPoint("llamacpp:q8_0/q4_0", "engine", 6.5, 0.0045, (0.004, 0.005), partial=True)
    doc = frontier_doc([q, _p("kivi-2", 3.5, 0.1)])
    assert doc["points"][0]["partial"] is True and "partial" not in doc["points"][1]
    ax = frontier_figure(doc).axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert "llamacpp:q8_0/q4_0 (cache only)" in labels and "kivi-2" in labels
    faces = {ln.get_marker(): ln.get_markerfacecolor() for ln in ax.lines if ln.get_marker()
             in ("s", "o")}
    assert faces["s"] == "none" and faces["o"] != "none"
    assert any("cache only" in t.get_text() for t in ax.get_legend().get_texts())


@pytest.mark.parametrize("item, kind", [
    ("kivi-2", "preset"), ("fp16", "preset"), ("llamacpp:q8_0/q4_0", "engine"),
    ("vllm:fp8_e4m3", "engine"), ("hf-quanto-4", "baseline"), ("out/recommended.json", "config"),
])
def test_setting_kind(item, kind):
    assert setting_kind(item) == kind


def test_chart_png_and_svg(tmp_path):
    from kvlens.plots.frontier import frontier_png, write_frontier

    doc = frontier_doc([_p("kivi-2", 3.5, 0.1), _p("exact", 32.0, 0.0),
                        _p("q8", 8.5, 0.001, "engine"), _p("rec", 3.0, 0.05, "config"),
                        _p("hf", 4.5, 0.2, "baseline")])
    png = write_frontier(doc, tmp_path / "f.png", "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = write_frontier(doc, tmp_path / "f.svg").read_text()
    assert "<svg" in svg
    data = frontier_png(doc, width_px=640)
    assert Image.open(io.BytesIO(data)).size[0] == 640
    with pytest.raises(ValueError, match="allowed formats"):
        write_frontier(doc, tmp_path / "f.pdf")
