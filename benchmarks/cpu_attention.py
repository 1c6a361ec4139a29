"""A verify's attention over pools of pages on CPU: the C++ kernel against XLA's forms.

    PYTHONPATH=$PWD python benchmarks/cpu_attention.py [--repeats 200] [--alternations 5]

One call of the attention at the demo pair's widths (4 heads, latent 64 + rope 16, fp32) over
serve_load's pool (16 rows of 6 pages of 64 slots, tables shuffled over the pool): the C++ kernel
(``jaxdd.runtime.cpu_kernels.tree_attention``, each row's committed pages read in place), XLA over
the pages (``tree_attention_reference``: every page of each row's table gathered into a copy,
as the absorbed form reads a pool) and XLA over contiguous rows (the same cache as each row's own
buffer: jaxdd before the pages). Rounds of a DFlash block (8 tokens) and of a DDTree-16 tree
(17), rows whose committed lengths are serve_load's (uniform over 20-320 slots) or near full
(300-384), and one row alone. Median milliseconds of each, all in one run.

Then whole rounds at batch 1, where the kernel's calls are smallest: the demo pair decoding 6
HumanEval prompts (their last 96 tokens, 48 new tokens, greedy) in AR, DFlash and DDTree-16, with
the kernel and with XLA's absorbed form (a backend that declines the kernel), alternating in one
process; ms per round, the median of the alternations, and whether the tokens are the same.
Writes benchmarks/results/cpu_attention.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from humaneval import humaneval_prompts

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.runtime import cpu_kernels
from jaxdd.runtime.backend import Backend
from jaxdd.testing.benchmark import median_ms, write_result
from pallas_kernels.tree_attention import tree_attention_reference
from pallas_kernels.tree_operands import TreeOperands

RESULTS = Path(__file__).parent / "results"
HEADS, LATENT, ROPE, PAGE, ROW_PAGES = 4, 64, 16, 64, 6
# (rows, tokens, committed lengths low..high)
CASES = {
    "DFlash, 16 rows, serve_load lengths": (16, 8, (20, 320)),
    "DFlash, 16 rows, near full": (16, 8, (300, 384)),
    "DDTree-16, 16 rows, serve_load lengths": (16, 17, (20, 320)),
    "DFlash, 1 row": (1, 8, (20, 320)),
}


def operands(rows: int, tokens: int, lengths: tuple[int, int], seed: int = 0) -> dict:
    """Random queries, pool, tables and new rows for one case (each token sees the ones before)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    pool = 1 + rows * ROW_PAGES
    causal = np.tril(np.ones((tokens, tokens), bool))
    return {
        "q": (normal(rows, tokens, HEADS, LATENT), normal(rows, tokens, HEADS, ROPE)),
        "pool": (normal(pool, PAGE, LATENT), normal(pool, PAGE, ROPE)),
        "length": jnp.asarray(rng.integers(*lengths, rows), jnp.int32),
        "tail": (normal(rows, tokens, LATENT), normal(rows, tokens, ROPE)),
        "mask": jnp.asarray(np.broadcast_to(causal, (rows, tokens, tokens))),
        "pages": jnp.asarray(1 + rng.permutation(rows * ROW_PAGES).reshape(rows, ROW_PAGES)),
    }


def forms(x: dict) -> dict:
    """Each form as a jitted call of no arguments."""
    scale = LATENT**-0.5
    rows = x["length"].shape[0]
    contiguous = tuple(p[x["pages"]].reshape(rows, -1, p.shape[-1]) for p in x["pool"])
    paged = jax.jit(functools.partial(cpu_kernels.tree_attention, scale=scale))
    reference = jax.jit(functools.partial(tree_attention_reference, scale=scale))
    ops = TreeOperands(*x["q"], *x["pool"], x["length"], *x["tail"], x["mask"], x["pages"])
    rows_ops = ops.replace(cache_latent=contiguous[0], cache_rope=contiguous[1], pages=None)
    return {
        "C++ kernel over pages": lambda: paged(ops),
        "XLA over pages (gathered)": lambda: reference(ops),
        "XLA over contiguous rows": lambda: reference(rows_ops),
    }


@dataclasses.dataclass(frozen=True)
class XlaAttention(Backend):
    """The CPU backend with the absorbed form in XLA's einsums (the kernel declined)."""

    def attention_kernel(self, attention, paged):
        return None if attention == "absorbed" else super().attention_kernel(attention, paged)


ROUNDS = {"ar": {"method": "ar"}, "dflash": {"method": "dflash"}}
ROUNDS["ddtree-16"] = {"method": "ddtree", "budget": 16}


def rounds(alternations: int) -> dict:
    """ms per round at batch 1 with the kernel and with XLA, alternating in this process."""
    target = jaxdd.load_target(DEMO / "target", "float32")
    drafter = jaxdd.load_drafter(DEMO / "drafter", "float32")
    sides = {"kernel": Backend("cpu"), "xla": XlaAttention("cpu")}
    decoders = {side: SpeculativeDecoder(target, drafter, backend=b) for side, b in sides.items()}
    prompts = humaneval_prompts(6, keep=96)

    def run(decoder, options):
        results = [
            decoder.generate(p, max_new_tokens=48, stop_token_ids=[], **options) for p in prompts
        ]
        count = sum(len(r.acceptance_lengths) for r in results)
        return 1e3 * sum(r.decode_seconds for r in results) / count, [r.tokens for r in results]

    times, tokens = {}, {}
    for i in range(alternations):
        for side, decoder in decoders.items():
            for name, options in ROUNDS.items():
                if i == 0:
                    run(decoder, options)  # compiles
                ms, tokens[name, side] = run(decoder, options)
                times.setdefault(name, {}).setdefault(side, []).append(round(ms, 3))
    return {
        name: {
            "ms_per_round": sides_ms,
            "kernel_over_xla": round(
                statistics.median(sides_ms["kernel"]) / statistics.median(sides_ms["xla"]), 3
            ),
            "same_tokens": tokens[name, "kernel"] == tokens[name, "xla"],
        }
        for name, sides_ms in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--alternations", type=int, default=5)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("cpu_attention: no C++ compiler builds the CPU kernels here")
    cases = []
    for name, (rows, tokens, lengths) in CASES.items():
        timed = {
            form: median_ms(call, args.repeats)
            for form, call in forms(operands(rows, tokens, lengths)).items()
        }
        kernel = timed["C++ kernel over pages"]
        ratios = {form: round(ms / kernel, 2) for form, ms in timed.items()}
        cases.append(
            {"case": name, "ms": {k: round(v, 4) for k, v in timed.items()}, "vs kernel": ratios}
        )
        print(name, {k: f"{v:.3f} ms" for k, v in timed.items()})
    report = {
        "command": "python benchmarks/cpu_attention.py",
        "shape": {
            "heads": HEADS,
            "latent": LATENT,
            "rope": ROPE,
            "page": PAGE,
            "row_pages": ROW_PAGES,
        },
        "cases": cases,
        "rounds_batch_1": rounds(args.alternations),
    }
    print(report["rounds_batch_1"])
    write_result(RESULTS / "cpu_attention.json", report)


if __name__ == "__main__":
    main()
