"""`kvlens report`: the commands' JSON artifacts, the page built from them, missing parts and bad
input, and the page opened in a real headless Chromium.

The run folder is made by the real pipeline on a tiny random Llama (capture, plot-outliers as
SVG, compare-axes, recommend --validate, generate --eval kld --report-json), once per module.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import pytest
import torch
from browser import Browser
from helpers import make_capture
from PIL import Image
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.report.artifacts import ARTIFACT_KINDS, find_artifacts
from kvlens.report.sections import _channel_table, _verdict

runner = CliRunner()
TABLE_IDS = ("answer-table", "model-table", "channels-k_pre", "axes-table", "disagree-table", "recommend-table",
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
         f"{run / 'recommended.json'},{other / 'small.json'},vllm:fp8_e4m3", "--eval", "kld",
         "--eval-tokens", 96, "--report-json", run / "eval.generate.json",
         "--frontier", run / "frontier.png"])
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
    assert [r["name"] for r in gen["results"]] == ["recommended", "small", "vllm:fp8_e4m3"]
    points = gen["frontier"]["points"]
    assert [(q["name"], q["kind"]) for q in points] == [
        ("recommended", "config"), ("small", "config"), ("vllm:fp8_e4m3", "engine")]
    assert [q["bits"] for q in points] == [r["bits_per_element"] for r in gen["results"]]
    assert gen["frontier"]["front"] == [q["name"] for q in sorted(
        (q for q in points if q["on_front"]), key=lambda q: (q["bits"], q["mean_kld"]))]
    assert (run_dir / "frontier.png").read_bytes()[:4] == b"\x89PNG"


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
    n_png = len(found["compare-axes"][0][1]["figures"]) + 1  # + the frontier, re-drawn
    assert html.count("<img ") == html.count('<img src="data:image/png;base64,') == n_png
    assert html.count("<svg") >= n_svg
    # recommend records its deploy entry (target kvlens: the config to run)
    assert 'id="deploy-table"' in html and "kvlens generate --config " in html
    assert "missing Recommendation: deploy settings" not in res.output
    # the answer first: the recommendation, its KLD, the engine beside it, the frontier
    assert html.index('id="answer"') < html.index('id="model"') < html.index('id="validation"')
    answer = html[html.index('id="answer"'):html.index('id="model"')]
    for part in ('id="answer-lead"', 'id="answer-table"', 'id="answer-deploy"',
                 "vllm:fp8_e4m3", "vllm serve", "Pareto front", "data:image/png;base64,"):
        assert part in answer, part


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
    # --max-kld measured its choice (no --validate): that figure, labelled
    write_artifact("deploy", {"target": "vllm", "bits_per_element": 8.0, "predicted_kld": 0.0052,
                              "measured_kld": 0.0061, "measured_kld_ci95": [0.0049, 0.0075],
                              "config_file": "v.json",
                              "deploy": {"target": "vllm", "command": "vllm serve MODEL"}},
                   config_doc_path(copy / "v.json", "deploy"))
    _ok(["report", copy, "-o", tmp_path / "f.html", "--overwrite"])
    html = (tmp_path / "f.html").read_text()
    assert "measured KLD (--max-kld): 0.0061 [0.0049, 0.0075]" in html
    assert "predicted KLD: 0.0052" in html


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
    for kind in ("capture", "recommend", "deploy", "generate"):  # each X.<kind>.json too
        other = tmp_path / f"broken-{kind}"
        other.mkdir()
        (other / f"kv.{kind}.json").write_text('{"kvlens_report": "')
        res = runner.invoke(app, ["report", str(other)])
        assert res.exit_code == 1 and f"kv.{kind}.json looks like a kvlens" in res.output, kind
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


# -- the page's size ------------------------------------------------------------------------------

# The issue's limit for the page of `make demo`'s run (SmolLM2-135M: 30 layers, 9 query and 3 KV
# heads, head_dim 64): 1.5 MB, so that it can be mailed. Its figures are the bulk of it.
MAX_PAGE_BYTES = 1_500_000


@pytest.fixture(scope="module")
def demo_sized(run_dir, tmp_path_factory):
    """A run folder with the demo's figure set at the demo's pixel sizes: plot-outliers and
    compare-axes (PNG, their default) on a synthetic capture of SmolLM2-135M's shape, beside the
    tiny run's recommend, deploy, generate and capture artifacts. Uncompressed, these figures
    would make a page of over 3 MB; `make demo`'s real ones one of about 4.9 MB."""
    d = tmp_path_factory.mktemp("demo-sized")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 512, 64, generator=g)
    k = torch.randn(1, 3, 512, 64, generator=g)
    k[..., 3] += 20.0  # an outlier channel, as real keys have
    v = torch.randn(1, 3, 512, 64, generator=g)
    layers = {i: {"k": k * (1 + i / 10), "k_pre": k * (1 + i / 10)} for i in range(30)}
    make_capture(d / "run.h5", q, k, v, rope_theta=10000.0, layers=30, per_layer=layers)
    _ok(["plot-outliers", d / "run.h5", "--out", d / "outliers"])
    _ok(["compare-axes", d / "run.h5", "--plots", d / "compare"])
    for name in ("run.capture.json", "recommended.recommend.json", "recommended.json",
                 "vllm.deploy.json", "eval.generate.json"):
        shutil.copy(run_dir / name, d)
    return d


