"""Conversations resent in full, and a long prompt arriving while others decode (issue 53).

    python benchmarks/serve_multiturn.py [--clients 8] [--turns 6] [--method dflash]
    python benchmarks/serve_multiturn.py --long-prompt 1024 --answer 128 --prefill-chunk 64 128

Multi-turn: ``--clients`` conversations at once, each ``--turns`` turns; a turn sends the whole
history (every earlier prompt and answer) and a new message of ``--message`` tokens cut from the
Python standard library's sources (offline), greedy, ``--answer`` tokens back. The same traffic
runs ``--repeats`` times (new conversations each time) against a server with ``--prefix-cache
on`` and one with ``off``: prefill tokens computed
(prompt tokens less ``usage.prompt_tokens_details.cached_tokens``), the hit rate, TTFT p50/p99
per turn, TPOT p50, throughput (the median run's) and mean acceptance (the server's metrics).

Long prompt (``--long-prompt N``): ``--clients`` requests decode; when each has its first token,
one prompt of N tokens arrives. Their TPOT p99 and the p99 of the gaps between their rounds'
tokens (what a stall shows in: a request's mean TPOT spreads it over all its tokens) with it,
against a run without it, for a server that prefills whole and for each ``--prefill-chunk``
tokens a round. Writes benchmarks/results/serve_multiturn.json (or serve_long_prompt.json) and
a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from jaxdd.cli import DEMO
from jaxdd.testing.benchmark import write_result
from jaxdd.testing.server import running_server
from jaxdd.weights.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"


def source_tokens(count: int, seed: int) -> list[int]:
    """``count`` tokens of a standard library module's source (offline text), one per seed."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = files[seed % len(files)].read_text(errors="replace")
    ids = load_tokenizer(DEMO / "target").encode(text * 4)
    start = np.random.default_rng(seed).integers(0, max(1, len(ids) - count))
    return ids[start : start + count]


async def turn(
    client: httpx.AsyncClient, prompt: list[int], tokens: int, started: asyncio.Event | None = None
) -> dict:
    """One streamed completion: its ids, TTFT, TPOT, when each chunk of its tokens came (one a
    round) and the cached prompt tokens; ``started`` is set at its first token."""
    body = {"model": "kimi-mini", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}
    body |= {"stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    start, ids, usage, arrivals = time.perf_counter(), [], None, []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice.get("token_ids"):
                    arrivals.append(time.perf_counter())
                    if started is not None:
                        started.set()
                    ids += choice["token_ids"]
    end, first = time.perf_counter(), arrivals[0]
    return {
        "ids": ids,
        "arrivals": arrivals,
        "ttft": first - start,
        "tpot": (end - first) / (len(ids) - 1) if len(ids) > 1 else None,
        "prompt": len(prompt),
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
    }


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(rf"^jaxdd:{name} (\S+)$", text, re.MULTILINE).group(1))


def acceptance(url: str, before: tuple[float, float]) -> float | None:
    drafts = metric(url, "spec_decode_num_drafts_total") - before[0]
    accepted = metric(url, "spec_decode_num_accepted_tokens_total") - before[1]
    return 1 + accepted / drafts if drafts else None


def counters(url: str) -> tuple[float, float]:
    return tuple(metric(url, f"spec_decode_num_{n}_total") for n in ("drafts", "accepted_tokens"))


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def conversations(url: str, args: argparse.Namespace) -> dict:
    async def talk(client: httpx.AsyncClient, seed: int) -> list[dict]:
        history, turns = source_tokens(args.first, seed), []
        for k in range(args.turns):
            result = await turn(client, history, args.answer)
            turns.append(result | {"turn": k + 1})
            history = history + result["ids"] + source_tokens(args.message, seed * 100 + k)
        return turns

    async def everyone(repeat: int) -> list[dict]:
        seeds = range(repeat * args.clients, (repeat + 1) * args.clients)  # new chats each time
        async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
            done = await asyncio.gather(*(talk(client, seed) for seed in seeds))
        return [t for turns in done for t in turns]

    before, compiles = counters(url), metric(url, "compiles_total")
    results, throughput = [], []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        results += (run := asyncio.run(everyone(repeat)))
        throughput.append(sum(len(r["ids"]) for r in run) / (time.perf_counter() - start))
    by_turn = {k: [r["ttft"] for r in results if r["turn"] == k] for k in range(1, args.turns + 1)}
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    late = [r["ttft"] for r in results if r["turn"] >= 3]
    return {
        "prompt_tokens": prompt,
        "prefill_tokens_computed": prompt - cached,
        "hit_rate": cached / prompt,
        "ttft_p50_s": {k: p(v, 50) for k, v in by_turn.items()},
        "ttft_p99_s": {k: p(v, 99) for k, v in by_turn.items()},
        "ttft_p50_from_turn_3_s": p(late, 50),
        "tpot_p50_s": statistics.median(r["tpot"] for r in results if r["tpot"]),
        "tokens_per_second": statistics.median(throughput),
        "tokens_per_second_runs": throughput,
        "mean_acceptance": acceptance(url, before),
        "compiles_during_load": metric(url, "compiles_total") - compiles,
    }


