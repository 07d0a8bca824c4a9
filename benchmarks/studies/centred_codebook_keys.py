"""Write the centred variant of a vLLM TurboQuant setting as a config file: the same layers
(codebook keys, per-token values, boundary layers exact, coded before attention) with the
codebook-key layers' keys stored centred (``center_keys``) on the post-RoPE mean key of each
layer and KV head, measured on a capture (``kvlens.quant.centering.key_mean``: the mean over
every sample and token). docs/lab-notes/codebooks.md ("Centred codebook keys") has the measurement.

    kvlens capture -o smol.h5                                    # SmolLM2, the default model
    python benchmarks/studies/centred_codebook_keys.py smol.h5 -o tq4-centred.json
    kvlens generate --eval kld --json --eval-tokens 1024 \\
        --compare vllm:turboquant_4bit_nc,tq4-centred.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from kvlens.capture.store import open_capture
from kvlens.config import centre_codebook_keys, save_config
from kvlens.deploy import engine_config
from kvlens.quant.centering import key_mean


def centred_setting(capture: str, setting: str):
    """The ``KVConfig`` of ``setting`` with its codebook keys centred on ``capture``'s means."""
    with open_capture(capture) as cap:
        config = engine_config(setting, num_layers=cap.meta.num_layers).config
        means = {idx: key_mean(cap.layer(idx).read("k")).tolist() for idx in cap.layers
                 if config.layer(idx).key_codebook is not None}
    centred = centre_codebook_keys(config, means, name=f"{setting}+centred")
    return replace(centred, description=f"{config.description}, codebook keys centred on the "
                                        f"post-RoPE means of {capture}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", help="capture file (kvlens capture) of the model to run")
    parser.add_argument("-o", "--output", required=True, help="config file to write")
    parser.add_argument("--setting", default="vllm:turboquant_4bit_nc",
                        help="a vllm:turboquant_* setting (default: %(default)s)")
    args = parser.parse_args(argv)
    config = centred_setting(args.capture, args.setting)
    save_config(config, args.output)
    print(f"{args.output}: {config.name}, keys centred in layers {sorted(config.key_means)}")


if __name__ == "__main__":
    main()
