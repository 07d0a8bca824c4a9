"""A model-level check of cross-layer prediction (docs/lab-notes/codebooks.md "Cross-layer prediction"):
KL divergence of a model's next-token distribution (SmolLM2 or Gemma3) with fake-quantized keys and values, with and
without AQUA-KV-style prediction, on the built-in held-out text.

    python benchmarks/studies/predict_kld.py CAPTURE.h5 [--tokens 2048] [--bits 2,3] [--model GGUF]
        [--predictors chain,values-from-keys]

What it does. The predictors are fitted on the capture (every sample; the capture corpus, not
the held-out text they are scored on), layer after layer on the *reconstructed* tensors of the
chain (``kvlens.quant.predict``), for each bit width. Then one forward pass over the first
``--tokens`` tokens of the held-out text with forward hooks on every layer's ``k_proj`` and
``v_proj`` (Llama: their outputs are the pre-RoPE keys and the values, so the model applies RoPE
to the reconstructed keys itself): plain ``Q(x)`` or predicted ``p + Q(x - p)``, where ``p``
reads the previous layer's reconstruction *in this forward pass* (quantization errors propagate
through the model, as in a decoder). Keys per-channel G64 (pre-RoPE), values per-token G64.
Against the exact model: mean KL(exact || quantized) over positions (the logits at position
``t`` score token ``t + 1``), top-1 agreement, and the paired difference predict - plain with a
95% bootstrap interval over blocks of 64 positions.

Predictors (``--predictors``): ``chain`` is the AQUA-KV chain above (keys from layer ``l-1``'s
keys, values from the layer's keys and layer ``l-1``'s values); ``values-from-keys`` predicts
only the values, from the same layer's reconstructed keys (no link between layers; the keys are
coded plain).

Equal bits. The maps are model-side bytes (``kvlens.quant.predict.predictor_bytes``, float16),
so a predicted cache at ``b`` code bits costs ``b`` plus the maps spread over the held tokens.
The second table gives what prediction is worth in plain code bits (where the plain KLD,
log-linear between the measured bit widths, equals the predicted one) and the context at which
the maps cost that much: ``map bits / (worth x 2 x KV heads x head_dim)`` tokens per layer for
one sequence. Shorter than that, spending the maps' bytes on plain code bits is the better use.

What it does not model: every token is quantized (no residual window, no exact sinks), the
per-channel groups are formed over the whole prefill (a cache would form them as its window
flushes), and a single forward call: a storage-free proxy, paired across configurations.
``CAPTURE`` must be a capture of ``--model``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from kvlens.capture.store import open_capture
from kvlens.evaluation.kld import load_eval_text
from kvlens.evaluation.stats import bootstrap_indices, percentile_interval
from kvlens.model.architecture import describe
from kvlens.model.load import load_model
from kvlens.quant import QuantSpec, fake_quantize
from kvlens.quant.predict import (
    DEFAULT_RIDGE,
    fit_ridge,
    from_token_features,
    predictor_bytes,
    quantize_residual,
    token_features,
)

G = 64
UNIT = 64  # positions per bootstrap block


def _specs(bits: int):
    return QuantSpec(bits, "per-channel", G), QuantSpec(bits, "per-token", G)


PREDICTORS = ("chain", "values-from-keys")


@dataclass(frozen=True)
class LayerFit:
    """One layer's predictors: keys from the previous layer's keys (``key``; ``key_mean``
    instead on the first layer of a chain; neither: keys coded plain) and values from the
    layer's keys and, with ``previous_values``, the previous layer's values."""

    key: object
    key_mean: torch.Tensor | None
    value: object
    previous_values: bool
    bytes: int  # the stored maps (float16 weights and intercepts)


def fit_chain(path: str, bits: int, predictors: str = "chain") -> list[LayerFit]:
    """Per layer, the predictors fitted along the chain of reconstructions on every sample of
    the capture (``predictors``: one of ``PREDICTORS``)."""
    kspec, vspec = _specs(bits)
    fits = []
    with open_capture(path) as cap:
        heads, dim = cap.meta.num_key_value_heads, cap.meta.head_dim
        prev_k = prev_v = None
        for layer in cap.layers:
            data = cap.layer(layer)
            k, v = data.read("k_pre").float(), data.read("v").float()
            kfit = kmean = None
            if predictors == "values-from-keys":
                k_hat, key_inputs = fake_quantize(k, kspec), None
            else:
                if prev_k is None:
                    kp = k.mean(dim=(0, 2), keepdim=True).expand_as(k)
                    kmean, key_inputs = kp[0, :, 0], 0
                else:
                    (kfit, kp), key_inputs = fit([prev_k], k), 1
                k_hat = quantize_residual(k, kp, lambda r: fake_quantize(r, kspec))
            with_prev = predictors == "chain" and prev_v is not None
            vfit, vp = fit([k_hat] + ([prev_v] if with_prev else []), v)
            v_hat = quantize_residual(v, vp, lambda r: fake_quantize(r, vspec))
            held = predictor_bytes(heads, dim, 1 + with_prev) + (
                0 if key_inputs is None else predictor_bytes(heads, dim, key_inputs))
            fits.append(LayerFit(kfit, kmean, vfit, with_prev, held))
            prev_k, prev_v = k_hat, v_hat
    return fits


def fit(inputs, target):
    """The predictor of ``target`` ``[B, H, T, D]`` from ``inputs`` on every sample, and its
    prediction of them."""
    b, h, t, d = target.shape
    x = token_features(*inputs)
    y = token_features(target)
    f = fit_ridge(x.reshape(b * t, x.shape[-1]), y.reshape(b * t, y.shape[-1]), DEFAULT_RIDGE)
    return f, from_token_features(f(x), h, d)


class Hooks:
    """Forward hooks that replace every layer's pre-RoPE keys and values by their plain or
    predicted fake quantization, the chain's state carried within one forward pass.

    Llama: ``k_proj`` and ``v_proj`` outputs are the pre-RoPE keys and the values. Gemma3: the
    keys are normalised (``k_norm``) after ``v_proj`` has run, so ``k_proj``'s output is kept,
    both reconstructions are made when ``v_proj`` runs (the keys through the layer's own
    ``k_norm``) and ``k_norm``'s output is replaced by the key reconstruction."""

    def __init__(self, model, bits: int, fits=None):
        self.kspec, self.vspec = _specs(bits)
        self.fits = fits
        self.prev_k = self.prev_v = self.cur_k = None
        self.raw_k = None
        self.inside_norm = False
        info = describe(model)
        self.heads, self.dim = info.num_key_value_heads, info.head_dim
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            norm = getattr(attn, "k_norm", None)
            hooks = ((attn.k_proj, self._keep_raw), (attn.v_proj, self._values_after_norm(i, norm)),
                     (norm, self._normed_keys)) if norm is not None else (
                (attn.k_proj, self._keys(i)), (attn.v_proj, self._values(i)))
            for module, hook in hooks:
                self.handles.append(module.register_forward_hook(hook))

    def _split(self, out):
        b, t, _ = out.shape
        return out.float().reshape(b, t, self.heads, self.dim).permute(0, 2, 1, 3)

    @staticmethod
    def _merge(hat, like):
        b, h, t, d = hat.shape
        return hat.permute(0, 2, 1, 3).reshape(b, t, h * d).to(like.dtype)

    def key_hat(self, layer: int, x):
        """Layer ``layer``'s pre-RoPE keys ``[B, H, T, D]`` -> their reconstruction."""
        code = lambda r: fake_quantize(r, self.kspec)  # noqa: E731
        fit = None if self.fits is None else self.fits[layer]
        if fit is None or (fit.key is None and fit.key_mean is None):
            hat = code(x)
        else:
            p = (fit.key_mean[None, :, None, :].expand_as(x) if fit.key is None else
                 from_token_features(fit.key(token_features(self.prev_k)), self.heads, self.dim))
            hat = quantize_residual(x, p, code)
        # this layer's values and the next layer's keys read this reconstruction
        self.cur_k = self.prev_k = hat
        return hat

    def value_hat(self, layer: int, x):
        code = lambda r: fake_quantize(r, self.vspec)  # noqa: E731
        if self.fits is None:
            hat = code(x)
        else:
            fit = self.fits[layer]
            inputs = [self.cur_k] + ([self.prev_v] if fit.previous_values else [])
            p = from_token_features(fit.value(token_features(*inputs)), self.heads, self.dim)
            hat = quantize_residual(x, p, code)
        self.prev_v = hat
        return hat

    def _keys(self, layer):
        return lambda _m, _i, out: self._merge(self.key_hat(layer, self._split(out)), out)

    def _values(self, layer):
        return lambda _m, _i, out: self._merge(self.value_hat(layer, self._split(out)), out)

    def _keep_raw(self, _module, _inputs, out):
        self.raw_k = out

    def _values_after_norm(self, layer, norm):
        def hook(_module, _inputs, out):
            self.inside_norm = True
            try:
                normed = norm(self._split(self.raw_k).to(self.raw_k.dtype))
            finally:
                self.inside_norm = False
            self.key_hat(layer, normed.float())
            return self._merge(self.value_hat(layer, self._split(out)), out)
        return hook

    def _normed_keys(self, _module, _inputs, out):
        if self.inside_norm:
            return None
        return self.cur_k.to(out.dtype)

    def remove(self):
        for h in self.handles:
            h.remove()


