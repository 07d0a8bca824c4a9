"""What ``recommend`` will cost before it starts: predicted wall time and peak memory.

The prediction counts each stage's work from the capture's shape, the options and the model's
size, and divides it by rates measured on kvlens' reference machine (docs/benchmarks.md records
predicted against measured), scaled by ``machine_factor`` (one float32 matrix product timed on
one thread at start-up against the reference machine's time for it). It is a model, not a
measurement. Work units: attention multiply-adds (candidate errors), quantized elements
(variants), forward FLOPs (layout sensitivity, retrieval probe; each perturbed run starts at
its layer and scores half the tokens, plus its LM head and KL passes over the logits) and the
capture's bytes. ``workers`` processes divide the per-layer stages, each on one core and each
holding its own capture layer and reconstructions. Peak memory (all processes, as
``benchmarks/bench_recommend.py`` samples it): the runtime, the weights at the model stages'
dtype, and per measuring process a capture layer, its reconstructions and the KL stage's
log-probabilities.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from kvlens.analysis.compare import torch_threads
from kvlens.model.shape import ModelShape

# Rates of the reference machine (2-core AMD EPYC VM, docs/benchmarks.md), from
# benchmarks/bench_recommend.py's stage profile of the default recommend on SmolLM2-135M
# (seconds per unit of work).
ATTENTION_SECONDS_PER_UNIT = 4.6e-11  # candidate errors: one multiply-add of an attention pass
VARIANT_SECONDS_PER_ELEMENT = 4.3e-8  # quantizing one captured element for one candidate
FORWARD_SECONDS_PER_FLOP = 1.37e-11  # a model forward on the CPU (all its cores)
# The layout sensitivity's perturbed runs on a worker (one core): decoder and LM head FLOPs,
# and the KL's passes over the logits; both rates fitted to that stage's time on SmolLM2 and
# Gemma3 over the machine factor then (docs/lab-notes/benchmark-history.md, the perturbed runs' KL)
WORKER_FORWARD_SECONDS_PER_FLOP = 1.69e-11
WORKER_LOGIT_SECONDS = 5.0e-9  # per kept position and vocabulary entry
# ``machine_factor``'s product (a SmolLM2 MLP projection over 512 tokens) on the reference
# machine, one thread, best of its repeats
REFERENCE_MATMUL_SHAPE = (512, 576, 1536)
REFERENCE_MATMUL_SECONDS = 1.03e-2
READ_SECONDS_PER_BYTE = 2.0e-9  # reading the capture file
LOGIT_FLOPS = 10  # a GPU projection's KL work per kept position and vocabulary entry
RUNTIME_BYTES = 500 * 2**20  # torch, transformers, the GGUF conversion and the process itself
# a spawned worker's own torch and kvlens (kvlens.recommend.parallel); a forked one shares its
# parent's pages and holds little beyond its capture layer and reconstructions
WORKER_BYTES = 400 * 2**20


#: Published dense peak FLOP/s of GPUs by dtype (NVIDIA H100 SXM / H200 datasheets: tensor-core
#: bfloat16/float16 without sparsity, float32 without tensor cores), for projections only
GPU_PEAK_FLOPS = {
    "h100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "h200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
}
GPU_MEMORY_BYTES = {"h100": 80 * 10**9, "h200": 141 * 10**9}
#: the share of that peak a batch-1 forward of a few hundred tokens is assumed to reach (an
#: assumption, not a measurement: no GPU run of recommend has been measured)
GPU_EFFICIENCY = 0.25


@dataclass(frozen=True)
class Hardware:
    """Where the model stages run, for ``predict``: the reference CPU (``gpu`` None: its
    measured rates), or one GPU of ``GPU_PEAK_FLOPS`` holding the weights (a projection from
    its published peak times ``GPU_EFFICIENCY``; the candidate errors stay on the CPU, where
    kvlens measures them on the capture's tensors)."""

    gpu: str | None = None
    dtype: str = "float32"

    @property
    def label(self) -> str:
        if self.gpu is None:
            return f"reference CPU, {self.dtype} (rates measured)"
        return (f"{self.gpu.upper()}, {self.dtype} (projected: published peak x "
                f"{GPU_EFFICIENCY})")

    @property
    def forward_flops(self) -> float | None:
        """FLOP/s of a model forward there (None: the CPU's measured rates)."""
        return None if self.gpu is None else GPU_PEAK_FLOPS[self.gpu][self.dtype] * \
            GPU_EFFICIENCY


@dataclass(frozen=True)
class CostShape:
    """The sizes the prediction reads (from a capture's metadata and the options)."""

    model: ModelShape  # its query and KV heads and head_dim (a capture's shape)
    layers: int  # the layers measured
    samples: int  # capture samples the errors are measured on
    tokens: int  # tokens per sample the errors are measured on
    score_from: int  # first scored query (several windows: three times the largest)
    candidates: int
    streams: int  # (window, flush block) pairs a layer can end up with
    families: int  # storage families the layout sensitivity measures (0: not run)
    sensitivity_tokens: int  # tokens of a sensitivity forward
    probe_tokens: int  # the retrieval probe's length (0: not run)
    params: int  # the model's parameters (0: no model stage)
    vocab: int
    hidden: int = 0  # the model's hidden size (0: query heads x head_dim)
    family_layers: int = 0  # layers that measure every family (0: all; the rest two anchors)
    workers: int = 1  # processes the per-layer measurements run on (kvlens.recommend.parallel)
    weight_bytes: int = 4  # bytes per model weight (the model stages' dtype)
    forked: bool = True  # workers start as copies of the calling process (Linux), not fresh


@dataclass(frozen=True)
class Cost:
    """Predicted seconds per stage and peak resident bytes."""

    stages: dict[str, float]
    peak_bytes: int
    machine_factor: float = 1.0  # the stages are the reference machine's times x this
    device_bytes: int = 0  # held on the GPU (the weights), when the model stages run on one

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())

    def to_dict(self) -> dict:
        return {"stages": dict(self.stages), "seconds": self.seconds,
                "peak_bytes": self.peak_bytes, "machine_factor": self.machine_factor,
                "device_bytes": self.device_bytes}


