"""Observability: what each step costs, what the device can do, and what limits the deployment now.

    cost.py        bytes and FLOPs of steps, from the model config and the batch (the performance model)
    ceilings.py    the device's copy bandwidth and matmul FLOP/s: measured once per device kind, cached on disk
    gpus.py        published GPU specifications (`jaxserve estimate --gpu`, and the ceilings' fallback)
    bottleneck.py  the sliding-window verdict: compute, bandwidth, latency, capacity or host (docs/metrics.md)

The engine only records raw step facts (jaxserve.engine.stats); everything here is computed when a scrape,
the dashboard or a benchmark asks.
"""
