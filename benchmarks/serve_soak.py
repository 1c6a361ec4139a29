"""Soak the server on loopback: a mixed load with bad requests, vanished
clients and overload, then whether anything crashed, hung or grew.

    python benchmarks/serve_soak.py [--requests 2000] [--seconds 900] [--clients 10]
                                    [--max-tokens 64] [--conversations 0.3] [--fault-every 150]

Starts ``python -m jaxdd.serve`` on the bundled pair (4 rows, 4 waiting: 10 clients overload it)
and sends ``--requests`` completions from ``--clients`` threads, stopping early after ``--seconds``.
Each request is, by its own seed: bad (``--bad``, one of many malformed or out-of-range bodies: a
4xx with an error body is "rejected"), a client that vanishes (``--disconnect``: a stream closed
after its first chunk, or a read timeout), or a normal one (streamed or not, greedy or sampled,
token ids or text; ``--conversations`` of them a turn of one of a few conversations, a prompt
starting with another's, so the prefix cache hits, evicts and is reset under all of this). Every
``--fault-every`` requests a round faults (``JAXDD_SERVE_FAULTS``): the requests it held get a 500
naming the engine fault ("faulted") and the pool starts afresh. Served means a 200 with a finish
reason (and ``[DONE]`` for a stream); refused is a 429; failed is anything else (a 5xx, a wrong
status, a stream without its end); a hang is a request still unanswered after ``--hang-seconds``;
a crash is the server process exiting. Every few seconds it samples the server's RSS, threads, open
files, ``compiles_total`` and cache pages (free + cached + held must be the pool in every sample,
none held when idle: else ``page_invariant_broken``); growth is measured from the end of the
warm-up (the first ``--warm-up`` requests) to the end, with the server idle both times. Writes
benchmarks/results/serve_soak.json and serve_soak.png (``--name`` for another stem).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import httpx
import numpy as np

from jaxdd.cache.stripes import PAGE_TOKENS
from jaxdd.serve.faults import ENV as FAULTS
from jaxdd.testing.benchmark import write_result
from jaxdd.testing.server import running_server

RESULTS = Path(__file__).parent / "results"
ROWS, WAITING, MAX_LEN, MAX_PROMPT = 4, 4, 320, 160
SHORT = 32  # the longest prompt of a request that is not a conversation's turn
PAGE_STATES = ("free", "cached", "held")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
]
BAD = [  # bodies a careless or hostile client sends
    {"prompt": [1, 2], "max_tokens": -1},
    {"prompt": [1, 2], "max_tokens": "lots"},
    {"prompt": [1, 2], "max_tokens": 10**9},
    {"prompt": [1, 2], "temperature": 9},
    {"prompt": [1, 2], "top_p": 0},
    {"prompt": [1, 2], "top_k": -7},
    {"prompt": [1, 2], "n": ROWS + 1},
    {"prompt": [1, 2**40]},
    {"prompt": [1, 4096]},
    {"prompt": [-3]},
    {"prompt": []},
    {"prompt": [1] * (MAX_PROMPT + 1)},
    {"prompt": [1, 2], "model": "no-such-model"},
    {"prompt": [1, 2], "stop": ["x"] * 40},
    {"max_tokens": 4},
]
RAW_BAD = [b"{oops", b"", b"[]", b"\xff" * 64, b"[" * 50_000 + b"]" * 50_000]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=900.0, help="stop sending after this long")
    parser.add_argument(
        "--clients", type=int, default=10, help="more than rows + waiting (8): overload"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="normal requests ask for 1..this many tokens"
    )
    parser.add_argument("--bad", type=float, default=0.1, help="share of bad requests")
    parser.add_argument(
        "--disconnect", type=float, default=0.1, help="share of clients that vanish"
    )
    parser.add_argument(
        "--conversations", type=float, default=0.3, help="share of normal requests that are turns"
    )
    parser.add_argument(
        "--fault-every", type=int, default=150, help="a round faults every this many requests"
    )
    parser.add_argument("--warm-up", type=int, default=200, help="requests before the baseline")
    parser.add_argument(
        "--hang-seconds", type=float, default=120.0, help="a request unanswered this long hangs"
    )
    parser.add_argument("--sample-every", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument(
        "--name", default="serve_soak", help="results file stem under benchmarks/results/"
    )
    return parser.parse_args()


class Load:
    """The requests and their outcomes; ``send(i)`` makes request i and records what happened."""

    def __init__(self, args: argparse.Namespace, url: str):
        self.args, self.url = args, url
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.done = 0
        self.lock = threading.Lock()
        rng = np.random.default_rng(args.seed)
        self.chats = [rng.integers(1, 4096, MAX_PROMPT).tolist() for _ in range(4)]

    def record(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.done += 1
            if detail and len(self.problems) < 50:
                self.problems.append(detail)

    def send(self, i: int) -> None:
        if self.args.fault_every and i % self.args.fault_every == self.args.fault_every // 2:
            with httpx.Client(base_url=self.url, timeout=30) as client:
                client.post("/debug/fault", json={"rounds": 1})
        rng = np.random.default_rng([self.args.seed, i])
        draw = rng.random()
        timeout = httpx.Timeout(self.args.hang_seconds, connect=30)
        try:
            with httpx.Client(base_url=self.url, timeout=timeout) as client:
                if draw < self.args.bad:
                    self.record(*self.bad(client, rng))
                elif draw < self.args.bad + self.args.disconnect:
                    self.record(*self.vanish(client, rng))
                else:
                    self.record(*self.normal(client, self.body(rng)))
        except httpx.TimeoutException as error:
            self.record("hung", f"request {i}: {type(error).__name__}")
        except httpx.HTTPError as error:
            self.record("failed", f"request {i}: {type(error).__name__}: {error}")

    def body(self, rng: np.random.Generator) -> dict:
        if rng.random() < self.args.conversations:  # a turn: an earlier turn's tokens and more
            chat = self.chats[int(rng.integers(0, len(self.chats)))]
            prompt = chat[: int(rng.integers(PAGE_TOKENS, MAX_PROMPT - 8))]
            prompt += rng.integers(1, 4096, size=int(rng.integers(1, 8))).tolist()
        elif rng.random() < 0.5:
            prompt = rng.integers(1, 4096, size=int(rng.integers(1, SHORT + 1))).tolist()
        else:
            prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12))))
        sampled = rng.random() < 0.5
        return {
            "prompt": prompt,
            "max_tokens": int(rng.integers(1, self.args.max_tokens + 1)),
            "temperature": 0.8 if sampled else 0.0,
            "top_p": 0.9 if sampled else 1.0,
            "seed": int(rng.integers(0, 2**31)),
            "stream": bool(rng.random() < 0.5),
        }

    def normal(self, client: httpx.Client, body: dict) -> tuple[str, str]:
        with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                return "refused", ""
            if response.status_code != 200:
                text = response.read()[:200]
                faulted = response.status_code == 500 and b"engine fault" in text
                return (
                    ("faulted", "") if faulted else ("failed", f"{response.status_code}: {text!r}")
                )
            if not body["stream"]:
                finish = json.loads(response.read())["choices"][0]["finish_reason"]
                return (
                    ("served", "")
                    if finish in {"stop", "length"}
                    else ("failed", f"finish {finish}")
                )
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        finish = [
            c["finish_reason"]
            for chunk in chunks
            for c in chunk.get("choices", [])
            if c["finish_reason"]
        ]
        if lines and lines[-1] == "data: [DONE]" and finish in (["stop"], ["length"]):
            return "served", ""
        if lines and lines[-1] == "data: [DONE]" and "engine fault" in lines[-2]:
            return "faulted", ""
        return "failed", f"stream ended {lines[-2:]!r}"

    def bad(self, client: httpx.Client, rng: np.random.Generator) -> tuple[str, str]:
        pick = int(rng.integers(0, len(BAD) + len(RAW_BAD)))
        if pick < len(BAD):
            response = client.post("/v1/completions", json=BAD[pick])
        else:
            headers = {"content-type": "application/json"}
            response = client.post(
                "/v1/completions", content=RAW_BAD[pick - len(BAD)], headers=headers
            )
        error = (
            response.json().get("error", {})
            if response.headers.get("content-type") == "application/json"
            else {}
        )
        if (
            400 <= response.status_code < 500
            and response.status_code != 429
            and error.get("message")
        ):
            return "rejected", ""
        return "failed", f"bad request {pick} got {response.status_code}: {response.text[:200]}"

    def vanish(self, client: httpx.Client, rng: np.random.Generator) -> tuple[str, str]:
        body = {**self.body(rng), "max_tokens": MAX_LEN - MAX_PROMPT, "temperature": 1.0}
        if rng.random() < 0.5:  # a stream closed after its first chunk
            with client.stream(
                "POST", "/v1/completions", json={**body, "stream": True}
            ) as response:
                if response.status_code == 429:
                    return "refused", ""
                lines = response.iter_lines()
                next(lines, None)
            return "disconnected", ""
        try:  # the client's own read timeout
            quick = httpx.Timeout(30, read=0.2)
            response = client.post("/v1/completions", json={**body, "stream": False}, timeout=quick)
        except httpx.ReadTimeout:
            return "disconnected", ""
        return ("refused", "") if response.status_code == 429 else ("disconnected", "")


def sampler(
    server, load: Load, every: float, stop: threading.Event, samples: list, crashed: list
) -> None:
    start = time.monotonic()
    while not stop.wait(every):
        if server.process.poll() is not None:
            crashed.append(server.process.returncode)
            return
        try:
            sample = {**server.usage(), **scrape(server)}
        except (OSError, httpx.HTTPError, KeyError):
            continue
        samples.append({"t": round(time.monotonic() - start, 2), "done": load.done, **sample})


def scrape(server) -> dict:
    """Compiles and the cache's pages by state, from one scrape (they add up to the pool)."""
    names = ["compiles_total", *(f'cache_pages{{state="{s}"}}' for s in PAGE_STATES)]
    values = list(server.metrics(*names).values())
    return {"compiles": values[0], **dict(zip(PAGE_STATES, values[1:], strict=True))}


