"""A refactor's promise, measured: the same tokens and the same speed as an earlier commit.

    python benchmarks/ab_commits.py [--base 1d110ab] [--head HEAD] [--alternations 3] [--prompts 6]
                                    [--serve-alternations 2]

Both commits are checked out into temporary worktrees (removed at the end) and measured in
alternation in one run, so a slow spell of a shared machine hits both alike:

- rounds: the bundled pair (fp32, batch 1, HumanEval prompts, no stop tokens) through
  ``SpeculativeDecoder.generate`` for AR, DFlash, DDTree-16 and seeded sampled DFlash and DDTree:
  every token must be the same on both commits. Each commit's process stays up, compiles every
  run, then takes one (run, prompt) at a time, the two sides in a seeded random order: a slow
  spell of the host lasts seconds and hits both sides of a pair alike. A run's speed is the
  median over its pairs of head's / base's time per round;
- serving: ``benchmarks/serve_load.py --clients 16`` of each commit (its own server), throughput
  of the continuous batching at T=0 and T=0.7.

Writes benchmarks/results/ab_commits.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from humaneval import humaneval_prompts

from jaxdd.testing.benchmark import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = {
    "ar": {"method": "ar"},
    "dflash": {"method": "dflash"},
    "ddtree": {"method": "ddtree", "budget": 16},
    "dflash_sampled": {"method": "dflash", "sampled": True},
    "ddtree_sampled": {"method": "ddtree", "budget": 16, "sampled": True},
}
# Run inside a commit's tree: only names both commits have (the public API and the engine).
# Compiles every (run, prompt) once, says "ready", then answers "run prompt" lines.
WORKER = """
import json, sys
import jaxdd
from jaxdd.decoding.engine import SpeculativeDecoder
prompts, runs, max_new = json.loads(sys.stdin.readline())
demo = "jaxdd/demo/kimi-mini"
target = jaxdd.load_target(demo + "/target", "float32")
drafter = jaxdd.load_drafter(demo + "/drafter", "float32")
decoder = SpeculativeDecoder(target, drafter)
def go(name, i):
    run = runs[name]
    options = {k: v for k, v in run.items() if k != "sampled"}
    sampling = jaxdd.Sampling(0.7, 0.95, 0, 100 + i) if run.get("sampled") else jaxdd.Sampling()
    return decoder.generate(prompts[i], max_new_tokens=max_new, stop_token_ids=[],
                            sampling=sampling, **options)
for name in runs:
    for i in range(len(prompts)):
        go(name, i)
print("ready", flush=True)
for line in sys.stdin:
    name, i = line.split()
    result = go(name, int(i))
    ms = 1e3 * result.decode_seconds / len(result.acceptance_lengths)
    print(json.dumps({"tokens": result.tokens, "ms_per_round": ms}), flush=True)
"""


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """A detached checkout of ``commit``, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="jaxdd-ab-")) / "tree"
    git = ["git", "-C", str(ROOT)]
    subprocess.run([*git, "worktree", "add", "-q", "--detach", str(folder), commit], check=True)
    try:
        yield folder
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(folder)], check=False)