def long_prompt(url: str, args: argparse.Namespace, arrives: bool) -> dict:
    """``--clients`` requests decoding, ``--repeats`` times; with ``arrives``, a long prompt once
    each has a token."""

    async def run(repeat: int) -> list[dict]:
        started = [asyncio.Event() for _ in range(args.clients)]
        async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
            decoding = [
                asyncio.create_task(turn(client, source_tokens(16, seed), args.answer, event))
                for seed, event in enumerate(started)
            ]
            if arrives:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 1800)
                prompt = source_tokens(args.long_prompt, 1000 + repeat)  # none cached
                long.append(await turn(client, prompt, 1))
            return await asyncio.gather(*decoding)

    long: list[dict] = []
    tpots, gaps = [], []
    compiles = metric(url, "compiles_total")
    for repeat in range(args.repeats):
        results = asyncio.run(run(repeat))
        tpots += [r["tpot"] for r in results if r["tpot"]]
        # the gaps once every request has its first token (admissions' prefills are before)
        steady = max(r["arrivals"][0] for r in results)
        gaps += [
            b - a for r in results for a, b in itertools.pairwise(r["arrivals"]) if a >= steady
        ]
    return {
        "tpot_p50_s": p(tpots, 50),
        "tpot_p99_s": p(tpots, 99),
        "gap_p50_s": p(gaps, 50),
        "gap_p99_s": p(gaps, 99),
        "gap_max_s": float(max(gaps)),
        "long_prompt_ttft_s": statistics.median(r["ttft"] for r in long) if long else None,
        "compiles_during_load": metric(url, "compiles_total") - compiles,
    }


def plot(rows: dict, path: Path) -> None:
    """TTFT p50 per turn, cache on and off; or, for the long prompt, the decoding requests' p99
    gap without and with it, per chunk size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    if "on" in rows:
        for cache in ("on", "off"):
            ttft = rows[cache]["ttft_p50_s"]
            axis.plot(list(ttft), list(ttft.values()), "o-", label=f"prefix cache {cache}")
        axis.set(xlabel="turn", ylabel="TTFT p50 (s)", title="conversations resent in full")
    else:
        names = [name.removeprefix("chunk_").replace("None", "whole") for name in rows]
        x = np.arange(len(rows))
        for shift, case in ((-0.2, "without"), (0.2, "with")):
            gaps = [1000 * row[case]["gap_p99_s"] for row in rows.values()]
            axis.bar(x + shift, gaps, 0.4, label=f"{case} the long prompt")
        axis.set_xticks(x, names)
        axis.set(xlabel="prefill chunk (tokens)", ylabel="p99 gap between rounds (ms)")
        axis.set_title("a long prompt arrives while 8 requests decode")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def serve_args(args: argparse.Namespace, max_prompt: int) -> list[str]:
    shape = ["--max-batch", str(args.clients + 1), "--max-prompt", str(max_prompt)]
    return [*shape, "--max-len", str(max_prompt + args.answer + 64), "--method", args.method]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first", type=int, default=64, help="tokens of the first message")
    parser.add_argument("--message", type=int, default=32, help="tokens of each later message")
    parser.add_argument("--answer", type=int, default=32, help="max_tokens of each turn")
    parser.add_argument("--method", default="dflash", choices=["ar", "dflash", "ddtree"])
    parser.add_argument("--repeats", type=int, default=3, help="conversation sets per server")
    parser.add_argument("--long-prompt", type=int, help="run the long-prompt arrival instead")
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        if args.long_prompt is None:
            history = args.first + (args.turns - 1) * (args.answer + args.message)
            for cache in ("on", "off"):
                flags = [*serve_args(args, history), "--prefix-cache", cache]
                with running_server(flags, Path(folder) / f"{cache}.log") as server:
                    rows[cache] = conversations(server.url, args)
                print(cache, rows[cache], flush=True)
            plot(rows, (RESULTS / "serve_multiturn.png"))
            rows["prefill_ratio_on_off"] = (
                rows["on"]["prefill_tokens_computed"] / rows["off"]["prefill_tokens_computed"]
            )
            name = "serve_multiturn.json"
        else:
            for chunk in (None, *args.prefill_chunk):
                flags = serve_args(args, args.long_prompt)
                flags += [] if chunk is None else ["--prefill-chunk", str(chunk)]
                with running_server(flags, Path(folder) / f"{chunk}.log") as server:
                    alone = long_prompt(server.url, args, arrives=False)
                    beside = long_prompt(server.url, args, arrives=True)
                rows[f"chunk_{chunk}"] = {"without": alone, "with": beside}
                for key in ("tpot_p99", "gap_p99"):
                    rows[f"chunk_{chunk}"][f"{key}_ratio"] = beside[f"{key}_s"] / alone[f"{key}_s"]
                print(chunk, rows[f"chunk_{chunk}"], flush=True)
            name = "serve_long_prompt.json"
            plot(rows, (RESULTS / name).with_suffix(".png"))
    write_result(RESULTS / name, {"settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