def idle_snapshot(server) -> dict:
    """Usage and compiles once no request runs or waits (bounded wait)."""
    server.wait_until(
        lambda: (
            server.metric("num_requests_running") == 0
            and server.metric("num_requests_waiting") == 0
        ),
        60,
        0.2,
    )
    return {**server.usage(), **scrape(server)}


def run_load(load: Load, first: int, count: int, clients: int, deadline: float) -> None:
    numbers = iter(range(first, first + count))
    lock = threading.Lock()

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                i = next(numbers, None)
            if i is None:
                return
            load.send(i)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(worker) for _ in range(clients)]:
            future.result()


def plot(samples: list, warm_done: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, counts) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    done = [s["done"] for s in samples]
    memory.plot(done, [s["rss_mb"] for s in samples], label="RSS (MB)")
    memory.axvline(warm_done, color="gray", linestyle="--", label="end of warm-up")
    memory.set_ylabel("server RSS (MB)")
    memory.legend()
    counts.plot(done, [s["threads"] for s in samples], label="threads")
    counts.plot(done, [s["fds"] for s in samples], label="open files")
    counts.plot(done, [s["compiles"] for s in samples], label="compiles_total")
    counts.set_xlabel("requests answered")
    counts.legend()
    fig.suptitle("python -m jaxdd.serve soak (bundled pair, loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    args = parse_args()
    shape = ["--max-batch", str(ROWS), "--max-waiting", str(WAITING), "--max-len", str(MAX_LEN)]
    shape += ["--max-prompt", str(MAX_PROMPT)]
    with (
        tempfile.TemporaryDirectory() as folder,
        running_server(shape, Path(folder) / "server.log", {FAULTS: "1"}) as server,
    ):
        load, samples, crashed, stop = Load(args, server.url), [], [], threading.Event()
        watch = threading.Thread(
            target=sampler, args=(server, load, args.sample_every, stop, samples, crashed)
        )
        watch.start()
        started = time.monotonic()
        deadline = started + args.seconds
        warm = min(args.warm_up, args.requests)
        try:
            run_load(load, 0, warm, args.clients, deadline)
            baseline = idle_snapshot(server)
            warm_done = load.done
            run_load(load, warm, args.requests - warm, args.clients, deadline)
            final = idle_snapshot(server) if server.process.poll() is None else None
            health = httpx.get(f"{server.url}/health", timeout=10).status_code if final else None
            pool, hits = None, None
            if final:
                pool = server.metric("cache_capacity_tokens") // PAGE_TOKENS
                queries = max(1.0, server.metric("prefix_cache_queries_total"))
                hits = server.metric("prefix_cache_hits_total") / queries
        finally:
            stop.set()
            watch.join(30)
        elapsed = time.monotonic() - started
        command = " ".join(
            f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()
        )
        after = [s for s in samples if s["done"] >= warm_done]
        # every sample's pages add up to the pool (and none is held once idle)
        broken = None
        if final:
            broken = sum(sum(x[state] for state in PAGE_STATES) != pool for x in samples)
            broken += bool(final["held"])
        report = {
            "command": f"python benchmarks/serve_soak.py {command}",
            "server": {
                "rows": ROWS,
                "max_waiting": WAITING,
                "max_len": MAX_LEN,
                "max_prompt": MAX_PROMPT,
            },
            "requests": load.done,
            "seconds": round(elapsed, 1),
            "outcomes": dict(load.outcomes),
            "crashes": len(crashed),
            "page_invariant_broken": broken,
            "prefix_cache_hit_rate": hits,
            "hangs": load.outcomes["hung"],
            "health_after": health,
            "baseline_after_warm_up": baseline,
            "final": final,
            "rss_growth_mb": round(final["rss_mb"] - baseline["rss_mb"], 1) if final else None,
            "rss_peak_after_warm_up_mb": max((s["rss_mb"] for s in after), default=None),
            "compiles_after_warm_up": final["compiles"] - baseline["compiles"] if final else None,
            "threads_growth": final["threads"] - baseline["threads"] if final else None,
            "fds_growth": final["fds"] - baseline["fds"] if final else None,
            "problems": load.problems,
            "samples": samples,
        }
    print(
        json.dumps({k: v for k, v in report.items() if k not in {"samples", "problems"}}, indent=2)
    )
    for problem in load.problems[:10]:
        print("problem:", problem)
    write_result(RESULTS / f"{args.name}.json", report)
    plot(samples, warm_done, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