def environment(tree: Path) -> dict[str, str]:
    """The environment of a process that imports ``tree``'s package."""
    return {**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1", "JAX_PLATFORMS": "cpu"}


def run_in(tree: Path, args: list[str]) -> str:
    """``python args`` with ``tree`` as the working directory and the package it imports."""
    done = subprocess.run(
        [sys.executable, *args], cwd=tree, env=environment(tree), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"jaxdd: {tree}: {' '.join(args[:2])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


@contextlib.contextmanager
def worker(tree: Path, setup: str) -> Iterator[Callable[[str, int], dict]]:
    """A commit's ``WORKER`` process, compiled: ``ask(run, prompt)`` answers one generation."""
    with tempfile.TemporaryFile("w+") as log:  # not a pipe: one nobody reads could stall it
        process = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            cwd=tree,
            env=environment(tree),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )

        def answer(expected: str) -> str:
            """The worker's next line, which must start with ``expected`` (a line a commit's
            loader printed would shift every answer after it)."""
            line = process.stdout.readline()
            if not line.startswith(expected):
                log.seek(0)
                raise SystemExit(
                    f"jaxdd: {tree}: the worker said {line[:200]!r}:\n{log.read()[-2000:]}"
                )
            return line

        def ask(name: str, prompt: int) -> dict:
            process.stdin.write(f"{name} {prompt}\n")
            process.stdin.flush()
            return json.loads(answer("{"))

        try:
            process.stdin.write(setup + "\n")
            process.stdin.flush()
            answer("ready")
            yield ask
        finally:
            process.stdin.close()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def rounds(trees: dict[str, Path], prompts, alternations: int, max_new: int) -> dict:
    """Per run: tokens equal on every side and pair, each side's ms per round per (alternation,
    prompt), and the median of the pairs' head / base ratios."""
    setup = json.dumps([prompts, RUNS, max_new])
    times = {side: {name: [] for name in RUNS} for side in trees}
    same = dict.fromkeys(RUNS, True)
    order = random.Random(0)
    with contextlib.ExitStack() as stack:
        ask = {side: stack.enter_context(worker(tree, setup)) for side, tree in trees.items()}
        for i in range(alternations):
            for name in RUNS:
                for prompt in range(len(prompts)):
                    answers = {s: ask[s](name, prompt) for s in order.sample(list(trees), 2)}
                    same[name] &= len({json.dumps(a["tokens"]) for a in answers.values()}) == 1
                    for side, answer in answers.items():
                        times[side][name].append(answer["ms_per_round"])
            so_far = {n: round(head_over_base(times, n), 3) for n in RUNS}
            print(f"after alternation {i}:", so_far)
    return {
        name: {
            "same_tokens": same[name],
            **{f"{side}_ms_per_round": times[side][name] for side in trees},
            "head_over_base": head_over_base(times, name),
        }
        for name in RUNS
    }


def head_over_base(times: dict, name: str) -> float:
    """The median of ``name``'s paired head / base times (the sides' keys in that order)."""
    base, head = times
    return statistics.median(
        h / b for h, b in zip(times[head][name], times[base][name], strict=True)
    )


def serving(trees: dict[str, Path], alternations: int) -> dict:
    """Each side's serve_load throughput at 16 clients, per temperature and alternation."""
    found = {side: {} for side in trees}
    for _ in range(alternations):
        for side, tree in trees.items():
            run_in(tree, ["benchmarks/serve_load.py", "--clients", "16", "--repeats", "1"])
            report = json.loads((tree / "benchmarks/results/serve_load.json").read_text())
            for row in report["rows"]:
                key = f"T={row['temperature']}"
                throughput = row["continuous"]["tokens_per_second"]
                found[side].setdefault(key, []).append(throughput)
            print(side, {k: v[-1] for k, v in found[side].items()})
    base, head = trees
    return {
        key: {
            **{f"{side}_tokens_per_s": found[side][key] for side in trees},
            "head_over_base": statistics.median(found[head][key])
            / statistics.median(found[base][key]),
        }
        for key in found[base]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="1d110ab")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--serve-alternations", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "ab_commits.json")
    args = parser.parse_args()
    prompts = humaneval_prompts(args.prompts, keep=96)
    with worktree(args.base) as base, worktree(args.head) as head:
        commits = {
            side: subprocess.check_output(
                ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], text=True
            ).strip()
            for side, tree in (("base", base), ("head", head))
        }
        trees = {"base": base, "head": head}
        report = {
            "commits": commits,
            "settings": vars(args) | {"out": str(args.out)},
            "rounds": rounds(trees, prompts, args.alternations, args.max_new_tokens),
            "serve_load_16_clients": serving(trees, args.serve_alternations)
            if args.serve_alternations
            else {},
        }
    print(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1)[:3000])
    write_result(args.out, report)


if __name__ == "__main__":
    main()
