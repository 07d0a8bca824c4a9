"""Where a model's weights, its activations and its KV cache live: device maps, memory limits
and CPU/disk offload, through accelerate's big-model inference (kvlens places no module itself).

``plan_device_map`` computes the explicit map accelerate would (on an empty model, as
transformers does), so that a limit that cannot hold the model fails before any weight is read.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlens.errors import ModelLoadError, PlacementError
from kvlens.model.architecture import attention_modules, decoder_layers
from kvlens.units import format_bytes

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
MEMORY_KEYS = "GPU index (0, 1, ...), cpu, mps, disk"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 10**3,
          "M": 10**6, "G": 10**9, "T": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class Placement:
    """A device map request: a ``strategy`` (``STRATEGIES``) or an ``explicit`` map (module
    name -> GPU index, ``cpu`` or ``disk``), per-device limits in bytes (``disk`` included) and the
    offload folder (``None``: no disk offload allowed)."""

    strategy: str | None = None
    explicit: tuple[tuple[str, int | str], ...] = ()
    max_memory: tuple[tuple[int | str, int], ...] = ()
    offload_folder: str | None = None


# -- parsing ------------------------------------------------------------------------------------

def parse_size(text: str, what: str = "size") -> int:
    """Bytes of ``20GiB``, ``500MB``, ``1.5GB`` or a plain byte count (GB = 10^9, GiB = 2^30,
    as accelerate reads them)."""
    m = _SIZE.match(text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise PlacementError(f"Invalid {what} {text!r}: expected a number with a unit such as "
                             "20GiB, 500MB or 1.5GB (KB/MB/GB/TB = powers of 1000, "
                             "KiB/MiB/GiB/TiB = powers of 1024), or a byte count.")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise PlacementError(f"Invalid {what} {text!r}: it must be more than 0 bytes.")
    return value


def _device_key(text: str, flag: str) -> int | str:
    key = text.strip().lower()
    if key in ("cpu", "disk", "mps"):
        return key
    if key.startswith("cuda:"):
        key = key[5:]
    elif key == "cuda":
        key = "0"
    if key.isdigit():
        return int(key)
    raise PlacementError(f"Unknown device {text.strip()!r} in {flag}; allowed: {MEMORY_KEYS} "
                     "(cuda:N is read as N).")


def parse_max_memory(spec: str) -> dict[int | str, int]:
    """``"0=20GiB,1=20GiB,cpu=60GiB,disk=200GiB"`` -> ``{0: bytes, 1: bytes, "cpu": bytes,
    "disk": bytes}`` (accelerate's form; ``disk`` is a limit kvlens checks itself)."""
    out: dict[int | str, int] = {}
    items = [s for s in spec.split(",") if s.strip()]
    if not items:
        raise PlacementError("{max_memory} is empty; expected e.g. 0=20GiB,cpu=60GiB,disk=200GiB.")
    for item in items:
        name, sep, size = item.partition("=")
        if not sep or not name.strip() or not size.strip():
            raise PlacementError(f"Invalid {{max_memory}} entry {item.strip()!r}: expected "
                             "DEVICE=SIZE, e.g. 0=20GiB,cpu=60GiB,disk=200GiB (devices: "
                             f"{MEMORY_KEYS}).")
        key = _device_key(name, "{max_memory}")
        if key in out:
            raise PlacementError(f"{{max_memory}} names device {key!r} twice.")
        out[key] = parse_size(size.strip(), f"{{max_memory}} size for {key}")
    return out


def parse_device_map(spec: str) -> str | dict[str, int | str]:
    """A strategy name, an inline JSON object, or a JSON file of module name -> device."""
    text = spec.strip()
    if text in STRATEGIES:
        return text
    if text.startswith("{"):
        source = "inline {device_map} JSON"
    elif Path(text).expanduser().is_file():
        source = text
        try:
            text = Path(text).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PlacementError(f"Cannot read {{device_map}} file {source}: {exc}.") from None
    else:
        raise PlacementError(f"Unknown {{device_map}} {spec!r}; allowed: {', '.join(STRATEGIES)}, a "
                         "JSON object such as '{\"model.layers.0\": 0, \"\": \"cpu\"}', or a "
                         "JSON file holding one.")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlacementError(f"{source} is not valid JSON ({exc}).") from None
    if not isinstance(raw, dict) or not raw:
        raise PlacementError(f"{source} must be a non-empty JSON object of module name -> device.")
    out: dict[str, int | str] = {}
    for name, dev in raw.items():
        if isinstance(dev, bool) or not isinstance(dev, (int, str)):
            raise PlacementError(f"{source}: device {dev!r} of module {name!r} is not a GPU index, "
                             "'cpu' or 'disk'.")
        key = _device_key(str(dev), f"{source} (module {name!r})")
        if key == "mps":
            raise PlacementError(f"{source}: use a strategy (auto) for mps; explicit maps take GPU "
                             "indices, cpu and disk.")
        out[str(name)] = key
    return out


def make_placement(device_map: str | None = None, max_memory: str | dict | None = None,
                   offload_folder: str | os.PathLike | None = None) -> Placement | None:
    """Validate the three options together; ``None`` when no device map is asked for."""
    if device_map is None:
        if max_memory or offload_folder:
            flag = "{max_memory}" if max_memory else "{offload_folder}"
            raise PlacementError(f"{flag} only applies with {{device_map}}; add {{device_map}} auto "
                             f"(or {', '.join(STRATEGIES[1:])}, or an explicit map).")
        return None
    dmap = parse_device_map(device_map) if isinstance(device_map, str) else dict(device_map)
    limits = parse_max_memory(max_memory) if isinstance(max_memory, str) else \
        dict(max_memory or {})
    if isinstance(dmap, dict) and limits:
        raise PlacementError("{max_memory} applies to a strategy (auto, balanced, sequential); an "
                         "explicit {device_map} already says where each module goes.")
    _check_gpus([k for k in limits if isinstance(k, int)], "{max_memory}")
    if isinstance(dmap, dict):
        _check_gpus(sorted({v for v in dmap.values() if isinstance(v, int)}), "{device_map}")
    folder = _writable_folder(offload_folder) if offload_folder else None
    if "disk" in limits and folder is None:
        raise PlacementError("{max_memory} gives a disk limit but no {offload_folder}; add "
                         "{offload_folder} DIR (a writable directory for offloaded weights).")
    if isinstance(dmap, str):
        return Placement(strategy=dmap, max_memory=tuple(limits.items()), offload_folder=folder)
    return Placement(explicit=tuple(dmap.items()), offload_folder=folder)


def _check_gpus(indices: list[int], flag: str) -> None:
    if not indices:
        return
    import torch

    n = torch.cuda.device_count()
    missing = [i for i in indices if i >= n]
    if missing:
        have = f"GPUs 0-{n - 1}" if n else "no CUDA GPU"
        raise PlacementError(f"{flag} names GPU {', '.join(map(str, missing))} but this machine has "
                         f"{have}; use cpu (and disk with {{offload_folder}}) or the GPU indices "
                         "that exist.")


def writable_error(folder: Path) -> str | None:
    """Why ``folder`` (created if missing) cannot take new files, or ``None`` when it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvlens-write-test-"):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _writable_folder(path: str | os.PathLike) -> str:
    folder = Path(path).expanduser()
    why = writable_error(folder)
    if why is not None:
        raise PlacementError(f"{{offload_folder}} {folder} is not a writable directory ({why}); "
                             "pass a directory you can write to.")
    return str(folder.resolve())


# -- planning -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DevicePlan:
    """The explicit map a placement resolves to, and the weight bytes it puts on each device."""

    device_map: dict[str, int | str]
    bytes_by_device: dict[str, int]  # "cuda:0", "cpu", "disk", ...
    total_bytes: int


def empty_model(config, dtype):
    """The model of ``config`` on the meta device (no memory), weights tied."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def plan_device_map(config, dtype, placement: Placement) -> DevicePlan:
    """The explicit device map for ``config`` at ``dtype`` under ``placement``; raises
    ``PlacementError`` naming the devices and sizes when the limits cannot hold the model."""
    from accelerate.utils import compute_module_sizes

    model = empty_model(config, dtype)
    sizes = compute_module_sizes(model, dtype=dtype)
    if placement.strategy is not None:
        dmap = _infer(model, dtype, placement)
    else:
        dmap = dict(placement.explicit)
        _check_coverage(model, dmap)
    by_device: dict[str, int] = {}
    for name, dev in dmap.items():
        key = _map_device_name(dev)
        by_device[key] = by_device.get(key, 0) + sizes.get(name, 0)
    plan = DevicePlan(dict(dmap), by_device, int(sizes[""]))
    _check_disk(plan, placement, dtype)
    return plan


def _infer(model, dtype, placement: Placement) -> dict[str, int | str]:
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

    limits = {k: v for k, v in placement.max_memory if k != "disk"} or None
    no_split = model._no_split_modules
    if placement.strategy == "sequential":
        memory = get_max_memory(limits)
    else:  # what transformers does for auto/balanced: spread evenly over the GPUs
        memory = get_balanced_memory(model, max_memory=limits, no_split_module_classes=no_split,
                                     dtype=dtype,
                                     low_zero=placement.strategy == "balanced_low_0")
    return dict(infer_auto_device_map(model, max_memory=memory,
                                      no_split_module_classes=no_split, dtype=dtype))


def _owner(name: str, keys) -> str | None:
    """The most specific device-map key placing the weight ``name`` (``""`` places all)."""
    return next((k for k in sorted(keys, key=len, reverse=True)
                 if k == "" or name == k or name.startswith(k + ".")), None)


def _check_coverage(model, dmap: dict[str, int | str]) -> None:
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    missing = [n for n in names if _owner(n, dmap) is None]
    if missing:
        modules = sorted({n.rsplit(".", 1)[0] for n in missing})
        raise PlacementError(f"{{device_map}} does not place {len(missing)} weight tensor(s), in modules "
                         f"{', '.join(modules[:6])}{' ...' if len(modules) > 6 else ''}; add "
                         "them (or a \"\" entry for everything else).")
    unknown = [k for k in dmap if k and not any(n == k or n.startswith(k + ".") for n in names)]
    if unknown:
        raise PlacementError(f"{{device_map}} names modules the model does not have: "
                         f"{', '.join(unknown[:6])}.")


def _check_disk(plan: DevicePlan, placement: Placement, dtype) -> None:
    on_disk = plan.bytes_by_device.get("disk", 0)
    if not on_disk:
        return
    held = ", ".join(f"{dev}: {format_bytes(b)}" for dev, b in plan.bytes_by_device.items()
                     if dev != "disk")
    limits = ", ".join(f"{k}={format_bytes(v)}" for k, v in placement.max_memory) or "none given"
    need = (f"the model's weights take {format_bytes(plan.total_bytes)} at {str(dtype).split('.')[-1]}; "
            f"the memory devices hold {held or 'nothing'} ({{max_memory}}: {limits}), so "
            f"{format_bytes(on_disk)} would go to disk")
    if placement.offload_folder is None:
        raise PlacementError(f"The model does not fit: {need}, and disk offload needs "
                         "{offload_folder} DIR. Raise {max_memory} or add {offload_folder}.")
    disk_limit = dict(placement.max_memory).get("disk")
    if disk_limit is not None and on_disk > disk_limit:
        raise PlacementError(f"The model does not fit even with disk offload: {need}, over the disk "
                         f"limit {format_bytes(disk_limit)}. Raise {{max_memory}} (memory or disk).")


# -- after loading ------------------------------------------------------------------------------

def _hook_device(module):
    hook = getattr(module, "_hf_hook", None)
    for h in [hook, *getattr(hook, "hooks", ())]:
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            import torch

            return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    return None


def execution_device(model, module):
    """Where ``module`` computes: its own or its nearest ancestor's accelerate hook, else the
    device of its first real (non-meta) parameter, else the CPU."""
    import torch

    name = next((n for n, m in model.named_modules() if m is module), "")
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        dev = _hook_device(model.get_submodule(".".join(parts[:i])))
        if dev is not None:
            return dev
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def input_device(model):
    """Where token ids must go: the device the input embeddings compute on."""
    return execution_device(model, model.get_input_embeddings())


def layer_devices(model) -> list:
    """Per model layer, the ``torch.device`` its attention computes on (the layer's own where it
    has no attention: a hybrid model's state layers)."""
    attention = {m.layer_idx: m for m in attention_modules(model)}
    layers = decoder_layers(model)
    return [execution_device(model, attention.get(i, layer)) for i, layer in enumerate(layers)]


def weights_by_device(model) -> dict[str, int]:
    """Bytes of weights (parameters and buffers, shared ones once) per device; an offloaded one (a
    meta placeholder) counts on the device its ``hf_device_map`` entry names (``cpu``, ``disk``)."""
    dmap = getattr(model, "hf_device_map", None) or {}
    out: dict[str, int] = {}
    seen: set[int] = set()
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.device.type != "meta":
            dev = str(t.device)
        else:
            key = _owner(name, dmap)
            if key is None:
                raise ModelLoadError(f"Weight {name} is on the meta device but the model's "
                                     "device map does not place it.")
            dev = _map_device_name(dmap[key])
        out[dev] = out.get(dev, 0) + t.numel() * t.element_size()
    return out


def _map_device_name(dev) -> str:
    return f"cuda:{dev}" if isinstance(dev, int) else str(dev)


def placement_summary(model) -> dict[str, Any]:
    """JSON-able: weights per device, each layer's execution device, and the device map the
    model was dispatched with (``None`` when it was loaded without one)."""
    dmap = getattr(model, "hf_device_map", None)
    return {"weights_by_device": weights_by_device(model),
            "layer_devices": [str(d) for d in layer_devices(model)],
            "device_map": dict(dmap) if dmap else None}
