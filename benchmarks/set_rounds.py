"""What each round of ``--budget auto``'s set costs against the same round in a pool of its own:
the server's pools (16 rows, the bundled pair), rounds dispatched two ahead as the server does,
the host only (no HTTP), at 1, 4 and 16 busy rows.

    python benchmarks/set_rounds.py [--rows 1,4,16] [--rounds 50] [--repeats 5]

The auto pool's round is forced (the chooser's pick replaced), so each of its rounds runs on the
set's state (the drafter's cache and context kept for the speculative rounds); the fixed pools
are the servers of ``serve_adaptive.py``. Each repeat runs every pool in turn over the same
requests (serve_load's trace); a row reports each pool's median ms per round, the lowest over
the repeats (a shared host's load only adds), and the tokens per row per round. Writes
benchmarks/results/set_rounds.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from serve_load import make_requests

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.decoding.speculation import Ticket
from jaxdd.testing.benchmark import write_result

RESULTS = Path(__file__).parent / "results" / "set_rounds.json"
SHAPE = {"rows": 16, "max_len": 320, "max_prompt": 64, "max_logprobs": 0}
OWN = {"ar": {"method": "ar"}, "ddtree-7": {"method": "ddtree"}, "ddtree-3": {"budget": 3}}


def pools(decoder: SpeculativeDecoder) -> dict[str, RowPool]:
    """Each round in a pool of its own, and in the auto pool (``auto:NAME``), forced."""
    made = {}
    for name, options in OWN.items():
        made[name] = RowPool.serving(decoder, **{"method": "ddtree", **options, **SHAPE})
        auto = RowPool.serving(decoder, method="ddtree", auto=True, **SHAPE)
        auto.chooser.choose = lambda tier, name=name: Ticket(name, tier, time.perf_counter())
        made[f"auto:{name}"] = auto
    return made


def run(pool: RowPool, prompts: list[list[int]], rows: int, rounds: int) -> tuple[float, float]:
    """(median seconds per round, tokens per row per round) of up to ``rounds`` rounds over
    ``rows`` requests (while all run), two in flight, after two to fill the pipeline; every row
    freed after."""
    for prompt in prompts[:rows]:
        pool.admit([pool.check(RowRequest(prompt, SHAPE["max_len"] - len(prompt) - 1, []))])
    pool.collect()
    seconds, tokens, last = [], [], time.perf_counter()
    while len(seconds) < rounds + 2 and pool.busy == rows:
        pool.dispatch()
        if pool.in_flight >= 2:
            updates = pool.collect()
            now = time.perf_counter()
            seconds.append(now - last)
            tokens.append(statistics.mean(len(u.tokens) for u in updates.values()))
            last = now
    while pool.in_flight:
        pool.collect()
    for row, _ in pool.owners():
        pool.release(row)
    return statistics.median(seconds[2:]), statistics.mean(tokens[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16", help="comma-separated busy rows")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    busy = [int(r) for r in args.rows.split(",")]
    decoder = SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))
    prompts = [r["prompt"] for r in make_requests(max(busy), 0.0, seed=3)]
    made = pools(decoder)
    for pool in made.values():  # compiled, untimed
        for rows in busy:
            run(pool, prompts, rows, 4)
    trials = {(rows, name): [] for rows in busy for name in made}
    for _ in range(args.repeats):
        for rows in busy:
            for name, pool in made.items():
                trials[rows, name].append(run(pool, prompts, rows, args.rounds))
    table = []
    for (rows, name), runs in trials.items():
        ms = min(seconds for seconds, _ in runs) * 1e3
        own = min(seconds for seconds, _ in trials[rows, name.removeprefix("auto:")]) * 1e3
        row = {"rows": rows, "round": name, "ms_per_round": ms, "over_own_pool": ms / own}
        table.append(row | {"tokens_per_row": runs[0][1], "trials_ms": [s * 1e3 for s, _ in runs]})
        print(f"{rows:2d} rows {name:14s} {ms:6.2f} ms/round ({ms / own:.2f}x its own pool's)")
    settings = {"shape": SHAPE, "rounds": args.rounds, "repeats": args.repeats}
    write_result(RESULTS, {"settings": settings, "rows": table})


if __name__ == "__main__":
    main()