def _compare(exact, logits, rows: int = 256):
    """Per position: KL(softmax(exact) || softmax(logits)) in float64, and whether the argmax
    agrees; ``rows`` positions at a time (a 262k vocabulary makes whole float64 copies large)."""
    kld, same = [], []
    for i in range(0, exact.shape[0], rows):
        p = torch.log_softmax(exact[i:i + rows].double(), -1)
        q = torch.log_softmax(logits[i:i + rows].double(), -1)
        kld.append((p.exp() * (p - q)).sum(-1))
        same.append(p.argmax(-1) == q.argmax(-1))
    return torch.cat(kld), torch.cat(same)


def plain_bits_worth(plain: dict[int, float], bits: int, kld: float) -> float | None:
    """How many plain code bits above ``bits`` give ``kld``: the bit width where the plain
    KLDs (``{bits: KLD}``, log-linear between measured widths) reach it, minus ``bits``. None
    where it lies beyond the measured widths."""
    xs = sorted(plain)
    for lo, hi in zip(xs, xs[1:]):
        a, b = math.log(plain[lo]), math.log(plain[hi])
        if min(a, b) <= math.log(kld) <= max(a, b) and a != b:
            return lo + (hi - lo) * (a - math.log(kld)) / (a - b) - bits
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--bits", default="2,3")
    parser.add_argument("--model", default=None, help="kvlens --model spec (default SmolLM2)")
    parser.add_argument("--predictors", default="chain",
                        help=f"comma-separated, of: {', '.join(PREDICTORS)}")
    args = parser.parse_args(argv)
    kinds = args.predictors.split(",")
    if not set(kinds) <= set(PREDICTORS):
        parser.error(f"--predictors: {args.predictors!r}; allowed: {', '.join(PREDICTORS)}")
    torch.manual_seed(0)
    model, tokenizer, _ = load_model(args.model)
    text, _ = load_eval_text(None)
    ids = torch.tensor([tokenizer(text).input_ids[: args.tokens]])
    info = describe(model)
    elements = 2 * info.num_key_value_heads * info.head_dim
    plain, rows = {}, []
    with torch.no_grad():
        exact = model(ids).logits[0]  # float32 [T, vocab]; compared in float64 chunks
        print("| bits (K per-channel G64 pre-RoPE, V per-token G64) | predictors | KLD plain "
              "| KLD predict | paired (predict - plain) | top-1 plain | top-1 predict |")
        print("|---|---|---:|---:|---:|---:|---:|")
        # paired bootstrap over blocks of 64 positions (kvlens.evaluation.stats's draws)
        n = exact.shape[0] // UNIT * UNIT
        draws = bootstrap_indices(n // UNIT)

        def run(bits, fits):
            hooks = Hooks(model, bits, fits)
            try:
                logits = model(ids).logits[0]
            finally:
                hooks.remove()
            kld, same = _compare(exact, logits)
            return kld, float(same.double().mean())

        for bits in (int(b) for b in args.bits.split(",")):
            base, base_top1 = run(bits, None)
            plain[bits] = float(base.mean())
            for kind in kinds:
                fits = fit_chain(args.capture, bits, kind)
                kld, top1 = run(bits, fits)
                diff = (kld - base)[:n].reshape(-1, UNIT).mean(-1).numpy()
                lo, hi = percentile_interval(diff[draws].mean(-1))
                print(f"| {bits} | {kind} | {plain[bits]:.4f} | {float(kld.mean()):.4f} | "
                      f"{float(diff.mean()):+.4f} [{lo:+.4f}, {hi:+.4f}] | {base_top1:.3f} | "
                      f"{top1:.3f} |", flush=True)
                rows.append((bits, kind, float(kld.mean()),
                             sum(f.bytes for f in fits) / len(fits)))
    print()
    print("| bits | predictors | maps per layer (bytes) | worth in plain code bits "
          "| break-even context (tokens, one sequence) |")
    print("|---|---|---:|---:|---:|")
    for bits, kind, kld, held in rows:
        worth = plain_bits_worth(plain, bits, kld)
        even = ("n/a" if worth is None or worth <= 0
                else f"{held * 8 / (worth * elements):,.0f}")
        print(f"| {bits} | {kind} | {held:,.0f} | "
              f"{'beyond the measured widths' if worth is None else f'{worth:+.2f}'} | {even} |")


if __name__ == "__main__":
    main()
