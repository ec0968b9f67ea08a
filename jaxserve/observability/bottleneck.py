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
    compute_fraction >= bandwidth    compute     otherwise, the roofline: the resource whose floor time is
                  _fraction                      larger binds (FLOPs/byte above the device's ridge point)
    else                             bandwidth

The last rule compares two fractions of the same measured time, so it amounts to the steps' arithmetic intensity
(FLOPs per byte) against the device's ridge point (peak FLOP/s / bandwidth); how far the larger fraction is from 1
says how much the implementation leaves on the table.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax.numpy as jnp

from jaxserve.observability.ceilings import DeviceCeilings, device_ceilings
from jaxserve.observability.cost import ModelCost, Work
from jaxserve.quant.memory import kv_bytes_per_token

VERDICTS = ("compute", "bandwidth", "capacity", "host", "idle")
WINDOW_SECONDS = 10.0
HOST_IDLE_FRACTION = 0.5
CAPACITY_STALL_FRACTION = 0.5


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


class BottleneckMonitor:
    """Reads the engines' step records (written by their threads) when asked; holds no state of its own but the
    prices and ceilings, so nothing samples on a timer."""

    def __init__(self, engines: Sequence, cost: ModelCost, ceilings: DeviceCeilings,
                 window_seconds: float = WINDOW_SECONDS):
        self.engines = list(engines)
        self.cost = cost
        self.ceilings = ceilings
        self.window_seconds = window_seconds

    def recent_records(self, now: float | None = None) -> list:
        now = time.perf_counter() if now is None else now
        since = now - self.window_seconds
        records = []
        for engine in self.engines:
            snapshot = tuple(engine.stats.steps)  # one C-level copy under the GIL: never a torn deque
            records.extend(r for r in snapshot if r.done_at >= since)
        return records

    def report(self, now: float | None = None) -> WindowReport:
        return window_report(self.recent_records(now), self.cost, self.ceilings)

    def total_work(self) -> Work:
        works = [self.cost.of_totals(engine.stats.totals) for engine in self.engines]
        return Work(*(sum(getattr(w, f.name) for w in works) for f in dataclasses.fields(Work)))


def model_cost(engine) -> ModelCost:
    """The prices of an LLMEngine's steps: its model, weight dtype, KV-cache dtype and devices."""
    dtype = jnp.dtype(engine.runner.params["embed"][...].dtype).name
    kv = kv_bytes_per_token(engine.model_config, "auto", engine.kv_dtype)
    return ModelCost.of(engine.model_config, dtype, kv, engine.sharder.mesh.devices.size)


def monitor_for(engines: Sequence, cache_dir: str | None, window_seconds: float = WINDOW_SECONDS
                ) -> BottleneckMonitor:
    """A monitor of these engines (replicas of one model), with the ceilings of their first device."""
    engine = engines[0]
    device = engine.sharder.mesh.devices.flat[0]
    dtype = jnp.dtype(engine.runner.params["embed"][...].dtype).name
    return BottleneckMonitor(engines, model_cost(engine), device_ceilings(device, dtype, cache_dir), window_seconds)
