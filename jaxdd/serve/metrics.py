"""The server's Prometheus metrics, vLLM's names
under ``jaxdd:`` (prometheus-client renders them)."""

from __future__ import annotations

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxdd.decoding.speculation import Chooser
from jaxdd.runtime.compile_time import BACKEND_COMPILE

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
)
# How a queued request ends: abort is a client that left or the drain deadline; error, the engine.
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
# Why a request is answered before it is queued: a 400 / 404 / 415 (invalid), a prompt or output
# past the server's lengths or a body past its size (too_long), a 429 (queue_full), a 503 while
# shutting down (draining) or while compiling or after the engine failed (not_ready), a 401
# (unauthorized).
REFUSALS = ("invalid", "too_long", "queue_full", "draining", "not_ready", "unauthorized")


class PageCounts:
    """``jaxdd:cache_pages{state}``: the pool's pages free, cached (kept for prompts, no row
    holding them) and held by rows, from one snapshot the decode thread sets after each step
    (a scrape never sees a step half done; the three add up to the pool)."""

    STATES = ("free", "cached", "held")

    def __init__(self):
        self.counts = (0, 0, 0)

    def collect(self):
        about = "The cache's pages: free, cached (kept for prompts, no row holding them), held"
        family = GaugeMetricFamily("jaxdd:cache_pages", about, labels=["state"])
        for state, count in zip(self.STATES, self.counts, strict=True):
            family.add_metric([state], count)
        yield family


class RoundCounts:
    """``jaxdd:rounds_total{spec}``: the rounds run of each spec of the pool's set (``ar``,
    ``dflash-8``, ``ddtree-16``), and ``jaxdd:round_choice{spec}`` 1 for the chooser's current
    choice (probes aside), read from the chooser at each scrape (its counts only ever grow)."""

    def __init__(self, chooser: Chooser):
        self.chooser = chooser

    def collect(self):
        rounds = CounterMetricFamily("jaxdd:rounds", "Rounds run, per spec", labels=["spec"])
        about = "1 for the round the server chooses now (--budget auto), else 0"
        choice = GaugeMetricFamily("jaxdd:round_choice", about, labels=["spec"])
        current = self.chooser.current
        for name, count in list(self.chooser.rounds.items()):
            rounds.add_metric([name], count)
            choice.add_metric([name], int(name == current))
        yield rounds
        yield choice


class Metrics:
    """One registry per server (tests start several in a
    process); compiles are counted from ``watch_compiles``."""

    def __init__(self, block: int):
        registry = CollectorRegistry()
        self.registry = registry
        name = lambda suffix: f"jaxdd:{suffix}"
        self.running = Gauge(
            name("num_requests_running"), "Requests in decode rows", registry=registry
        )
        self.waiting = Gauge(
            name("num_requests_waiting"), "Requests queued for a row", registry=registry
        )
        self.cache_capacity = Gauge(
            name("cache_capacity_tokens"),
            "Context tokens the pool of cache pages holds (--cache-tokens)",
            registry=registry,
        )
        self.cache_usage = Gauge(
            name("kv_cache_usage_perc"), "Fraction of the cache's pages held", registry=registry
        )
        self.paused = Counter(
            name("rows_paused"),
            "Rounds a request's row ran paused, waiting for cache pages",
            registry=registry,
        )
        self.pages = PageCounts()
        registry.register(self.pages)
        self.generation_tokens = Counter(
            name("generation_tokens"), "Tokens generated", registry=registry
        )
        self.prompt_tokens = Counter(
            name("prompt_tokens"), "Prompt tokens admitted (cached ones too)", registry=registry
        )
        self.prefix_queries = Counter(
            name("prefix_cache_queries"),
            "Prompt tokens looked up in the prefix cache",
            registry=registry,
        )
        self.prefix_hits = Counter(
            name("prefix_cache_hits"), "Prompt tokens found in the prefix cache", registry=registry
        )
        self.drafts = Counter(
            name("spec_decode_num_drafts"), "Speculative rounds, per request", registry=registry
        )
        self.draft_tokens = Counter(
            name("spec_decode_num_draft_tokens"),
            "Draft tokens (or tree nodes) verified",
            registry=registry,
        )
        self.accepted_tokens = Counter(
            name("spec_decode_num_accepted_tokens"), "Draft tokens accepted", registry=registry
        )
        self.finished = Counter(
            name("request_success"),
            "Requests ended",
            ["finished_reason"],
            registry=registry,
        )
        self.refused = Counter(
            name("request_refused"),
            "Requests refused",
            ["reason"],
            registry=registry,
        )
        for reason in FINISH_REASONS:  # each label shows from the start, at 0
            self.finished.labels(reason)
        for reason in REFUSALS:
            self.refused.labels(reason)
        self.compiles = Counter(
            name("compiles"), "XLA compilations (warm-up included)", registry=registry
        )
        self.ttft = Histogram(
            name("time_to_first_token_seconds"),
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            name("time_per_output_token_seconds"),
            "Per request: (last token - first token) / the tokens delivered after the "
            "first token's",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.acceptance = Histogram(
            name("acceptance_length"),
            "Tokens a request gets per round (accepted drafts + 1)",
            buckets=tuple(range(1, block + 1)),
            registry=registry,
        )
        self._listening = False

    def count_rounds(self, chooser: Chooser) -> None:
        """``RoundCounts`` of ``chooser`` in this registry."""
        self.registry.register(RoundCounts(chooser))

    def watch_compiles(self) -> None:
        """Count every XLA compilation in this process from now on, until ``close``."""
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._listening = True

    def close(self) -> None:
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
            self._listening = False

    def _on_event(self, event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE:
            self.compiles.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
