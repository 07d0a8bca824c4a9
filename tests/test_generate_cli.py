"""``kvlens generate`` through the Typer runner: options, --json shape, bad input."""

from __future__ import annotations

import json
import math
import re

import pytest
from typer.testing import CliRunner

from kvlens.cli import app

runner = CliRunner()


def test_generate_json_compare(patched_model, tmp_path):
    from kvlens.config import preset, save_config

    path = tmp_path / "cfg.json"
    save_config(preset("kivi-4"), path)
    result = runner.invoke(app, ["generate", "--config", str(path), "--compare", "fp16,kivi-2",
                                 "--prompt", "Hello, my name is", "--max-new-tokens", "4",
                                 "--eval", "agreement,passkey", "--passkey-prompts", "1",
                                 "--passkey-context", "150", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    names = [r["name"] for r in doc["results"]]
    assert names == ["kivi-4", "fp16", "kivi-2"]
    for r in doc["results"]:
        assert isinstance(r["text"], str) and r["kv_bytes"] > 0 and r["kv_bytes_fp16"] > 0
        assert r["agreement"]["total"] == 4
        assert set(r["passkey"]) == {"correct", "total", "context_tokens"}
    fp16, kivi2 = doc["results"][1], doc["results"][2]
    assert fp16["agreement"]["matching"] == 4 and fp16["agreement"]["first_divergence"] is None
    assert kivi2["bits_per_element"] < fp16["bits_per_element"]


def test_generate_table_with_ppl(patched_model):
    result = runner.invoke(app, ["generate", "--preset", "kivi-4", "--eval", "ppl",
                                 "--ppl-tokens", "48"])
    assert result.exit_code == 0, result.output
    assert "kivi-4" in result.stdout and "ppl change" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--preset", "kivi-3", "--prompt", "x"], "Unknown preset 'kivi-3'"),
    (["--prompt", "x"], "Choose a cache"),
    (["--preset", "kivi-2"], "Nothing to do"),
    (["--preset", "kivi-2", "--eval", "bleu"], "allowed: ppl, passkey, agreement"),
    (["--preset", "kivi-2", "--config", "x.json", "--prompt", "x"], "not both"),
    (["--compare", "fp16,nope", "--prompt", "x"], "allowed presets"),
    (["--compare", "fp16,kivi-2", "--eval", "kld", "--frontier", "f.pdf"], "PNG or SVG"),
])
def test_generate_bad_options(args, message):
    result = runner.invoke(app, ["generate", *args])
    assert result.exit_code == 1
    assert message in result.output


def test_generate_request_checks_what_needs_no_model(tmp_path):
    """kvlens.deploy.generate.generate_request, the library call the command parses for: the
    settings and EvalOptions from plain values, the prompt read from its file, and the
    refusals made before any model file is read."""
    from kvlens.deploy.generate import generate_request
    from kvlens.errors import InputError

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time", encoding="utf-8")
    request = generate_request({"evals": ("ppl",)}, preset="kivi-2", compare="fp16",
                               prompt_file=prompt, place={"dtype": "float32"})
    assert [c.name for c in request.settings] == ["kivi-2", "fp16"]
    assert request.options.prompt == "Once upon a time" and request.options.evals == ("ppl",)
    assert request.place == {"dtype": "float32"} and request.model is None
    for options, kw, message in (({"prompt": "x"}, {"prompt_file": prompt}, "not both"),
                                 ({}, {}, "Nothing to do"),
                                 ({"evals": ("kld",), "chunk": 0}, {}, "chunk must be at least 1"),
                                 ({"prompt": "x"}, {"config": "x.json"}, "not both")):
        with pytest.raises(InputError, match=message):
            generate_request(options, preset="kivi-2", **kw)


def test_generate_malformed_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = runner.invoke(app, ["generate", "--config", str(bad), "--prompt", "x"])
    assert result.exit_code == 1 and "not valid JSON" in result.output


