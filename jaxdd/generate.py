"""``python -m jaxdd.generate``: greedy generation from a target checkpoint.

    python -m jaxdd.generate --checkpoint DIR --prompt-ids 1,2,3 --max-new-tokens 16 [--json]

No demo model is bundled yet; without ``--checkpoint`` this says so and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import jaxdd


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("the prompt is empty")
    return ids


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def greedy(target: jaxdd.Target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding through the latent cache, stopping at an EOS token."""
    cache = target.new_cache(1, len(prompt) + max_new_tokens)
    out = target.forward([prompt], cache)
    generated: list[int] = []
    while True:
        token = int(np.argmax(out.logits[0, -1]))
        generated.append(token)
        if token in target.config.eos_token_ids or len(generated) == max_new_tokens:
            return generated
        out = target.forward([[token]], out.cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdd.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="target checkpoint: HF directory or jaxdd checkpoint")
    parser.add_argument("--prompt-ids", type=parse_ids, help="prompt token ids, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=positive, default=32)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)

    if args.checkpoint is None:
        print("jaxdd: no default model is bundled yet; pass --checkpoint DIR --prompt-ids 1,2,3")
        return 0
    if args.prompt_ids is None:
        parser.error("--prompt-ids is required (models without a tokenizer take token ids)")
    try:
        target = jaxdd.load_target(args.checkpoint, dtype=args.dtype)
        start = time.perf_counter()
        tokens = greedy(target, args.prompt_ids, args.max_new_tokens)
        seconds = time.perf_counter() - start
    except (jaxdd.CheckpointError, jaxdd.ConfigError, jaxdd.InputError) as error:
        print(f"jaxdd: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"method": "ar", "output_ids": tokens, "seconds": seconds}))
    else:
        print(",".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
