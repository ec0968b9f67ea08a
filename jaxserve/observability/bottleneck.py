"""The bottleneck verdict: over a sliding window of steps, what limits the deployment now.

Per window (the steps that finished in the last `window_seconds`, over every engine replica):

    busy      = sum of the steps' device time                       (jaxserve.engine.stats)
    idle      = sum of the device's idle gaps waiting for the host  (only while the engine had work)
    bandwidth_fraction = (bytes the steps must move / busy) / (copy bandwidth x devices)
    compute_fraction   = (FLOPs the steps must do   / busy) / (matmul FLOP/s  x devices)
    idle_fraction      = idle / (busy + idle)
    capacity_fraction  = steps planned while requests waited for KV pages (or one was preempted) / steps

Rules, first match wins:

    no step in the window            idle        nothing to judge
    idle_fraction >= 0.5             host        the device waits for the host more than it works: scheduling,
                                                 input building, detokenization or the HTTP layer limit throughput
    capacity_fraction >= 0.5         capacity    the device is busy, but requests queue for KV pages: memory (or
                                                 a smaller KV dtype) would allow a larger batch
    compute_fraction and bandwidth   latency     the device is busy but near neither ceiling: fixed per-step costs
      _fraction both < 0.05                      (kernel launches, dispatch, synchronisation, small unfused ops)
                                                 take most of each step, or the batches are too small to use it
    compute_fraction >= bandwidth    compute     otherwise, the roofline: the resource whose floor time is
                  _fraction                      larger binds (FLOPs/byte above the device's ridge point)
    else                             bandwidth

The last rule compares two fractions of the same measured time, so it amounts to the steps' arithmetic intensity
(FLOPs per byte) against the device's ridge point (peak FLOP/s / bandwidth); how far the larger fraction is from 1
says how much the implementation leaves on the table.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import queue
import threading
import time
from typing import Sequence

import jax.numpy as jnp

from jaxserve.observability.ceilings import DeviceCeilings, device_ceilings
from jaxserve.observability.cost import ModelCost, Work
from jaxserve.quant.memory import kv_bytes_per_token

VERDICTS = ("compute", "bandwidth", "latency", "capacity", "host", "idle")
WINDOW_SECONDS = 10.0
HOST_IDLE_FRACTION = 0.5
CAPACITY_STALL_FRACTION = 0.5
LATENCY_CEILING_FRACTION = 0.05  # below this share of both ceilings, neither binds: fixed per-step costs do


@dataclasses.dataclass(frozen=True)
class WindowReport:
    verdict: str
    steps: int
    tokens: int
    busy_seconds: float
    idle_seconds: float
    work: Work
    bandwidth_fraction: float
    compute_fraction: float
    idle_fraction: float
    capacity_fraction: float
    achieved_bandwidth: float  # bytes/s over device time, all devices
    achieved_flops: float  # FLOP/s over device time, all devices

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["work"] = dataclasses.asdict(self.work) | {"bytes": self.work.bytes}
        return out


def classify(steps: int, idle_fraction: float, capacity_fraction: float, compute_fraction: float,
             bandwidth_fraction: float) -> str:
    if steps == 0:
        return "idle"
    if idle_fraction >= HOST_IDLE_FRACTION:
        return "host"
    if capacity_fraction >= CAPACITY_STALL_FRACTION:
        return "capacity"
    if max(compute_fraction, bandwidth_fraction) < LATENCY_CEILING_FRACTION:
        return "latency"
    return "compute" if compute_fraction >= bandwidth_fraction else "bandwidth"


def window_report(records: Sequence, cost: ModelCost, ceilings: DeviceCeilings) -> WindowReport:
    """The verdict and fractions of some StepRecords (all of one model; replicas' records may be mixed)."""
    busy = sum(r.device_seconds for r in records)
    idle = sum(r.host_gap for r in records)
    work = cost.of_records(records)
    bandwidth = work.bytes / busy if busy > 0 else 0.0
    flops = work.flops / busy if busy > 0 else 0.0
    bandwidth_fraction = bandwidth / (ceilings.bandwidth * cost.num_devices)
    compute_fraction = flops / (ceilings.flops * cost.num_devices)
    idle_fraction = idle / (busy + idle) if busy + idle > 0 else 0.0
    capacity_fraction = sum(r.page_stall for r in records) / len(records) if records else 0.0
    verdict = classify(len(records), idle_fraction, capacity_fraction, compute_fraction, bandwidth_fraction)
    return WindowReport(verdict, len(records), sum(r.num_tokens for r in records), busy, idle, work,
                        bandwidth_fraction, compute_fraction, idle_fraction, capacity_fraction, bandwidth, flops)


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclasses.dataclass(frozen=True)
class StepSizeHistogram:
    """Real (unpadded) tokens per step since start-up, as Prometheus buckets: `cumulative[i]` steps had at most
    `buckets[i]` tokens, `count` steps in all (vLLM's iteration_tokens_total)."""

    buckets: tuple[int, ...]
    cumulative: tuple[int, ...]
    count: int
    sum: int


class _StepSizes:
    def __init__(self, buckets: tuple[int, ...] = ITERATION_TOKEN_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.sum = 0

    def observe(self, records) -> None:
        for record in records:
            self.counts[bisect.bisect_left(self.buckets, record.num_tokens)] += 1
            self.sum += record.num_tokens

    def snapshot(self) -> StepSizeHistogram:
        running, cumulative = 0, []
        for count in self.counts[:-1]:
            running += count
            cumulative.append(running)
        return StepSizeHistogram(self.buckets, tuple(cumulative), running + self.counts[-1], self.sum)


class BottleneckMonitor:
    """The verdict over the step records that engine threads hand it (`submit`, frozen StepRecords through a
    thread-safe inbox); the reader's side (a scrape, the dashboard) drains the inbox into a window of its own when
    it asks. Nothing samples on a timer and nothing here is shared with an engine thread but the inbox (and the
    lock, under which an engine thread drains the inbox itself when nobody has read it for MAX_PENDING steps)."""

    MAX_RECORDS = 1 << 16  # the window's cap, whatever its length in seconds
    MAX_PENDING = 1 << 12  # step batches the inbox holds before the engine thread drains it (nobody scraping)

    def __init__(self, cost: ModelCost, ceilings: DeviceCeilings, window_seconds: float = WINDOW_SECONDS):
        self.cost = cost
        self.ceilings = ceilings
        self.window_seconds = window_seconds
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._window: collections.deque = collections.deque(maxlen=self.MAX_RECORDS)
        self._lock = threading.Lock()  # readers (scrape and dashboard) may come from several threads
        self._step_sizes = _StepSizes()

    def submit(self, records: Sequence) -> None:
        """Called by an engine thread with the records of the steps it just read back. When nobody has read
        for a long while, the engine thread drains the inbox itself, so it never grows without bound."""
        if records:
            self._inbox.put(tuple(records))
            if self._inbox.qsize() > self.MAX_PENDING:
                with self._lock:
                    self._drain()

    def _drain(self) -> None:
        """Inbox -> window (and the step-size histogram). Under the lock."""
        while True:
            try:
                records = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._window.extend(records)
            self._step_sizes.observe(records)

    def recent_records(self, now: float | None = None) -> list:
        now = time.perf_counter() if now is None else now
        since = now - self.window_seconds
        with self._lock:
            self._drain()
            while self._window and self._window[0].done_at < since:
                self._window.popleft()
            return [r for r in self._window if r.done_at >= since]

    def step_sizes(self) -> StepSizeHistogram:
        """Tokens per step over every step submitted so far."""
        with self._lock:
            self._drain()
            return self._step_sizes.snapshot()

    def report(self, now: float | None = None) -> WindowReport:
        return window_report(self.recent_records(now), self.cost, self.ceilings)

    def total_work(self, totals) -> Work:
        """The work of running totals (jaxserve.engine.stats.StepTotals, from the engine's stats snapshot)."""
        return self.cost.of_totals(totals)


def model_cost(engine) -> ModelCost:
    """The prices of an LLMEngine's steps: its model, weight dtype, KV-cache dtype and devices."""
    dtype = jnp.dtype(engine.runner.params["embed"][...].dtype).name
    kv = kv_bytes_per_token(engine.model_config, "auto", engine.kv_dtype)
    cost = ModelCost.of(engine.model_config, dtype, kv, engine.sharder.mesh.devices.size, engine.stored_dtypes)
    draft = getattr(engine, "draft_config", None)  # speculative decoding with a draft model
    if draft is None:
        return cost
    return cost.plus(ModelCost.of(draft, dtype, kv_bytes_per_token(draft, "auto", engine.kv_dtype)))


def monitor_for(engine, cache_dir: str | None, window_seconds: float = WINDOW_SECONDS) -> BottleneckMonitor:
    """A monitor for an engine core (or for every replica of one model), with the ceilings of its first device.
    Built before the engine's thread starts: it reads only what the core fixed at start-up."""
    device = engine.sharder.mesh.devices.flat[0]
    dtype = jnp.dtype(engine.runner.params["embed"][...].dtype).name
    return BottleneckMonitor(model_cost(engine), device_ceilings(device, dtype, cache_dir), window_seconds)