def test_generate_config_for_another_model(patched_model, tmp_path):
    from dataclasses import replace

    from kvlens.config import preset, save_config

    path = tmp_path / "other.json"
    save_config(replace(preset("kivi-2"), model={"num_layers": 12, "head_dim": 64}), path)
    result = runner.invoke(app, ["generate", "--config", str(path), "--prompt", "x"])
    assert result.exit_code == 1
    assert "num_layers=12" in result.output and "num_layers=30" in result.output


# -- long-context evaluations (tiny random Llama with SmolLM2's tokenizer) ------------------------

@pytest.fixture
def tiny_kivi(tmp_path):
    from kvlens.config import KVConfig, LayerKV, save_config
    from kvlens.quant import QuantSpec

    path = tmp_path / "tiny-kivi.json"
    save_config(KVConfig("tiny-kivi", LayerKV(QuantSpec(2, "per-channel", 8),
                                              QuantSpec(2, "per-token", 8), 16)), path)
    return path


def test_generate_kld_and_retrieval_json(tiny_model_dir, tiny_kivi):
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--compare",
                                 f"exact,{tiny_kivi},{tiny_kivi}", "--eval", "kld,retrieval",
                                 "--eval-tokens", "160", "--chunk", "16",
                                 "--retrieval-lengths", "200", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["interrupted"] is False
    kld = doc["evaluation"]["kld"]
    assert kld["text_source"] == "builtin:heldout" and kld["tokens"] == 160
    assert kld["chunk"] == 16 and kld["scored"] == 159 and kld["bootstrap"]["units"] == 3
    assert kld["bootstrap"]["unit_tokens"] == 64  # 4 chunks of 16 per bootstrap unit
    fp16, first, second = doc["results"]
    assert fp16["kld"]["mean_kld"]["value"] == 0.0 and fp16["kld"]["quantized_share"] == 0.0
    assert first["kld"]["quantized_share"] == pytest.approx((159 - 16) / 159)
    assert first["kld"]["vs_first"] is None
    assert second["kld"]["vs_first"]["mean_kld"]["verdict"] == "not distinguishable"
    assert set(first["kld"]) >= {"mean_kld", "median_kld", "p99_kld", "top1_agreement", "ppl",
                                 "ppl_change", "ppl_exact", "vs_exact", "quantized_share",
                                 "excess_nll"}
    k = first["kld"]  # ppl change = exp(mean KLD + excess NLL) - 1
    assert math.exp(k["mean_kld"]["value"] + k["excess_nll"]["value"]) - 1 == \
        pytest.approx(k["ppl_change"]["value"])
    assert first["bits_per_element"] < fp16["bits_per_element"]
    grid = doc["evaluation"]["retrieval"]
    assert grid["lengths"] == [200] and grid["prompts"] == 6 and grid["exact"]["total"] == 6
    for r in doc["results"]:
        assert r["retrieval"]["total"] == 6 and len(r["retrieval"]["by_length"]) == 1
        lo, hi = r["retrieval"]["by_length"][0]["wilson95"]
        assert 0.0 <= lo <= hi <= 1.0


