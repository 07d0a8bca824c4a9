"""Write a "fresh span" of the built-in held-out text for ``kvlens generate --text``: tokens
4200-8400 in a model's tokenizer, which no ``recommend`` choice reads and the default 4096-token
``--eval kld`` does not reach (docs/evaluation.md: the held-out text).

    python benchmarks/studies/fresh_span.py fresh.txt                       # SmolLM2 (the default)
    python benchmarks/studies/fresh_span.py fresh-gemma.txt --model GGUF    # another model's tokens
"""

from __future__ import annotations

import argparse

from kvlens.evaluation.kld import load_eval_text
from kvlens.model.load import load_model

START, END = 4200, 8400


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="text file to write")
    parser.add_argument("--model", default=None, help="kvlens --model spec (default SmolLM2)")
    args = parser.parse_args(argv)
    _, tokenizer, _ = load_model(args.model)
    text, _ = load_eval_text(None)
    ids = tokenizer(text).input_ids
    if len(ids) < END:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than {END}")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(tokenizer.decode(ids[START:END]))
    print(f"wrote tokens {START}-{END} of {len(ids)} to {args.output}")


if __name__ == "__main__":
    main()
