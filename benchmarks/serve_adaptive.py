"""``python -m jaxdd.serve --budget auto`` against every fixed choice of its set: identical seeded
greedy traces at 1, 4 and 16 concurrent clients through one server per choice, outputs compared.

    python benchmarks/serve_adaptive.py [--method ddtree] [--clients 1,4,16]
                                        [--requests-per-client 3] [--repeats 3]
                                        [--long-prompts TOKENS --checkpoint DIR --drafter DIR]

DDTree's set is its default budget (the drafter's block - 1), half of it and plain decoding;
DFlash's its block and plain decoding. Every server (a fixed choice each, and auto) starts
before any load and is warm (compiled) when the loads run; each repeat sends the same trace
to every server in turn, in a rotated order (the shared host's load drifts over minutes), and
a row reports each server's median tokens/s. Greedy: every server's tokens must equal plain
decoding's, request by request. ``--long-prompts TOKENS`` gives half the requests prompts of
that many tokens (the long half of issue 70's trace); it needs a pair trained for such
contexts (the retrained demo pair of issue 69), named by ``--checkpoint`` and ``--drafter``.
Writes benchmarks/results/serve_adaptive.json (the machine and its load average) and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from serve_load import MAX_PROMPT, make_requests, metric, send_all

from jaxdd.testing.benchmark import plot_by_clients, write_result
from jaxdd.testing.server import started_server

RESULTS = Path(__file__).parent / "results" / "serve_adaptive.json"
MAX_LEN = 320
START_SECONDS = 3 * 3600  # four servers compiling side by side on a shared 2-core host


def choices(method: str, block: int) -> dict[str, list[str]]:
    """Each server's flags by the name of its round (``auto``: the chooser's)."""
    if method == "dflash":
        fixed = {f"dflash-{block}": ["--method", "dflash"]}
    else:
        budget = block - 1
        fixed = {
            f"ddtree-{b}": ["--method", "ddtree", "--budget", str(b)] for b in (budget, budget // 2)
        }
    return {"ar": ["--method", "ar"], **fixed, "auto": ["--method", method, "--budget", "auto"]}


def rounds(url: str) -> dict[str, float]:
    """The server's ``jaxdd:rounds_total`` by spec."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r'^jaxdd:rounds_total\{spec="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {spec: float(count) for spec, count in found}


def healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    return False


def run_load(url: str, requests: list[dict], clients: int) -> dict:
    """One load's tokens/s, its outputs by request seed, its compiles and rounds by spec."""
    compiles, before = metric(url, "compiles_total"), rounds(url)
    start = time.perf_counter()
    results = asyncio.run(send_all(url, requests, clients))
    seconds = time.perf_counter() - start
    after = rounds(url)
    return {
        "tokens_per_second": sum(r["tokens"] for r in results) / seconds,
        "seconds": seconds,
        "compiles_during_load": metric(url, "compiles_total") - compiles,
        "rounds": {spec: after[spec] - before.get(spec, 0) for spec in after},
        "outputs": {r["seed"]: r["token_ids"] for r in results},
    }


def row(clients: int, trials: dict[str, list[dict]]) -> dict:
    """A load's medians per server, auto's against the best fixed choice, outputs compared."""
    medians = {
        name: statistics.median(t["tokens_per_second"] for t in runs)
        for name, runs in trials.items()
    }
    fixed = {name: rate for name, rate in medians.items() if name != "auto"}
    best = max(fixed, key=fixed.get)
    plain = trials["ar"][0]["outputs"]
    equal = all(run["outputs"] == plain for runs in trials.values() for run in runs)
    auto_rounds = [run["rounds"] for run in trials["auto"]]
    return {
        "clients": clients,
        "tokens_per_second": medians,
        "best_fixed": best,
        "auto_over_best": medians["auto"] / fixed[best],
        "greedy_outputs_equal": equal,
        "compiles_during_loads": sum(
            run["compiles_during_load"] for runs in trials.values() for run in runs
        ),
        "auto_rounds": {s: sum(r.get(s, 0) for r in auto_rounds) for s in auto_rounds[0]},
        "trials": {
            name: [{k: v for k, v in run.items() if k != "outputs"} for run in runs]
            for name, runs in trials.items()
        },
    }


def long_half(requests: list[dict], tokens: int) -> list[dict]:
    """Every other request's prompt made ``tokens`` long (its own prompt repeated)."""
    return [
        r | {"prompt": (r["prompt"] * (tokens // len(r["prompt"]) + 1))[:tokens]} if i % 2 else r
        for i, r in enumerate(requests)
    ]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    series = {
        name: ([r["tokens_per_second"][name] for r in rows], "o-" if name == "auto" else "s--")
        for name in rows[0]["tokens_per_second"]
    }
    clients = [r["clients"] for r in rows]
    plot_by_clients(axis, clients, series, "greedy, every server on the same trace")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="ddtree", choices=["dflash", "ddtree"])
    parser.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="trials per server and load")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=8, help="the drafter's block (the demo's 8)")
    parser.add_argument("--long-prompts", type=int, metavar="TOKENS", help="see above")
    parser.add_argument("--checkpoint", type=Path, help="the target (default: the demo pair)")
    parser.add_argument("--drafter", type=Path)
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    traces = {n: make_requests(n * args.requests_per_client, 0.0, seed=n) for n in counts}
    max_len, max_prompt = MAX_LEN, MAX_PROMPT
    if args.long_prompts:
        traces = {n: long_half(trace, args.long_prompts) for n, trace in traces.items()}
        max_len, max_prompt = args.long_prompts + MAX_LEN, args.long_prompts
    common = ["--max-batch", str(args.max_batch), "--max-len", str(max_len)]
    common += ["--max-prompt", str(max_prompt), "--max-waiting", "256", "--max-logprobs", "0"]
    common += ["--prefix-cache", "off", "--no-access-log"]
    for flag in ("checkpoint", "drafter"):
        common += [f"--{flag}", str(getattr(args, flag))] if getattr(args, flag) else []
    servers = choices(args.method, args.block)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        logs = {name: Path(folder) / f"{name}.log" for name in servers}
        started = {  # all at once: they compile side by side
            name: stack.enter_context(started_server([*common, *flags], logs[name]))
            for name, flags in servers.items()
        }
        for name, server in started.items():  # on a busy host past wait_healthy's deadline
            ready = lambda s=server: healthy(s.url) or s.process.poll() is not None
            if not server.wait_until(ready, START_SECONDS, poll=2) or not healthy(server.url):
                raise RuntimeError(f"{name}: not serving:\n{logs[name].read_text()[-3000:]}")
        urls = {name: server.url for name, server in started.items()}
        start_up = logs["auto"].read_text()
        for clients, requests in traces.items():
            trials = {name: [] for name in servers}
            for repeat in range(args.repeats):
                turn = repeat % len(servers)
                order = [*list(servers)[turn:], *list(servers)[:turn]]
                for name in order:
                    trials[name].append(run_load(urls[name], requests, clients))
            rows.append(row(clients, trials))
            print({k: v for k, v in rows[-1].items() if k != "trials"}, flush=True)
    settings = {
        "method": args.method,
        "servers": servers,
        "common_flags": common,
        "clients": counts,
        "requests_per_client": args.requests_per_client,
        "repeats": args.repeats,
        "long_prompts": args.long_prompts,
        "auto_start_up": [line for line in start_up.splitlines() if "serving" in line],
    }
    machine = {"load_average_before": load_before, "load_average_after": os.getloadavg()}
    write_result(RESULTS, {"settings": settings, "rows": rows, "machine": machine})
    plot(rows, RESULTS.with_suffix(".png"))


if __name__ == "__main__":
    main()