def test_generate_frontier(tiny_model_dir, tiny_kivi, tmp_path):
    """--frontier draws the chart; --json and --report-json carry the points and the front."""
    chart, doc_path = tmp_path / "front.svg", tmp_path / "e.generate.json"
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--compare",
                                 f"fp16,{tiny_kivi},vllm:fp8_e4m3", "--eval", "kld",
                                 "--eval-tokens", "96", "--chunk", "16", "--frontier",
                                 str(chart), "--report-json", str(doc_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    front = doc["frontier"]
    assert front == json.loads(doc_path.read_text())["frontier"]
    assert [(p["name"], p["kind"]) for p in front["points"]] == [
        ("fp16", "preset"), ("tiny-kivi", "config"), ("vllm:fp8_e4m3", "engine")]
    for p, r in zip(front["points"], doc["results"]):
        assert p["bits"] == r["bits_per_element"]
        assert p["mean_kld"] == r["kld"]["mean_kld"]["value"]
        assert p["ci95"] == r["kld"]["mean_kld"]["ci95"]
        others = [q for q in front["points"] if q is not p]
        dominated = any(q["bits"] <= p["bits"] and q["mean_kld"] <= p["mean_kld"]
                        and (q["bits"], q["mean_kld"]) != (p["bits"], p["mean_kld"])
                        for q in others)
        assert p["on_front"] is not dominated
    fewest = min(front["points"], key=lambda p: (p["bits"], p["mean_kld"]))
    assert front["front"][0] == fewest["name"]  # the fewest bits is always on the front
    assert "<svg" in chart.read_text()


def test_generate_kld_table(tiny_model_dir, tiny_kivi):
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--compare",
                                 f"exact,{tiny_kivi}", "--eval", "kld", "--eval-tokens", "96",
                                 "--chunk", "16"])
    assert result.exit_code == 0, result.output
    assert "KL divergence vs the exact model" in result.stdout
    assert "quantized share" in result.stdout and "exact - tiny-kivi" in result.stdout
    assert "exact vs exact: not distinguishable" in result.stdout
    flat = " ".join(result.stdout.split())  # rich wraps long lines
    assert re.search(r"minus mean KLD .*: tiny-kivi [+-]\d\.\d{4} \[[+-]\d\.\d{4}, [+-]", flat)


@pytest.mark.parametrize("args,message,code", [
    (["--eval-tokens", "300"], "max_position_embeddings is 256; allowed: 2-256", 1),
    (["--eval-tokens", "64", "--chunk", "65"], "--chunk must be between 1", 1),
    (["--chunk", "0"], "Invalid value for '--chunk'", 2),  # below its declared minimum
    (["--eval", "retrieval", "--retrieval-lengths", "1000"], "allowed 64-240 tokens", 1),
    (["--eval", "retrieval", "--retrieval-lengths", "2k"], "comma list of integers", 1),
    (["--eval", "retrieval", "--retrieval-prompts", "0"], "Invalid value for", 2),
])
def test_generate_long_eval_bad_input(tiny_model_dir, args, message, code):
    """Refused before the model loads: the tiny model's config.json declares its context."""
    base = ["generate", "--model", str(tiny_model_dir), "--preset", "fp16"]
    if "--eval" not in args:
        args = ["--eval", "kld", *args]
    result = runner.invoke(app, [*base, *args])
    assert result.exit_code == code, result.output
    assert message in " ".join(result.output.split())
    assert "Loading" not in result.output


def test_the_model_header_is_read_without_loading(tiny_model_dir):
    """kvlens.model.header: the shape a model's files declare, from config.json or a GGUF
    file's metadata, equals the loaded model's (the embedded SmolLM2: 30 layers, 8192
    positions)."""
    from kvlens.model.header import read_header
    from kvlens.model.load import resolve_model

    tiny = read_header(resolve_model(str(tiny_model_dir)))
    assert tiny.shape.num_layers and tiny.max_positions == 256 and tiny.complete
    gguf = read_header(resolve_model(None))
    assert (gguf.shape.num_layers, gguf.max_positions, gguf.shape.num_key_value_heads,
            gguf.shape.head_dim) == (30, 8192, 3, 64)


def test_generate_kld_longer_than_the_text(tiny_model_dir, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("A short text. " * 5)
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--preset", "fp16",
                                 "--eval", "kld", "--eval-tokens", "100", "--text", str(text)])
    assert result.exit_code == 1
    assert "longer than the text from" in result.output and "short.txt" in result.output


def test_ctrl_c_prints_what_was_finished_and_exits_nonzero(tiny_model_dir, tiny_kivi,
                                                           monkeypatch):
    import kvlens.evaluation.kld as kld

    calls = {"n": 0}
    real = kld.reads_quantized

    def interrupt_later(cache):
        calls["n"] += 1
        if calls["n"] == 5:  # during the 5th chunk (one config): chunks 1-4 are finished
            raise KeyboardInterrupt
        return real(cache)

    monkeypatch.setattr(kld, "reads_quantized", interrupt_later)
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--config",
                                 str(tiny_kivi), "--eval", "kld,retrieval", "--eval-tokens",
                                 "128", "--chunk", "16", "--retrieval-lengths", "200",
                                 "--json"])
    assert result.exit_code == 130
    doc = json.loads(result.stdout)
    assert doc["interrupted"] and doc["evaluation"]["kld"]["chunks_done"] == 4
    assert doc["results"][0]["kld"]["scored"] == 64
    assert "retrieval" not in doc["evaluation"]  # not started after the interrupt
    assert "interrupted" in result.stderr


