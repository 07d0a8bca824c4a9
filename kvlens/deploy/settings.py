"""The caches ``kvlens generate`` runs, resolved from what the user names (``resolve_settings``:
config files, presets, engine settings, transformers baselines, ``hf-layers:FILE``), and checked
against the shape the model's files declare before any weight loads (``check_against_model``).
"""

from __future__ import annotations

import sys

from kvlens.config import KVConfig, load_config, preset, resolve, validate_for
from kvlens.config.engine import is_engine_setting, split_setting_list
from kvlens.deploy.presets import engine_config
from kvlens.errors import OptionError
from kvlens.evaluation.baselines import baseline, is_baseline
from kvlens.evaluation.frontier import setting_kind
from kvlens.evaluation.kld import check_lengths
from kvlens.evaluation.needles import grid_lengths
from kvlens.model import header as model_header


class Settings(list):
    """The configs (and baselines) to run in order, with the notes of the engine settings among
    them, and those whose config depends on the model's layers (vLLM TurboQuant's boundary
    layers), rebuilt by ``for_model`` once it loads."""

    notes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()  # per config, its kvlens.evaluation.frontier kind
    per_model: tuple = ()  # (config, setting name) of settings that need the model's layers

    def engine(self, name: str, calibration: str | None):
        setting = engine_config(name, calibration)
        self.notes = (*self.notes, *setting.notes)
        if setting.per_model:
            self.per_model = (*self.per_model, (setting.config, name))
        return setting.config

    def for_model(self, num_layers: int, hybrid: bool = False) -> list[str]:
        """Rebuild the configs of settings that depend on the model's layer count (vLLM
        TurboQuant's boundary layers), in place; returns a line per rebuilt setting."""
        lines = []
        for config, name in self.per_model:
            built = engine_config(name, num_layers=num_layers, hybrid=hybrid).config
            for i, c in enumerate(self):
                if c is config:
                    self[i] = built
            exact = ", ".join(map(str, sorted(built.layers))) or "none"
            lines.append(f"{name}: layers kept exact for this {num_layers}-layer model: {exact}")
        self.per_model = ()
        return lines


def resolve_settings(config=None, preset_name: str | None = None, compare: str | None = None,
                     calibration: str | None = None) -> Settings:
    """The settings a run compares: a config file, a preset or engine setting, and a comma list
    of any of those and transformers baselines, in that order (``generate_request`` has refused
    a config and a preset together). ``calibration``: a capture file for the static fp8 scales
    of vllm:/sglang: settings."""
    out = Settings()
    if config is not None:
        out.append(load_config(config))
        out.kinds += ("config",)
    if preset_name is not None:
        out.append(out.engine(preset_name, calibration)
                   if is_engine_setting(preset_name) else preset(preset_name))
        out.kinds += (setting_kind(preset_name),)
    if compare:
        items = split_setting_list(compare)
        out.extend(baseline(n) if is_baseline(n) else out.engine(n, calibration)
                   if is_engine_setting(n) else resolve(n) for n in items)
        out.kinds += tuple(setting_kind(n) for n in items)
    if not out:
        raise OptionError("Choose a cache: {preset} NAME, {config} FILE or {compare} P1,P2,...")
    if calibration is not None and "engine" not in out.kinds:
        raise OptionError("{calibration} gives the static fp8 scales of engine settings "
                         "(vllm:, sglang:), and no engine setting is among {preset}/{compare}; "
                         "add one or drop it.")
    return out


def check_against_model(settings: Settings, opts, source) -> None:
    """What depends on the model, checked against the shape its files declare
    (``kvlens.model.header``) before it loads: each config's layers and heads, the retrieval
    lengths and the kld tokens against its context (``opts``: ``EvalOptions``). What the files
    do not declare is checked after the load."""
    header = model_header.read_header(source)
    if header.complete:
        rebuilt = {id(config) for config, _ in settings.per_model}  # built once it loads
        for config in settings:
            if isinstance(config, KVConfig) and id(config) not in rebuilt:
                validate_for(config, header.shape)
    limit = header.max_positions
    if limit is None:
        return
    if "retrieval" in opts.evals:
        grid_lengths(opts.retrieval_lengths, limit)
    if "kld" in opts.evals:  # the text's length is checked once it is tokenized
        check_lengths(sys.maxsize, opts.eval_tokens, opts.chunk, limit, "")
