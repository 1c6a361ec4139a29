"""Training a small Kimi-architecture target ("kimi-mini") and its DFlash
drafter in JAX, on the Python standard library's own sources, so the demo
and the benchmarks have real text and real acceptance lengths."""