def test_ctrl_c_during_short_evals_keeps_the_finished_configs(tiny_model_dir, tiny_kivi,
                                                              monkeypatch):
    import kvlens.evaluation.short as short

    real = short.decode_ppl
    calls = {"n": 0}

    def interrupt_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(short, "decode_ppl", interrupt_second)
    args = ["generate", "--model", str(tiny_model_dir), "--compare", f"exact,{tiny_kivi}",
            "--eval", "ppl,kld", "--ppl-tokens", "48", "--eval-tokens", "64"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 130
    doc = json.loads(result.stdout)
    exact, kivi = doc["results"]
    assert exact["ppl_change"] == 0.0 and "ppl" not in kivi and doc["evaluation"] == {}
    calls["n"] = 0
    result = runner.invoke(app, args)  # the table shows the finished config only
    assert result.exit_code == 130 and "exact" in result.stdout
    assert "tiny-kivi" not in result.stdout and "interrupted" in result.stderr


def test_preset_help_lists_every_stable_preset():
    """The --preset help text is written by hand (importing the presets would load torch for
    `kvlens --help`): it must name every stable preset (those a fresh process has before
    kvlens.research is imported) and points at the lab notes for the research ones."""
    import subprocess
    import sys

    from kvlens.config import PRESETS

    stable = subprocess.run([sys.executable, "-c", "from kvlens.config.presets import PRESETS; "
                             "print(' '.join(PRESETS))"], capture_output=True, text=True,
                            check=True).stdout.split()
    result = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    assert "kivi-2" in stable and len(stable) < len(PRESETS)
    missing = [name for name in stable if name not in result.stdout]
    assert not missing and "research presets: docs/lab-notes/" in result.stdout


def test_generate_compare_vllm_turboquant(tiny_model_dir):
    """vllm:turboquant_* settings run through `generate --compare` on a tiny 3-layer Llama
    (head_dim 16): layers 0 and 2 are the exact boundary layers, layer 1 holds 4-bit codebook
    keys (4 bits + a 16-bit norm per 16 channels = 5 bits) and 4-bit per-token values (4 bits +
    fp16 scale and zero = 6 bits) for 4bit_nc, 3 + 1 and 3 + 2 bits for 3bit_nc (plus the
    float32 [16, 16] Hadamard matrix the cache holds), fp8 keys and 6-bit values for k8v4, over 96 tokens x 3 layers x 2 KV heads x
    16 channels x (K, V)."""
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--compare",
                                 "exact,vllm:turboquant_4bit_nc,vllm:turboquant_3bit_nc,"
                                 "vllm:turboquant_k8v4",
                                 "--eval", "kld", "--eval-tokens", "96", "--chunk", "16",
                                 "--json"])
    assert result.exit_code == 0, result.output
    exact, tq4, tq3, k8 = json.loads(result.stdout)["results"]
    assert tq4["name"] == "vllm:turboquant_4bit_nc" and tq3["name"] == "vllm:turboquant_3bit_nc"
    rotation = 16 * 16 * 32 / (96 * 3 * 2 * 16 * 2)
    assert tq4["bits_per_element"] == pytest.approx((4 * 16 + 5 + 6) / 6 + rotation)
    assert tq3["bits_per_element"] == pytest.approx((4 * 16 + 4 + 5) / 6 + rotation)
    assert k8["bits_per_element"] == pytest.approx((4 * 16 + 8 + 6) / 6)  # fp8 keys, no rotation
    assert exact["kld"]["mean_kld"]["value"] == 0.0
    for r in (tq4, tq3, k8):
        assert 0 < r["kld"]["mean_kld"]["value"] < 1
    assert "resolved when the model is loaded" in result.stderr  # noted before the load
    assert "vllm:turboquant_3bit_nc: layers kept exact for this 3-layer model: 0, 2" in \
        result.stderr
    assert "vllm:turboquant_4bit_nc: keys 4-bit Lloyd-Max codes" in result.stderr


