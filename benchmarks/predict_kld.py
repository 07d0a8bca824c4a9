"""A model-level check of cross-layer prediction (docs/codebooks.md "Cross-layer prediction"):
KL divergence of a model's next-token distribution (SmolLM2 or Gemma3) with fake-quantized keys and values, with and
without AQUA-KV-style prediction, on the built-in held-out text.

    python benchmarks/predict_kld.py CAPTURE.h5 [--tokens 2048] [--bits 2,3] [--model GGUF]

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

What it does not model: every token is quantized (no residual window, no exact sinks), the
per-channel groups are formed over the whole prefill (a cache would form them as its window
flushes), and a single forward call: a storage-free proxy, paired across configurations.
``CAPTURE`` must be a capture of ``--model``.
"""

from __future__ import annotations

import argparse

import torch

from kvlens.capture.store import open_capture
from kvlens.evaluation.kld import load_eval_text
from kvlens.evaluation.stats import bootstrap_indices, percentile_interval
from kvlens.model.load import load_model
from kvlens.quant import QuantSpec, fake_quantize
from kvlens.quant.predict import (
    DEFAULT_RIDGE,
    fit_ridge,
    from_token_features,
    quantize_residual,
    token_features,
)

G = 64
UNIT = 64  # positions per bootstrap block


def _specs(bits: int):
    return QuantSpec(bits, "per-channel", G), QuantSpec(bits, "per-token", G)


def fit_chain(path: str, bits: int):
    """Per layer: ``(key_predictor or None, value_predictor)`` fitted along the chain of
    reconstructions on every sample of the capture."""
    kspec, vspec = _specs(bits)
    fits = []
    with open_capture(path) as cap:
        prev_k = prev_v = None
        for layer in cap.layers:
            data = cap.layer(layer)
            k, v = data.read("k_pre").float(), data.read("v").float()
            if prev_k is None:
                kfit, kp = None, k.mean(dim=(0, 2), keepdim=True).expand_as(k)
                kmean = kp[0, :, 0]
            else:
                (kfit, kp), kmean = fit([prev_k], k), None
            k_hat = quantize_residual(k, kp, lambda r: fake_quantize(r, kspec))
            vfit, vp = fit([k_hat] + ([prev_v] if prev_v is not None else []), v)
            v_hat = quantize_residual(v, vp, lambda r: fake_quantize(r, vspec))
            fits.append((kfit, kmean, vfit))
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
        cfg = model.config
        self.heads = cfg.num_key_value_heads
        self.dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
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
        if self.fits is None:
            hat = code(x)
        else:
            kfit, kmean, _ = self.fits[layer]
            p = (kmean[None, :, None, :].expand_as(x) if kfit is None else
                 from_token_features(kfit(token_features(self.prev_k)), self.heads, self.dim))
            hat = quantize_residual(x, p, code)
        # this layer's values and the next layer's keys read this reconstruction
        self.cur_k = self.prev_k = hat
        return hat

    def value_hat(self, layer: int, x):
        code = lambda r: fake_quantize(r, self.vspec)  # noqa: E731
        if self.fits is None:
            hat = code(x)
        else:
            vfit = self.fits[layer][2]
            inputs = [self.cur_k] + ([self.prev_v] if layer > 0 else [])
            p = from_token_features(vfit(token_features(*inputs)), self.heads, self.dim)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--bits", default="2,3")
    parser.add_argument("--model", default=None, help="kvlens --model spec (default SmolLM2)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer, _ = load_model(args.model)
    text, _ = load_eval_text(None)
    ids = torch.tensor([tokenizer(text).input_ids[: args.tokens]])
    with torch.no_grad():
        exact = model(ids).logits[0]  # float32 [T, vocab]; compared in float64 chunks
        print("| bits (K per-channel G64 pre-RoPE, V per-token G64) | KLD plain | KLD predict "
              "| paired (predict - plain) | top-1 plain | top-1 predict |")
        print("|---|---:|---:|---:|---:|---:|")
        # paired bootstrap over blocks of 64 positions (kvlens.evaluation.stats's draws)
        n = exact.shape[0] // UNIT * UNIT
        draws = bootstrap_indices(n // UNIT)
        for bits in (int(b) for b in args.bits.split(",")):
            fits = fit_chain(args.capture, bits)
            kld, top1 = {}, {}
            for name, f in (("plain", None), ("predict", fits)):
                hooks = Hooks(model, bits, f)
                try:
                    logits = model(ids).logits[0]
                finally:
                    hooks.remove()
                kld[name], same = _compare(exact, logits)
                top1[name] = float(same.double().mean())
                del logits
            diff = (kld["predict"] - kld["plain"])[:n].reshape(-1, UNIT).mean(-1).numpy()
            lo, hi = percentile_interval(diff[draws].mean(-1))
            print(f"| {bits} | {float(kld['plain'].mean()):.4f} | "
                  f"{float(kld['predict'].mean()):.4f} | {float(diff.mean()):+.4f} "
                  f"[{lo:+.4f}, {hi:+.4f}] | {top1['plain']:.3f} | {top1['predict']:.3f} |")


if __name__ == "__main__":
    main()
