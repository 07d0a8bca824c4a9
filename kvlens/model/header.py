"""What a model's files say about its shape before any weight is read: layers, context length
and head counts, from ``config.json`` (a HuggingFace directory, or a hub id's config already in
the local HuggingFace cache) or a GGUF file's key-value header. Commands check options that
depend on the model (``capture --layers 99``, a config naming layer 99) against it before the
model loads; a count the files do not give is 0 (the context length ``None``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlens.errors import is_int
from kvlens.model.architecture import kv_layers_of_types
from kvlens.model.mla import MlaShape
from kvlens.model.shape import ModelShape


@dataclass(frozen=True)
class ModelHeader:
    """A model's shape as its files declare it (counts 0 where they do not; ``kv_layers`` where
    ``layer_types`` name them; ``has_rope`` assumed until the model is built)."""

    shape: ModelShape = ModelShape(0, 0, 0, 0)  # nothing declared
    max_positions: int | None = None  # max_position_embeddings / GGUF context_length
    where: str = ""  # the file it was read from

    @property
    def complete(self) -> bool:
        """Whether layers, KV heads and head_dim (what ``validate_for`` reads) are declared."""
        return bool(self.shape.num_layers and self.shape.num_key_value_heads
                    and self.shape.head_dim)


def read_header(source) -> ModelHeader:
    """The ``ModelHeader`` of a resolved ``ModelSource``; an empty one where nothing can be read
    without loading (a hub model not in the local cache, an unreadable file)."""
    try:
        if source.kind == "gguf":
            return _gguf_header(Path(source.location) / (source.gguf_file or ""))
        if source.kind == "dir":
            return _config_header(Path(source.location) / "config.json")
        return _hub_header(source.location)
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError):
        return ModelHeader()  # the load itself names what is wrong with the files


def _positive(value: Any) -> int | None:
    return value if is_int(value, 1) else None


def _first(config: dict, *names: str) -> int | None:
    for name in names:
        value = _positive(config.get(name))
        if value is not None:
            return value
    return None


def header_from_config(config: dict, where: str = "") -> ModelHeader:
    """A ``ModelHeader`` from a transformers config dict (a multimodal model's text part)."""
    text = config.get("text_config")
    if isinstance(text, dict) and not _first(config, "num_hidden_layers", "n_layer"):
        config = text
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    kv = None if config.get("model_type") in _MULTI_HEAD_ONLY else \
        _first(config, "num_key_value_heads") or heads
    hidden = _first(config, "hidden_size", "n_embd")
    head_dim = _first(config, "head_dim") or (hidden // heads if hidden and heads else None)
    latent, rope = _first(config, "kv_lora_rank"), _first(config, "qk_rope_head_dim")
    mla = None
    if latent and rope:  # MLA: one latent row per token (kvlens.model.mla)
        kv, head_dim = 1, latent + rope
        mla = MlaShape(rope, latent, _first(config, "qk_nope_head_dim") or 0,
                       _first(config, "v_head_dim") or 0)
    names = config.get("architectures") or [config.get("model_type") or ""]
    types = config.get("layer_types")
    kv_layers = kv_layers_of_types(types) if isinstance(types, list) and layers \
        and len(types) == layers else None
    shape = ModelShape(layers or 0, heads or 0, kv or 0, head_dim or 0, kv_layers or (),
                       mla=mla, architecture=str(names[0]),
                       model_type=str(config.get("model_type") or ""))
    return ModelHeader(shape, _first(config, "max_position_embeddings", "n_positions"), where)


#: families whose config's ``num_key_value_heads`` is not the KV heads their attention reads
#: (multi-head attention ignoring it; JetMoE's mixture of attention heads)
_MULTI_HEAD_ONLY = frozenset({"gpt_neox", "gpt2", "gptj", "bloom", "opt", "gpt_bigcode",
                              "jetmoe"})


def _config_header(path: Path) -> ModelHeader:
    config = json.loads(path.read_text(encoding="utf-8"))
    return header_from_config(config, str(path)) if isinstance(config, dict) else ModelHeader()


def _hub_header(repo_id: str) -> ModelHeader:
    """Only a config already in the local HuggingFace cache (no network here)."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, "config.json")
    return _config_header(Path(path)) if isinstance(path, str) else ModelHeader()


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key-value metadata of a GGUF file (read by the ``gguf`` package, which transformers
    loads GGUF files with): scalars and strings as values, arrays ``None``."""
    import gguf

    out: dict[str, Any] = {}
    for key, f in gguf.GGUFReader(path).fields.items():
        kind, part = f.types[0], f.parts[f.data[0]] if f.data else None
        out[key] = (None if kind == gguf.GGUFValueType.ARRAY or part is None
                    else bytes(part).decode("utf-8", "replace")
                    if kind == gguf.GGUFValueType.STRING else part[0].item())
    return out


def _gguf_header(path: Path) -> ModelHeader:
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        return ModelHeader()

    def get(key: str) -> int | None:
        return _positive(meta.get(f"{arch}.{key}"))

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length") or (hidden // heads if hidden and heads else None)
    shape = ModelShape(get("block_count") or 0, heads or 0,
                       get("attention.head_count_kv") or heads or 0, head_dim or 0,
                       architecture=arch, model_type=arch)
    return ModelHeader(shape, get("context_length"), str(path))