def test_generate_kld_mixed_engine_and_kvlens_layers_on_gemma3(tmp_path, tiny_tokenizer):
    """``--eval kld`` on a tiny Gemma3 (sliding window 8) with configs mixing engine-format and
    kvlens layers, all in one --compare (their sessions nest): the float16 kvlens layer and the
    f16/f16 engine layer in its place score identically; the q8_0 engine layer beside 2-bit
    kvlens layers is scored too."""
    from tiny_models import save_model_dir, tiny_config

    from kvlens.config import KVConfig, LayerKV, save_config
    from kvlens.quant import QuantSpec

    config = tiny_config("gemma3")
    config.vocab_size = len(tiny_tokenizer)
    config.head_dim = 32  # llama.cpp's q8_0 needs multiples of 32
    model_dir = save_model_dir(tmp_path / "tiny-gemma3", config, tiny_tokenizer)
    quant = LayerKV(QuantSpec(2, "per-channel", 8), QuantSpec(2, "per-token", 8), 16)
    configs = {"kvlens-f16": {0: LayerKV()},
               "engine-f16": {0: LayerKV(key_format="f16", value_format="f16")},
               "engine-q8": {2: LayerKV(key_format="q8_0", value_format="q8_0")}}
    paths = []
    for name, layers in configs.items():
        paths.append(tmp_path / f"{name}.json")
        save_config(KVConfig(name, quant, layers), paths[-1])
    result = runner.invoke(app, ["generate", "--model", str(model_dir), "--compare",
                                 ",".join(map(str, paths)), "--eval", "kld",
                                 "--eval-tokens", "96", "--chunk", "16", "--json"])
    assert result.exit_code == 0, result.output
    kvlens_f16, engine_f16, engine_q8 = (r["kld"] for r in json.loads(result.stdout)["results"])
    for key in ("mean_kld", "p99_kld", "top1_agreement"):
        assert engine_f16[key] == kvlens_f16[key]
    assert engine_f16["vs_first"]["mean_kld"]["diff"] == 0.0
    assert kvlens_f16["mean_kld"]["value"] > 0 and engine_q8["mean_kld"]["value"] > 0


@pytest.mark.parametrize("command, library, shown", [
    ("generate", "kvlens.evaluation.options.EvalOptions",
     ("chunk", "passkey_context", "ppl_tokens")),
    ("compare-axes", "kvlens.analysis.compare.CompareConfig",
     ("bits", "group_sizes", "outlier_fraction", "sink_tokens")),
])
def test_library_options_take_their_defaults_from_the_library(command, library, shown):
    # one home for a default: the command passes the library only what the user gave, and
    # --help shows the library dataclass's own default
    import importlib
    from dataclasses import fields

    import typer

    module, _, name = library.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    defaults = {f.name: f.default for f in fields(cls)}
    params = typer.main.get_command(app).commands[command].params
    read = {p.name: p for p in params if p.name in defaults}
    assert set(shown) <= set(read)
    assert [n for n, p in read.items() if p.default not in (None, "")] == []
    res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    for field in shown:
        flag = read[field].opts[0]
        rows = [ln.strip("│ ") for ln in res.output.splitlines()]
        start = next(i for i, r in enumerate(rows) if r.startswith(flag + " "))
        end = next(i for i in range(start + 1, len(rows)) if rows[i].startswith(("-", "╰")))
        text = " ".join(rows[start:end])  # the option's row, wrapped lines included
        d = defaults[field]
        assert f"[default: {','.join(map(str, d)) if isinstance(d, tuple) else d}]" in text, text