@pytest.mark.slow
def test_the_page_of_a_demo_sized_run_stays_small(demo_sized, tmp_path):
    out = tmp_path / "report.html"
    _ok(["report", demo_sized, "-o", out])
    html = out.read_text()
    found = find_artifacts(demo_sized)
    shown = len(found["outliers"][0][1]["figures"]) + len(found["compare-axes"][0][1]["figures"])
    pngs = re.findall(r'<img src="data:image/png;base64,([^"]+)"', html)
    assert len(pngs) == shown + 1  # every figure, and the frontier
    for data in pngs:  # each at most as wide as the page shows it, a palette PNG
        with Image.open(io.BytesIO(base64.b64decode(data))) as im:
            assert im.width <= 1040 and im.mode == "P", (im.width, im.mode)
    assert len(out.read_bytes()) <= MAX_PAGE_BYTES


def test_figures_are_embedded_at_the_width_shown(tmp_path):
    from matplotlib.figure import Figure

    from kvlens.report.figures import SHOWN_WIDTH, compact_png, load_figure

    fig = Figure(figsize=(16.8, 3.6))  # as wide as compare-axes' line figures
    ax = fig.subplots()
    for i in range(4):
        ax.plot(torch.randn(30, generator=torch.Generator().manual_seed(i)).cumsum(0))
    fig.savefig(tmp_path / "wide.png", dpi=100)
    raw = (tmp_path / "wide.png").read_bytes()
    small = compact_png(raw)
    with Image.open(io.BytesIO(small)) as im:
        assert (im.width, im.mode) == (SHOWN_WIDTH, "P")
        assert im.height == round(360 * SHOWN_WIDTH / 1680)
    assert len(small) < len(raw) / 2
    shown = load_figure(tmp_path, "wide.png", "caption")
    assert shown.src == "data:image/png;base64," + base64.b64encode(small).decode("ascii")
    (tmp_path / "broken.png").write_bytes(raw[:100])  # the signature, then nothing decodable
    assert "cannot be decoded" in load_figure(tmp_path, "broken.png", "c").problem


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
        # the answer fits the page at the page's widest (text columns wrap, no sideways scroll)
        b.evaluate("document.body.style.width = '1100px'")
        wide = b.evaluate("[document.getElementById('answer-table').scrollWidth, "
                          "document.getElementById('answer-table').parentElement.clientWidth]")
        assert wide[0] <= wide[1], wide
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


# -- the answer (section 1), from synthetic artifacts ------------------------------------------

def _res(name, bits, kld, ref=None, diff=None):
    stat = {"value": kld, "ci95": [kld * 0.9, kld * 1.1]}
    vs = None if ref is None else {"reference": ref, "mean_kld": {
        "diff": diff, "ci95": [diff - 0.001, diff + 0.001], "distinguishable": True}}
    return {"name": name, "bits_per_element": bits,
            "kld": {"mean_kld": stat, "ppl_change": {"value": 0.01, "ci95": [0.0, 0.02]},
                    "top1_agreement": {"value": 0.9, "ci95": [0.85, 0.95]}, "vs_first": vs}}


PROTO = {"tokens": 2048, "text_source": "builtin:heldout"}


def _rec_doc(kv_bytes, fp16):
    return {"config": {"name": "rec"}, "config_file": "rec.json", "mean_bits": 3.0,
            "context": 4096, "budget_bits": 3.0, "kv_bytes": kv_bytes, "kv_bytes_fp16": fp16,
            "validation": [_res("rec", 3.4, 0.05)], "validation_evaluation": {"kld": PROTO},
            "deploy": {"target": "kvlens", "command": "kvlens generate --config rec.json"}}


