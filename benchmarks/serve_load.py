"""python -m jaxdd.serve under load: N concurrent clients (1, 4, 16) with
mixed prompt and output lengths, greedy and T=0.7, against static batching
(``generate_batch``) of the same requests in groups of N; the bundled pair.

    python benchmarks/serve_load.py [--requests-per-client 2] [--clients 1,4,16] [--max-batch 16]
                                    [--repeats 3]

Reports throughput (generated tokens / wall seconds), TTFT
(arrival to the first streamed token), TPOT ((last token
- first token) / (tokens - 1) per request; a speculative
  chunk carries several tokens, so not per-chunk ITL) and
mean acceptance (tokens per request per round, from the server's metrics), and the server's compiles
after warm-up. The static baseline runs each group of N requests as one batch that ends with its
longest request, after one untimed run of the same batches (compile time and first runs excluded).
Each row repeats the pair ``--repeats`` times and reports the trial with the median speedup (all are
kept). The clients are asyncio tasks reading the Server-Sent Events as lines: the load generator
shares the 2 cores with the server, and the ``openai`` client's per-chunk parsing took ~15% of the
host's CPU time in a load. Writes benchmarks/results/serve_load.json and serve_load.png.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.testing.benchmark import plot_by_clients, write_result
from jaxdd.testing.server import running_server
from jaxdd.weights.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results" / "serve_load.json"
MAX_LEN, MAX_PROMPT = 320, 64
SNIPPETS = [
    'def read_config(path):\n    """Read a JSON config file and return it as a dict."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "for i in range(10):\n    print(i)\n",
    "def merge_sort(values):\n    if len(values) <= 1:\n        return values\n    middle "
    "= len(values) // 2\n",
]


def make_requests(count: int, temperature: float, seed: int) -> list[dict]:
    """Mixed lengths: prompts of 4..64 tokens cut from code
    snippets, outputs log-uniform in 16..256 tokens."""
    rng = np.random.default_rng(seed)
    tokenizer = load_tokenizer(DEMO / "target")
    requests = []
    for i in range(count):
        ids = tokenizer.encode(SNIPPETS[i % len(SNIPPETS)] * 4)
        prompt = ids[: int(rng.integers(4, MAX_PROMPT + 1))]
        length = int(np.exp(rng.uniform(np.log(16), np.log(256))))
        requests.append(
            {"prompt": prompt, "max_tokens": length, "temperature": temperature, "seed": i}
        )
    return requests


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(rf"^jaxdd:{name} (\S+)$", text, re.MULTILINE).group(1))


@contextlib.contextmanager
def server(max_batch: int, method: str, log: Path) -> Iterator[str]:
    """``python -m jaxdd.serve`` on the bundled pair,
    its output in ``log``: its base url once healthy."""
    args = [
        "--max-batch",
        str(max_batch),
        "--max-len",
        str(MAX_LEN),
        "--max-prompt",
        str(MAX_PROMPT),
    ]
    with running_server([*args, "--max-waiting", "256", "--method", method], log) as process:
        yield process.url


async def one_request(client: httpx.AsyncClient, request: dict) -> dict:
    """One streamed completion, its Server-Sent Events read as lines (no pydantic
    model per chunk: the client's CPU, on the server's host, stays small)."""
    start = time.perf_counter()
    first, ids = None, []
    body = {"model": "kimi-mini", "stream": True, "return_token_ids": True}
    body |= {key: request[key] for key in ("prompt", "max_tokens", "temperature", "seed")}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    ids += choice["token_ids"]
    end = time.perf_counter()
    tokens = len(ids)
    tpot = (end - first) / (tokens - 1) if tokens > 1 else None
    timing = {"ttft": first - start, "tpot": tpot, "tokens": tokens}
    return timing | {"token_ids": ids, "seed": request["seed"]}


async def send_all(url: str, requests: list[dict], clients: int) -> list[dict]:
    """``clients`` tasks on one event loop, each taking the next unsent request when its last
    one ends (at most ``clients`` in flight, as vLLM's benchmark_serving --max-concurrency)."""
    unsent = collections.deque(requests)
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def send_until_empty() -> list[dict]:
            results = []
            while unsent:
                results.append(await one_request(client, unsent.popleft()))
            return results

        done = await asyncio.gather(*(send_until_empty() for _ in range(clients)))
    return [result for results in done for result in results]


