"""How much each layer's KV error hurts the model's predictions (recommend's layer weights).

For layer ``l`` the real model runs on capture tokens with only that layer's keys and values
replaced by a probe quantization (2-bit per-token, G=32, through kvlens' attention override);
the damage is the mean KL divergence of the next-token distributions from the exact run. The
weight is damage per unit of the layer's measured attention-output error,
``w_l = KL_l / (e_K,l + e_V,l)``, so that ``sum_l w_l (e_K,l + e_V,l)`` is a first-order
estimate of the total KL a configuration causes. Weights are normalised to mean 1.

One scalar per layer assumes every storage layout of that layer turns output error into KL at
the same rate. ``perturbed_kl`` measures it per layout instead (``recommend --sensitivity
layout``): the layer's keys or values replaced by one candidate's reconstruction, the KL
measured on the last positions only (the LM head of a large vocabulary costs more than the
layers below it). A perturbed run reuses the reference run's outputs of the layers below the
perturbed one (``_skip_below``): the KL is the same, bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from kvlens.model.architecture import decoder_layers
from kvlens.model.hooks import attention_override
from kvlens.quant import QuantSpec, fake_quantize

PROBE_BITS = 2
PROBE_GROUP = 32


def layer_kl(model, input_ids, layers: Sequence[int], progress: Callable | None = None,
             group_size: int = PROBE_GROUP) -> list[float]:
    """Mean next-token KL(exact || probe) when only one layer's K/V are probe-quantized."""
    spec = QuantSpec(PROBE_BITS, "per-token", group_size)

    def probe(x):
        return fake_quantize(x, spec).to(x.dtype)

    out = []
    with _replaced_kl(model, input_ids, keep=input_ids.shape[1]) as kl:
        for i, layer in enumerate(layers):
            out.append(kl(layer, probe, probe))
            if progress:
                progress(i + 1, len(layers), f"sensitivity layer {layer}")
    return out


def weights_from(kl: Sequence[float], probe_errors: Sequence[float]) -> list[float]:
    """``KL_l / e_l`` normalised to mean 1 (a layer with zero probe error gets the mean)."""
    raw = [k / e if e > 0 else None for k, e in zip(kl, probe_errors)]
    known = [r for r in raw if r is not None]
    fill = sum(known) / len(known) if known else 1.0
    raw = [fill if r is None else r for r in raw]
    mean = sum(raw) / len(raw)
    return [r / mean if mean > 0 else 1.0 for r in raw]


@contextmanager
def perturbed_kl(model, input_ids, keep: int) -> Iterator[Callable[..., float]]:
    """Yield ``kl(layer, key=None, value=None)``: the mean next-token KL(exact || perturbed)
    over the last ``keep`` positions of ``input_ids`` when ``key`` / ``value`` (``[B, Hkv, T,
    D]`` tensors) are added to that layer's keys / values (post-RoPE, as attention reads
    them). Pass a candidate's reconstruction minus the captured tensor: a lossless candidate
    then perturbs nothing."""
    def added(delta):
        return None if delta is None else lambda x: x + delta.to(x.device, x.dtype)

    with _replaced_kl(model, input_ids, keep) as kl:
        yield lambda layer, key=None, value=None: kl(layer, added(key), added(value))


@contextmanager
def _replaced_kl(model, input_ids, keep: int) -> Iterator[Callable[..., float]]:
    """Yield ``kl(layer, key_fn=None, value_fn=None)``: the mean next-token KL(exact ||
    changed) over the last ``keep`` positions when that layer's attention reads
    ``key_fn(key)`` / ``value_fn(value)`` (None: unchanged)."""
    target: dict = {}

    def make(orig):
        def fn(module, query, key, value, attention_mask, **kwargs):
            if module.layer_idx == target.get("layer"):
                if target.get("key") is not None:
                    key = target["key"](key)
                if target.get("value") is not None:
                    value = target["value"](value)
            return orig(module, query, key, value, attention_mask, **kwargs)
        return fn

    layers = decoder_layers(model)
    outputs: dict[int, object] = {}

    def logits():
        out = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep)
        return out.logits[:, -keep:].float()  # a new tensor: Reference.kl changes it in place

    with torch.no_grad(), attention_override(model, make):
        with _record_outputs(layers, outputs):
            ref = Reference(logits())

        def kl(layer: int, key_fn=None, value_fn=None) -> float:
            target.update(layer=layer, key=key_fn, value=value_fn)
            try:
                with _skip_below(layers, layer, outputs):
                    return ref.kl(logits())
            finally:
                target.clear()

        yield kl


class Reference:
    """The exact run's next-token distributions ``p``, for ``kl(changed logits)``: the mean
    over positions of ``KL(p || q) = log E_p[exp(x)] - E_p[x]``, ``x = d - c``, with ``d = z' -
    z`` the change of the logits and ``c`` any constant per position (the softmax's normaliser
    cancels, and so does a shift of a position's logits). With ``c = E_p[d]`` the ``x_i`` are
    small where the change is, and ``E_p[exp(x)] = 1 + E_p[expm1(x)]`` keeps their digits:
    more accurate in float32 than ``sum_i p_i (log p_i - log q_i)`` (tested against float64),
    and three dot products with ``p`` and one ``expm1`` over the vocabulary against a
    log-softmax and three more passes (at a large vocabulary the LM head's logits are most of
    a perturbed run's cost). ``E_p`` divides by ``sum_i p_i`` as computed (1 up to rounding)."""

    #: above this a change's ``expm1`` could overflow float32: log-sum-exp is used instead
    LARGEST_EXP = 60.0

    def __init__(self, logits):
        self.logits = logits
        self.p = torch.log_softmax(logits, -1).exp()
        self.total = self.p.sum(-1)  # sum_i p_i: 1 up to rounding

    def kl(self, changed) -> float:
        """Mean ``KL(p || softmax(changed))`` over positions (each at least 0); ``changed``
        (the perturbed run's float32 logits, the reference's shape) is overwritten."""
        def mean(x):  # E_p[x] per position
            return torch.einsum("...v,...v->...", self.p, x) / self.total

        x = changed.sub_(self.logits)
        x.sub_(mean(x).unsqueeze(-1))
        below = mean(x)  # 0 up to rounding
        if float(x.amax()) <= self.LARGEST_EXP:
            kl = torch.log1p(mean(x.expm1_())) - below
        else:
            logp = torch.log_softmax(self.logits, -1)  # rarely needed: not kept
            kl = torch.logsumexp(x.add_(logp), -1) - torch.log(self.total) - below
        # each position's KL is >= 0; float32 rounding can leave about -1e-8 where the
        # change is that small (a random model's keys): 0 there
        return float(kl.clamp_(min=0).mean())


@contextmanager
def _record_outputs(layers: Sequence, outputs: dict[int, object]) -> Iterator[None]:
    """Keep each decoder layer's output of the run inside the block (by position in
    ``layers``)."""
    def hook(_idx):
        def fn(module, args, output):
            outputs[_idx] = output
        return fn

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _skip_below(layers: Sequence, layer: int, outputs: dict[int, object]) -> Iterator[None]:
    """Decoder layers below ``layer`` return their recorded output instead of computing it
    (their inputs are the reference run's: only ``layer`` and above are perturbed)."""
    skipped = [(i, m) for i, m in enumerate(layers) if i < layer and i in outputs]
    for i, m in skipped:
        m.forward = (lambda *args, _out=outputs[i], **kwargs: _out)
    try:
        yield
    finally:
        for _, m in skipped:
            del m.forward