def _answer(tmp_path, **kinds):
    from kvlens.report.answer import answer_section

    arts = {kind: [(tmp_path / f"{kind}{i}.json", doc) for i, doc in enumerate(docs)]
            for kind, docs in kinds.items()}
    return answer_section(arts, tmp_path, str(tmp_path / "run.h5"))


def test_answer_sets_the_recommendation_against_kivi2_and_the_best_engine(tmp_path):
    mib = 2**20
    gen = {"results": [_res("rec", 3.5, 0.04), _res("kivi-2", 3.6, 0.09, "rec", 0.05),
                       _res("llamacpp:q8_0/q4_0", 6.5, 0.02, "rec", -0.02),
                       _res("vllm:fp8_e4m3", 8.0, 0.01, "rec", -0.03)],
           "evaluation": {"kld": {**PROTO, "tokens": 1024}},
           "frontier": {"points": [{"name": "rec", "kind": "config", "bits": 3.5,
                                    "mean_kld": 0.04, "ci95": [0.03, 0.05], "on_front": True}],
                        "front": ["rec"]}}
    deploy = {"target": "vllm", "setting": "vllm:fp8_e4m3", "bits_per_element": 8.0,
              "deploy": {"target": "vllm", "command": "vllm serve M --kv-cache-dtype fp8_e4m3"}}
    sec = _answer(tmp_path, recommend=[_rec_doc({"4096": mib, "32768": 8 * mib},
                                                {"4096": 4 * mib, "32768": 32 * mib})],
                  generate=[gen], deploy=[deploy])
    assert sec.lead.startswith("Use rec.json") and "3.00 bits per element at 4,096 tokens" in \
        sec.lead
    # the recommendation's scores come from the run that scored kivi-2 and engines beside it
    assert "over 1024 tokens" in sec.lead and "0.0400 [0.0360, 0.0440]" in sec.lead
    table = next(t for t in sec.tables if t.id == "answer-table")
    assert [r[0] for r in table.rows] == ["rec", "kivi-2", "vllm:fp8_e4m3"]
    assert table.rows[1][6].startswith("+0.0500") and table.rows[2][6].startswith("-0.0300")
    assert all(r[7].startswith("generate0.json") for r in table.rows)
    memory = next(p for p in sec.paragraphs if p.startswith("Memory"))
    assert "4,096 tokens: 1.0 MiB instead of 4.0 MiB, 3.0 MiB saved (75%)" in memory
    assert "32,768 tokens: 8.0 MiB instead of 32.0 MiB, 24.0 MiB saved (75%)" in memory
    assert "131,072 tokens not recorded" in memory  # what is there is shown, and said so
    deploy_rows = next(t for t in sec.tables if t.id == "answer-deploy").rows
    assert [r[0] for r in deploy_rows] == ["kvlens", "vllm"]
    assert "fp8_e4m3" in deploy_rows[1][1]
    assert sec.figures and sec.figures[0].src.startswith("data:image/png;base64,")
    assert "Pareto front" in sec.figures[0].caption and not sec.missing


def test_answer_without_engines_or_frontier_says_what_to_run(tmp_path):
    sec = _answer(tmp_path, recommend=[_rec_doc({"1024": 10, "4096": 40},
                                                {"1024": 100, "4096": 400})])
    assert "over 2048 tokens" in sec.lead  # recommend's own validation
    assert "No engine setting was measured" in " ".join(sec.paragraphs)
    assert "kivi-2 was not scored in this run." in sec.paragraphs
    memory = next(p for p in sec.paragraphs if p.startswith("Memory"))
    assert "1,024 tokens" in memory and "32,768, 131,072 tokens not recorded" in memory
    assert [m.command.split()[:2] for m in sec.missing] == [["kvlens", "generate"]]
    assert "--frontier" in sec.missing[0].command and "rec.json,kivi-2" in sec.missing[0].command


def test_answer_with_nothing_to_conclude_names_the_commands(tmp_path):
    sec = _answer(tmp_path, capture=[{"capture_file": "run.h5"}])
    assert sec.lead.startswith("Nothing to conclude yet")
    commands = [m.command for m in sec.missing]
    assert commands[0].startswith("kvlens recommend") and "--validate" in commands[0]
    assert commands[1].startswith("kvlens generate") and "--frontier" in commands[1]
    assert not sec.tables and not sec.figures
