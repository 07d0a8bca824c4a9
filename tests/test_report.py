"""`kvlens report`: the commands' JSON artifacts, the page built from them, missing parts and bad
input, and the page opened in a real headless Chromium.

The run folder is made by the real pipeline on a tiny random Llama (capture, plot-outliers as
SVG, compare-axes, recommend --validate, generate --eval kld --report-json), once per module.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from browser import Browser
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.report.artifacts import ARTIFACT_KINDS, find_artifacts
from kvlens.report.sections import _channel_table, _verdict

runner = CliRunner()
TABLE_IDS = ("model-table", "channels-k_pre", "axes-table", "disagree-table", "recommend-table",
             "memory-table", "kld-table-0", "kld-table-1")


def _ok(args):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("report")
    run, other = base / "run", base / "other"
    run.mkdir()
    other.mkdir()
    text = base / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80, encoding="utf-8")
    cap = run / "run.h5"
    _ok(["capture", "--model", tiny_model_dir, "--text", text, "-s", 2, "-t", 64, "-o", cap])
    _ok(["plot-outliers", cap, "--out", run / "outliers", "--format", "svg",
         "--threshold", "2"])
    _ok(["compare-axes", cap, "--plots", run / "compare", "--group-sizes", "16"])
    rec = ["recommend", cap, "--context", "512", "--windows", "16", "--set", "group-sizes=16",
           "--model", tiny_model_dir, "--set", "retrieval=off"]
    _ok([*rec, "-b", "6", "-o", run / "recommended.json", "--validate", "--eval-tokens", 96])
    _ok([*rec, "-b", "5", "-o", other / "small.json", "--name", "small"])
    _ok(["recommend", cap, "--target", "vllm", "--budget-bits", "9", "-o", run / "vllm.json"])
    _ok(["generate", "--model", tiny_model_dir, "--compare",
         f"{run / 'recommended.json'},{other / 'small.json'}", "--eval", "kld",
         "--eval-tokens", 96, "--report-json", run / "eval.generate.json"])
    return run


def test_each_command_leaves_its_artifact(run_dir):
    found = find_artifacts(run_dir)
    assert sorted(found) == sorted(ARTIFACT_KINDS)
    assert found["deploy"][0][1]["deploy"]["command"].startswith("vllm serve")
    cap = found["capture"][0][1]
    assert (cap["num_attention_heads"], cap["num_key_value_heads"], cap["head_dim"]) == (4, 2, 16)
    assert (cap["samples"], cap["tokens"], cap["capture_file"]) == (2, 64, "run.h5")
    assert cap["versions"]["torch"] and cap["versions"]["transformers"]
    for kind in ("outliers", "compare-axes"):
        path, doc = found[kind][0]
        assert doc["figures"], kind
        assert all((path.parent / f).is_file() for f in doc["figures"])
    cmp = found["compare-axes"][0][1]
    # 2 bits x (K: 4 metrics, V: 2 metrics) x 2 axes x 3 layers
    assert len(cmp["layer_means"]) == 2 * (4 + 2) * 2 * 3
    rec = found["recommend"][0][1]
    assert rec["config_file"] == "recommended.json" and rec["validation"]
    gen = found["generate"][0][1]
    assert [r["name"] for r in gen["results"]] == ["recommended", "small"]


def test_report_has_every_section_and_embeds_every_figure(run_dir, tmp_path):
    out = tmp_path / "report.html"
    res = _ok(["report", run_dir, "-o", out])
    assert res.stdout.strip() == str(out.resolve())
    html = out.read_text()
    for tid in (*TABLE_IDS, "verdict"):
        assert f'id="{tid}"' in html, tid
    # self-contained: no scripts, stylesheets, or anything fetched from elsewhere
    assert "<script" not in html and "<link" not in html
    assert not re.findall(r'(?:src|href)="(?!data:|#)', html)
    found = find_artifacts(run_dir)
    n_svg = len(found["outliers"][0][1]["figures"])
    n_png = len(found["compare-axes"][0][1]["figures"])
    assert html.count("<img ") == html.count('<img src="data:image/png;base64,') == n_png
    assert html.count("<svg") >= n_svg
    # recommend records its deploy entry (target kvlens: the config to run)
    assert 'id="deploy-table"' in html and "kvlens generate --config " in html
    assert "missing Recommendation: deploy settings" not in res.output


def test_verdict_compares_the_configs_that_were_scored(run_dir, tmp_path):
    out = tmp_path / "r.html"
    _ok(["report", run_dir, "-o", out])
    verdict = re.search(r'id="verdict">([^<]*)<', out.read_text()).group(1)
    gen = find_artifacts(run_dir)["generate"][0][1]
    small = next(r for r in gen["results"] if r["name"] == "small")["kld"]["vs_first"]
    word = ("not distinguishable from" if not small["mean_kld"]["distinguishable"] else
            "lower than" if small["mean_kld"]["diff"] > 0 else "higher than")
    assert verdict.startswith("At ") and "recommended" in verdict
    assert f"{word} small" in verdict


def _scored(name, bits, value, diff=None, distinguishable=True):
    k = {"mean_kld": {"value": value, "ci95": [value * 0.9, value * 1.1]}, "vs_first": None}
    if diff is not None:
        k["vs_first"] = {"reference": "rec", "mean_kld": {
            "diff": diff, "ci95": [diff - 0.01, diff + 0.01], "distinguishable": distinguishable}}
    return {"name": name, "bits_per_element": bits, "kld": k}


def test_verdict_sentence_groups_by_paired_difference():
    text = _verdict([_scored("rec", 3.0, 0.16), _scored("kivi-2", 3.5, 0.2, 0.04),
                     _scored("kivi-4", 5.5, 0.004, -0.156),
                     _scored("per-token-4", 5.0, 0.17, 0.01, False)])
    assert text.startswith("At 3.00 bits per element held over the scored tokens, rec's mean KL")
    assert "lower than kivi-2 (3.50 bits)" in text
    assert "higher than kivi-4 (5.50 bits)" in text
    assert "not distinguishable from per-token-4 (5.00 bits)" in text
    assert _verdict([]) == ""


def test_stable_channel_table_aggregates_heads():
    def head(layer, kv, channel, tok, smp, share=(0.1, 0.2)):
        return {"layer": layer, "tensor": "k_pre", "head": kv, "max_ratio": 6.0,
                "outliers": [{"channel": channel, "ratio": 6.0, "token_stability": tok,
                              "sample_stability": smp}] if channel is not None else [],
                "rope": [{"channel": channel, "partner": channel + 32,
                          "partner_share_pre": share[0], "partner_share_post": share[1],
                          "token_stability_post": tok, "outlier_post": True}]
                if channel is not None else []}

    heads = [head(0, 0, 23, 1.0, 1.0), head(1, 0, 23, 0.95, 1.0), head(1, 1, 5, 0.3, 0.5),
             head(2, 0, 5, 0.99, 1.0), head(2, 1, None, 0, 0)]
    table = _channel_table(heads, "k_pre", "keys", 4.0)
    assert [r[0] for r in table.rows] == ["23", "5"]  # twice stable before once stable
    assert table.rows[0][1:3] == ["2 / 5", "2"] and table.rows[1][1:3] == ["2 / 5", "1"]
    assert table.rows[0][5] == "0:0, 1:0" and table.rows[0][6] == "55"
    assert table.rows[0][7] == "0.10 -> 0.20"
    assert _channel_table(heads, "v", "values", 4.0) is None
    assert "No values channel" in _channel_table(
        [head(0, 0, None, 0, 0) | {"tensor": "v"}], "v", "values", 4.0).caption


def test_missing_parts_name_the_commands_that_write_them(run_dir, tmp_path):
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(run_dir / "run.capture.json", part)
    shutil.copytree(run_dir / "outliers", part / "outliers")
    res = _ok(["report", part])  # default output: RUN_DIR/report.html
    html = (part / "report.html").read_text()
    for cmd in ("kvlens compare-axes", "kvlens recommend"):
        assert cmd in html and cmd in res.output
    assert 'id="missing-summary"' in html and 'id="channels-k_pre"' in html
    assert 'id="axes-table"' not in html and 'id="verdict"' not in html


def test_deploy_settings_render_when_recommend_recorded_them(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    doc_path = copy / "recommended.recommend.json"
    doc = json.loads(doc_path.read_text())
    doc["deploy"] = {"target": "llama.cpp", "command": "llama-server -ctk q8_0 -ctv q4_0",
                     "note": "head_dim 16"}
    doc_path.write_text(json.dumps(doc))
    _ok(["report", copy, "-o", tmp_path / "d.html"])
    html = (tmp_path / "d.html").read_text()
    assert 'id="deploy-table"' in html and "llama-server -ctk q8_0 -ctv q4_0" in html
    assert "note: head_dim 16" in html and "deploy settings for an inference engine" not in html


def test_engine_deploy_artifact_renders(run_dir, tmp_path):
    """``recommend --target ENGINE -o X.json`` writes X.deploy.json; its setting, bits,
    predicted and measured KLD land in the deploy table."""
    from kvlens.report.artifacts import config_doc_path, write_artifact

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    write_artifact("deploy", {"target": "llama.cpp", "bits_per_element": 6.5,
                              "predicted_kld": 0.0081, "config_file": "eng.json",
                              "deploy": {"target": "llama.cpp",
                                         "command": "llama-server -ctk q8_0 -ctv q4_0 -fa on"},
                              "validation": {"mean_kld": 0.0093, "ci95": [0.0081, 0.0107]}},
                   config_doc_path(copy / "eng.json", "deploy"))
    _ok(["report", copy, "-o", tmp_path / "e.html"])
    html = (tmp_path / "e.html").read_text()
    assert 'id="deploy-table"' in html and "llama-server -ctk q8_0 -ctv q4_0 -fa on" in html
    assert "predicted KLD: 0.0081" in html and "0.0093 [0.0081, 0.0107]" in html
    # the kvlens recommendation's own deploy entry is still there, first
    assert html.index("kvlens generate --config ") < html.index("llama-server -ctk")


@pytest.mark.parametrize("content, message", [
    (None, "holds no kvlens results"),
    ('{"name": "a config, not a kvlens artifact"}', "holds no kvlens results"),
])
def test_a_folder_without_kvlens_outputs_is_an_error(tmp_path, content, message):
    if content is not None:
        (tmp_path / "other.json").write_text(content)
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 1 and message in res.output
    assert "kvlens capture" in res.output  # says how to fix it
    assert not (tmp_path / "report.html").exists()


def test_bad_paths_and_broken_artifacts_are_clear_errors(run_dir, tmp_path):
    res = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "is not a folder" in res.output
    res = runner.invoke(app, ["report", str(run_dir), "-o", str(tmp_path / "no" / "r.html")])
    assert res.exit_code == 1 and "does not exist" in res.output
    # generate checks --report-json before loading any model
    res = runner.invoke(app, ["generate", "--preset", "kivi-2", "--eval", "kld",
                              "--report-json", str(tmp_path / "no" / "e.json")])
    assert res.exit_code == 1 and "--report-json" in res.output and "does not exist" in res.output
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "outliers", broken / "outliers")
    (broken / "outliers" / "outliers.json").write_text('{"kvlens_report": "outl')
    res = runner.invoke(app, ["report", str(broken)])
    assert res.exit_code == 1 and "outliers.json looks like a kvlens artifact" in res.output
    (broken / "outliers" / "outliers.json").write_text(
        '{"kvlens_report": "outliers", "schema_version": 99}')
    res = runner.invoke(app, ["report", str(broken)])
    assert res.exit_code == 1 and "schema version 99" in res.output


def test_a_missing_figure_is_named_not_fatal(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    gone = json.loads((copy / "compare" / "compare-axes.json").read_text())["figures"][0]
    (copy / "compare" / gone).unlink()
    _ok(["report", copy, "-o", tmp_path / "m.html"])
    html = (tmp_path / "m.html").read_text()
    assert f"Figure <code>{gone}</code> not shown: file" in html


# -- in a real browser ------------------------------------------------------------------------

def test_report_in_headless_chromium(run_dir, chromium, tmp_path):
    out = tmp_path / "report.html"
    _ok(["report", run_dir, "-o", out])
    with Browser(chromium) as b:
        b.open(out)
        assert b.problems() == []  # no console errors, exceptions or network requests
        images = b.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
        assert images and all(done and width > 0 for done, width in images), images
        svgs = b.evaluate("Array.from(document.querySelectorAll('.plot > svg')).map("
                          "s => s.getBoundingClientRect().width || s.width.baseVal.value)")
        assert len(svgs) == len(find_artifacts(run_dir)["outliers"][0][1]["figures"])
        assert all(w > 0 for w in svgs), svgs
        rows = b.evaluate("Object.fromEntries(" + json.dumps(list(TABLE_IDS)) + ".map(id => "
                          "[id, document.querySelectorAll('#' + CSS.escape(id) + ' tbody tr')"
                          ".length]))")
        # the tiny random model may have no key outliers: then the table says so
        assert rows.pop("channels-k_pre") > 0 or "No keys" in b.evaluate(
            "document.querySelector('#channels-k_pre caption').innerText")
        assert all(n > 0 for n in rows.values()), rows
        assert rows["recommend-table"] == 3  # one row per layer of the tiny model
        prose = b.evaluate("Array.from(document.querySelectorAll('caption, figcaption, p, li, "
                           "td')).map(e => e.innerText).join('\\n')")
        assert "{" not in prose and "None" not in prose  # no unfilled or unset values
        verdict = b.evaluate("document.getElementById('verdict').innerText")
        assert "mean KL divergence" in verdict
        light = b.screenshot(tmp_path / "report-light.png")
        assert light.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and light.stat().st_size > 10_000

        def colours():
            return b.evaluate("[getComputedStyle(document.documentElement).backgroundColor, "
                              "getComputedStyle(document.querySelector('.plot'))"
                              ".backgroundColor]")

        page_light, plot_light = colours()
        b.prefer_dark(True)
        page_dark, plot_dark = colours()
        assert _luma(page_light) > 200 and _luma(page_dark) < 50
        assert plot_light == plot_dark == "rgb(255, 255, 255)"  # figures keep their white panel
        b.screenshot(tmp_path / "report-dark.png")
        assert b.problems() == []


def _luma(css: str) -> float:
    r, g, b = (int(x) for x in re.findall(r"\d+", css)[:3])
    return 0.299 * r + 0.587 * g + 0.114 * b
