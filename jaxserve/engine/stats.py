"""Step-level accounting the benchmarks and metrics read: what ran, how long the host waited for the device, how
long the device waited for the host.

Device time is measured without extra synchronisation. A step's end is known exactly when the host blocked on its
result (`ready_at` = when the fetch returned); otherwise the host only knows the step was done by the first time
it looked (a non-blocking readiness check at the top of `step()`, or the fetch itself), so `ready_at` is an upper
bound. A step starts on the device when it was dispatched or when the step before it ended, whichever is later:

    device_seconds = ready_at - max(dispatched_at, previous ready_at)
    host_gap       = dispatched_at - max(previous ready_at, work_arrived_at)     (>= 0: the device sat idle)

`work_arrived_at` is when an idle engine got work, so a gap never counts time in which there was nothing to do.
With upper-bound end times the device time errs high and the idle time low: the host-bound verdict
(jaxserve.observability) is conservative.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.engine.buckets import StepShape


@dataclasses.dataclass(frozen=True)
class StepRecord:
    shape: StepShape
    num_tokens: int  # real (unpadded) tokens
    num_seqs: int
    dispatched_at: float  # perf_counter when the step was handed to the device
    done_at: float  # perf_counter when its results were on the host
    waited: float  # seconds the host blocked on the device for it
    context_tokens: int = 0  # sum of the sequences' context lengths: the KV tokens its attention reads
    attended_pairs: int = 0  # (query token, key token) pairs its attention scores
    ready_at: float = 0.0  # the earliest time the host knew the device had finished it (see the module docstring)
    page_stall: bool = False  # when it was planned, requests waited for KV pages (or one was preempted for them)
    device_seconds: float = 0.0  # set by EngineStats.record
    host_gap: float = 0.0  # device idle just before it, waiting for the host; set by EngineStats.record


@dataclasses.dataclass
class StepTotals:
    """Running sums since start-up (counters never go back, unlike the window of records)."""

    steps: int = 0
    tokens: int = 0
    seqs: int = 0
    context_tokens: int = 0
    attended_pairs: int = 0
    device_seconds: float = 0.0
    host_gap_seconds: float = 0.0

    def add(self, record: StepRecord) -> None:
        self.steps += 1
        self.tokens += record.num_tokens
        self.seqs += record.num_seqs
        self.context_tokens += record.context_tokens
        self.attended_pairs += record.attended_pairs
        self.device_seconds += record.device_seconds
        self.host_gap_seconds += record.host_gap


@dataclasses.dataclass
class EngineStats:
    window: int = 4096
    steps: collections.deque = dataclasses.field(default_factory=collections.deque)
    num_steps: int = 0
    host_seconds: float = 0.0  # scheduling + input building + dispatch, summed over steps
    totals: StepTotals = dataclasses.field(default_factory=StepTotals)
    work_arrived_at: float = 0.0  # perf_counter when the engine last went from no work to some
    last_ready_at: float = 0.0  # ready_at of the last recorded step

    def record(self, record: StepRecord) -> StepRecord:
        """Appends a finished step (in dispatch order), filling in its device time and the idle gap before it."""
        record = dataclasses.replace(
            record, device_seconds=max(0.0, record.ready_at - max(record.dispatched_at, self.last_ready_at)),
            host_gap=max(0.0, record.dispatched_at - max(self.last_ready_at, self.work_arrived_at)))
        self.last_ready_at = max(self.last_ready_at, record.ready_at)
        self.totals.add(record)
        self.steps.append(record)
        if len(self.steps) > self.window:
            self.steps.popleft()
        self.num_steps += 1
        return record

    def work_arrived(self, now: float) -> None:
        self.work_arrived_at = now


def attention_work(context_len: int, num_new_tokens: int, sliding_window: int | None = None) -> int:
    """(query, key) pairs of one sequence's chunk: new token i (of n) at position c - n + i attends to the
    c - n + i + 1 tokens up to itself (at most `sliding_window` of them)."""
    first = context_len - num_new_tokens + 1  # keys seen by the chunk's first token
    window = context_len if sliding_window is None else sliding_window
    last_unclipped = min(context_len, window)
    unclipped = max(0, last_unclipped - first + 1) * (first + last_unclipped) // 2
    return unclipped + (context_len - max(first - 1, window)) * window if context_len > window else unclipped