@functools.cache
def machine_factor(repeats: int = 15) -> float:
    """This machine's time for ``REFERENCE_MATMUL_SHAPE``'s float32 product on one thread
    (best of ``repeats``) over the reference machine's: 2.0 reads "half as fast". Timed once
    per process (about 0.2 s on the reference machine)."""
    m, k, n = REFERENCE_MATMUL_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    best = float("inf")
    with torch_threads(1), torch.no_grad():
        torch.nn.functional.linear(x, w)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return best / REFERENCE_MATMUL_SECONDS


def estimated_params(shape: ModelShape, vocab: int = 0) -> int:
    """Parameters of a decoder of ``shape`` with hidden size query heads x head_dim (an
    estimate used before the model loads: attention 4 h^2, an MLP of 8 h^2, the embedding)."""
    hidden = shape.num_attention_heads * shape.head_dim
    return shape.num_layers * 12 * hidden * hidden + vocab * hidden


def predict(shape: CostShape, factor: float = 1.0, hardware: Hardware | None = None) -> Cost:
    """Predicted wall seconds per stage and peak memory of ``recommend`` on ``shape``, on a
    machine ``factor`` times slower than the reference one (``machine_factor``), its model
    stages on ``hardware`` (None: the CPU; a GPU: a projection, ``Hardware``)."""
    s = shape
    hq, hkv, d = s.model.num_attention_heads, s.model.num_key_value_heads, s.model.head_dim
    gpu = hardware is not None and hardware.gpu is not None
    scored = max(1, s.tokens - s.score_from)
    attention = s.layers * s.candidates * s.streams * s.samples * hq * scored * s.tokens * d
    elements = s.layers * s.candidates * s.samples * hkv * s.tokens * d
    read = s.layers * s.samples * (hq + 3 * hkv) * s.tokens * d * 4
    stages = {
        "capture read": read * READ_SECONDS_PER_BYTE,
        "candidate errors": (attention * ATTENTION_SECONDS_PER_UNIT
                             + elements * VARIANT_SECONDS_PER_ELEMENT) / s.workers,
    }
    if s.params and s.families:
        # one perturbed run per measured (layer, family)
        every = s.family_layers if 0 < s.family_layers < s.layers else s.layers
        anchors = min(2, s.families) if every < s.layers else s.families
        runs = anchors * s.layers + (s.families - anchors) * every
        head = s.vocab * (s.hidden or hq * d)
        kept = s.sensitivity_tokens // 2
        body = 2 * max(0, s.params - head) * s.sensitivity_tokens  # every decoder layer
        head_flops = 2 * head * kept
        # the reference run here; the perturbed runs, each through (L + 1) / 2L of the layers
        # on average, here or shared by one-thread workers
        per_flop = FORWARD_SECONDS_PER_FLOP if s.workers <= 1 else \
            WORKER_FORWARD_SECONDS_PER_FLOP / s.workers
        flops = (body + head_flops) + runs * (body * (s.layers + 1) / (2 * s.layers) + head_flops)
        if gpu:  # every run on the one GPU, the KL's few passes over the logits included
            stages["layout sensitivity"] = (flops + runs * kept * s.vocab * LOGIT_FLOPS) / \
                hardware.forward_flops / factor
        else:
            stages["layout sensitivity"] = (body + head_flops) * FORWARD_SECONDS_PER_FLOP + \
                runs * ((body * (s.layers + 1) / (2 * s.layers) + head_flops) * per_flop
                        + kept * s.vocab * WORKER_LOGIT_SECONDS / max(1, s.workers))
    if s.params and s.probe_tokens:
        probe_elements = s.layers * s.candidates * hkv * s.probe_tokens * d
        forward = 2 * s.params * s.probe_tokens
        stages["retrieval probe"] = (forward / hardware.forward_flops / factor if gpu else
                                     forward * FORWARD_SECONDS_PER_FLOP) + \
            probe_elements * VARIANT_SECONDS_PER_ELEMENT / s.workers
    layer_bytes = s.samples * (hq + 3 * hkv) * s.tokens * d * 4
    # a layer's reconstructions: the text's samples, or the probe's one longer sequence
    variants = s.candidates * hkv * max(s.samples * s.tokens, s.probe_tokens) * d * 4
    logits = 3 * (s.sensitivity_tokens // 2) * s.vocab * 4 if s.params else 0
    # every process measuring a layer holds one, and the layout sensitivity's log-probabilities
    # of its own runs; spawned workers also their own runtime
    measuring = max(1, s.workers) * (layer_bytes + variants + logits)
    spawned = s.workers * WORKER_BYTES if s.workers > 1 and not s.forked else 0
    weights = s.weight_bytes * s.params
    peak = RUNTIME_BYTES + (0 if gpu else weights) + measuring + spawned
    return Cost({name: sec * factor for name, sec in stages.items()}, int(peak), factor,
                weights if gpu else 0)