def load(url: str, requests: list[dict], clients: int) -> dict:
    """The requests sent by ``clients`` concurrent
    clients, and what the server's metrics say of them."""
    before = {
        name: metric(url, name)
        for name in ("spec_decode_num_drafts_total", "generation_tokens_total")
    }
    accepted0, compiles0 = (
        metric(url, "spec_decode_num_accepted_tokens_total"),
        metric(url, "compiles_total"),
    )
    start = time.perf_counter()
    results = asyncio.run(send_all(url, requests, clients))
    seconds = time.perf_counter() - start
    drafts = metric(url, "spec_decode_num_drafts_total") - before["spec_decode_num_drafts_total"]
    accepted = metric(url, "spec_decode_num_accepted_tokens_total") - accepted0
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "ttft_median_s": statistics.median(r["ttft"] for r in results),
        "tpot_median_s": statistics.median(r["tpot"] for r in results if r["tpot"] is not None),
        "mean_acceptance": 1 + accepted / drafts if drafts else None,
        "compiles_during_load": metric(url, "compiles_total") - compiles0,
    }


def static(decoder: SpeculativeDecoder, method: str, requests: list[dict], clients: int) -> dict:
    """The same requests as batches of ``clients`` that
    start and end together (compile time excluded)."""
    tokens, seconds = 0, 0.0
    for i in range(0, len(requests), clients):
        group = requests[i : i + clients]
        results = decoder.generate_batch(
            [r["prompt"] for r in group],
            method=method,
            max_new_tokens=[r["max_tokens"] for r in group],
            sampling=[jaxdd.Sampling(r["temperature"], seed=r["seed"]) for r in group],
        )
        tokens += sum(len(r.tokens) for r in results)
        seconds += (
            results[0].prefill_seconds + results[0].decode_seconds - results[0].compile_seconds
        )
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def paired_trial(
    url: str, decoder: SpeculativeDecoder, method: str, requests: list[dict], clients: int
) -> dict:
    """A load and its static twin back to back (the shared
    host's load drifts over minutes), and their ratio."""
    trial = {
        "continuous": load(url, requests, clients),
        "static": static(decoder, method, requests, clients),
    }
    return trial | {
        "speedup": trial["continuous"]["tokens_per_second"] / trial["static"]["tokens_per_second"]
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for temperature, axis in zip((0.0, 0.7), axes, strict=True):
        picked = [r for r in rows if r["temperature"] == temperature]
        labels = {"continuous": "continuous (server)", "static": "static generate_batch"}
        series = {
            label: ([r[kind]["tokens_per_second"] for r in picked], style)
            for (kind, label), style in zip(labels.items(), ("o-", "s--"), strict=True)
        }
        plot_by_clients(axis, [r["clients"] for r in picked], series, f"T = {temperature}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--method", default="dflash", choices=["ar", "dflash", "ddtree"])
    parser.add_argument(
        "--repeats", type=int, default=3, help="paired trials per row; the median ratio is reported"
    )
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    plans = [
        (t, n, make_requests(n * args.requests_per_client, t, seed=n))
        for t in (0.0, 0.7)
        for n in counts
    ]
    target, drafter = jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32")
    decoder = SpeculativeDecoder(target, None if args.method == "ar" else drafter)
    rows = []
    with (
        tempfile.TemporaryDirectory() as folder,
        server(args.max_batch, args.method, Path(folder) / "serve.log") as url,
    ):
        for temperature, clients, requests in plans:
            # untimed: a first run of new shapes is slower
            static(decoder, args.method, requests, clients)
            trials = [
                paired_trial(url, decoder, args.method, requests, clients)
                for _ in range(args.repeats)
            ]
            # the lower of two middles
            median = sorted(trials, key=lambda t: t["speedup"])[(len(trials) - 1) // 2]
            row = {"temperature": temperature, "clients": clients, **median, "trials": trials}
            print({k: v for k, v in row.items() if k != "trials"}, flush=True)
            rows.append(row)
    settings = {
        "method": args.method,
        "max_batch": args.max_batch,
        "max_len": MAX_LEN,
        "max_prompt": MAX_PROMPT,
    }
    settings |= {"requests_per_client": args.requests_per_client, "repeats": args.repeats}
    write_result(RESULTS, {"settings": settings, "rows": rows})
    plot(rows, RESULTS.with_suffix(".png"))


if __name__ == "__main__":
    main()
