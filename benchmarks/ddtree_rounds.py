"""AR vs DFlash vs DDTree (budgets 8..256) on a tiny random target with partly-right drafts, CPU, one run.

    python benchmarks/ddtree_rounds.py [--max-new-tokens 64] [--repeats 3]

Drafts come from the real (random) drafter with the target's own greedy token lifted to the top at 85% of
positions (tests/oracle.py), so rounds accept several tokens. Reports tokens/s, rounds/s and mean acceptance
per method, and the per-stage split of one round (draft, tree build, verify, accept + commit) from separately
jitted stages. Writes benchmarks/results/ddtree_rounds.json and ddtree_rounds.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the reference builders
from oracle import OracleDrafter
from reference import TINY_K2, drafter_config, hf_drafter, hf_greedy, hf_model
from timing import median_ms, timed

import jaxdd
from jaxdd.cache import compact_rows
from jaxdd.speculative import SpeculativeDecoder, draft_stage, limit_round
from jaxdd.tree import accept_path, build_tree

RESULTS = Path(__file__).parent / "results"
BUDGETS = [8, 16, 32, 64, 128, 256]
BLOCK = 8


@functools.partial(jax.jit, static_argnames=("t_spec", "d_spec"))
def _draft(t_spec, tw, d_spec, dw, state, block_len):
    return draft_stage(t_spec.merge(tw), d_spec.merge(dw), state, block_len, BLOCK)[0]


@functools.partial(jax.jit, static_argnames=("t_spec", "taps"))
def _verify(t_spec, tw, cache, tree, taps):
    target = t_spec.merge(tw)
    positions = cache.length[:, None] + tree.depths
    out = target(tree.tokens, positions, cache, tree.visible, taps=taps, form="absorbed")
    return jnp.argmax(target.logits(out.hidden), axis=-1).astype(jnp.int32), out


@jax.jit
def _accept_commit(tree, posterior, out, start, limit, stop_ids):
    path, accepted = accept_path(tree, posterior, BLOCK - 1)
    emitted = jnp.take_along_axis(posterior, path, axis=1)
    produced, stopped, _ = limit_round(emitted, accepted, limit, start, stop_ids, jnp.zeros_like(accepted, bool))
    cache = compact_rows(out.cache, start, path)
    return cache, jnp.take_along_axis(out.taps, path[:, :, None], axis=1), produced, stopped


def stage_split(decoder: SpeculativeDecoder, prompt: list[int], budget: int, max_length: int) -> dict:
    """Median ms of each stage of one DDTree round from the state after the prefill."""
    plan, state = decoder.start(
        [prompt], method="ddtree", max_new_tokens=max_length - len(prompt), budget=budget, stop_token_ids=[]
    )
    limit, stop_ids = plan.limit, plan.stop_ids
    start = state.target_cache.length
    block_len = jnp.clip(limit - start, 1, BLOCK)
    ts, tw, ds, dw = decoder._t_spec, decoder._t_weights, decoder._d_spec, decoder._d_weights
    taps = decoder.drafter.config.target_layer_ids
    build = jax.jit(functools.partial(build_tree, budget=budget))
    logits = _draft(ts, tw, ds, dw, state, block_len)
    tree = build(logits, state.bonus, block_len - 1)
    posterior, out = _verify(ts, tw, state.target_cache, tree, taps)
    return {
        "draft_ms": median_ms(lambda: _draft(ts, tw, ds, dw, state, block_len)),
        "build_ms": median_ms(lambda: build(logits, state.bonus, block_len - 1)),
        "verify_ms": median_ms(lambda: _verify(ts, tw, state.target_cache, tree, taps)),
        "accept_commit_ms": median_ms(lambda: _accept_commit(tree, posterior, out, start, limit, stop_ids)),
    }


def run(decoder, prompts, method, repeats, **kwargs) -> dict:
    def all_prompts():
        return [decoder.generate(p, method=method, stop_token_ids=[], **kwargs) for p in prompts]

    all_prompts()  # compile
    results, seconds = timed(all_prompts, repeats)
    tokens = sum(len(r.tokens) for r in results)
    rounds = sum(r.rounds for r in results)
    return {
        "tokens_per_s": tokens / seconds,
        "rounds_per_s": rounds / seconds,
        "mean_acceptance": tokens / (rounds + len(prompts)),
        "tokens": [r.tokens for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    max_new = args.max_new_tokens

    ref_target = hf_model(TINY_K2, seed=0)
    with tempfile.TemporaryDirectory() as directory:
        ref_target.save_pretrained(Path(directory) / "t")
        hf_drafter(drafter_config(block_size=BLOCK), seed=0).save_pretrained(Path(directory) / "d")
        target = jaxdd.load_target(Path(directory) / "t", dtype="float32")
        drafter = jaxdd.load_drafter(Path(directory) / "d", dtype="float32")

    prompt = np.random.default_rng(0).integers(0, 250, 24).tolist()
    greedy = np.array(prompt + hf_greedy(ref_target, prompt, max_new + BLOCK))
    right = np.random.default_rng(1).random(len(greedy)) < 0.85
    oracle = OracleDrafter(drafter, greedy, right)
    decoder = SpeculativeDecoder(target, oracle)
    expected = greedy[len(prompt) : len(prompt) + max_new].tolist()

    results = {"ar": run(decoder, [prompt], "ar", args.repeats, max_new_tokens=max_new)}
    results["dflash"] = run(decoder, [prompt], "dflash", args.repeats, max_new_tokens=max_new)
    for budget in BUDGETS:
        results[f"ddtree_{budget}"] = run(
            decoder, [prompt], "ddtree", args.repeats, max_new_tokens=max_new, budget=budget
        )
        results[f"ddtree_{budget}"]["stages"] = stage_split(decoder, prompt, budget, len(prompt) + max_new)
    for name, r in results.items():
        r["lossless"] = r.pop("tokens") == [expected]
        stages = r.get("stages")
        share = ""
        if stages:
            overhead = stages["build_ms"] + stages["accept_commit_ms"]
            stages["build_accept_commit_share"] = overhead / sum(v for k, v in stages.items() if k.endswith("_ms"))
            share = f", build+accept+commit {stages['build_accept_commit_share']:.1%} of the round"
        speed = f"{r['tokens_per_s']:.0f} tok/s, acceptance {r['mean_acceptance']:.2f}"
        print(f"{name}: {speed}, lossless={r['lossless']}{share}")

    ar = results["ar"]["tokens_per_s"]
    report = {
        "benchmark": "ddtree_rounds",
        "setup": {
            "target": "tests/reference.py TINY_K2 (fp32)",
            "block_size": BLOCK,
            "max_new_tokens": max_new,
            "drafts": "random drafter + greedy token lifted to the top at 85% of positions",
        },
        "machine": {"platform": platform.platform(), "jax": jax.__version__},
        "results": results,
        "speedup_over_ar": {name: r["tokens_per_s"] / ar for name, r in results.items()},
        "goal": "build + accept + commit <= 15% of the round at budget 64",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ddtree_rounds.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, RESULTS / "ddtree_rounds.png")
    print(f"wrote {RESULTS / 'ddtree_rounds.json'} and ddtree_rounds.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    budgets = BUDGETS
    tree = [results[f"ddtree_{b}"] for b in budgets]
    left.plot(budgets, [r["tokens_per_s"] for r in tree], "o-", label="DDTree")
    for name, style in (("dflash", "--"), ("ar", ":")):
        left.axhline(results[name]["tokens_per_s"], linestyle=style, color="gray", label=name)
    left.set(xscale="log", xlabel="tree budget (nodes)", ylabel="tokens/s", title="throughput (CPU, tiny model)")
    left.legend()
    stages = ["draft_ms", "build_ms", "verify_ms", "accept_commit_ms"]
    bottom = np.zeros(len(budgets))
    for stage in stages:
        values = np.array([r["stages"][stage] for r in tree])
        right.bar([str(b) for b in budgets], values, bottom=bottom, label=stage.removesuffix("_ms"))
        bottom += values
    right.set(xlabel="tree budget (nodes)", ylabel="ms per round", title="one DDTree round, by stage")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
