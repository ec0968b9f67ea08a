"""Step-level accounting the benchmarks and metrics read: what ran, how long the host waited for the device, how
long the device waited for the host.

Device time is measured without synchronising every step. A step's end is exact when the host blocked on its
result (`end_exact`): the fetch blocked, or the engine sampled it (below). Otherwise the host only knows it was
done by the first time it looked (a readiness check at the top of `step()`, or the fetch), an upper bound. A step
starts on the device when it was dispatched or when the one before it ended, whichever is later:

    start          = max(dispatch_started, device_free_at)         device_free_at: the previous step's end
    device_seconds = ready_at - start                              measured when the end and the start are exact;
                     else min(that upper bound, the last measured device time of the same step shape
                              and burst length)
    host_gap       = dispatch_started - max(device_free_at, work_arrived_at)     (>= 0: the device sat idle)

`dispatch_started` is taken just before the dispatch call, because a backend may run a step inside it (XLA:CPU
runs large steps on the calling thread): the device's time then lies between dispatch_started and dispatched_at.

When the host keeps up (device-bound), every fetch blocks and everything is measured. When it does not, the device
is idle at each dispatch, so nothing blocks: then one such step in SAMPLE_INTERVAL (and the first of each shape) is
waited for right after its dispatch, an exact sample of that shape's device time for one step's overlap.
`work_arrived_at` is when an idle engine got work, so a gap never counts time in which there was nothing to do.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from jaxserve.engine.buckets import StepShape


@dataclasses.dataclass(frozen=True)
class StepRecord:
    shape: StepShape
    num_tokens: int  # real (unpadded) tokens
    num_seqs: int
    dispatched_at: float  # perf_counter when the step was handed to the device
    done_at: float  # perf_counter when its results were on the host
    waited: float  # seconds the host blocked on the device for it
    sampled_tokens: int = 0  # tokens it generated (rows whose chunk reached the end of their sequence)
    context_tokens: int = 0  # sum of the sequences' context lengths: the KV tokens its attention reads (a
    # decode burst: summed over its steps)
    attended_pairs: int = 0  # (query token, key token) pairs its attention scores
    dispatch_started: float = 0.0  # perf_counter just before the dispatch call (the device cannot start earlier)
    ready_at: float = 0.0  # the earliest time the host knew the device had finished it (see the module docstring)
    end_exact: bool = False  # ready_at is when the device finished (the host was blocked on it), not a bound
    page_stall: bool = False  # when it was planned, requests waited for KV pages (or one was preempted for them)
    burst: int = 1  # decode steps per row in the call (a decode burst: its most)
    device_seconds: float = 0.0  # set by EngineStats.record
    host_gap: float = 0.0  # device idle just before it, waiting for the host; set by EngineStats.record

    @property
    def head_rows(self) -> int:
        """Rows the LM head ran over: one a sequence, or in a decode burst one a sampled token (each step runs
        the rows still in their burst)."""
        return self.num_seqs if self.burst == 1 else self.sampled_tokens


@dataclasses.dataclass
class StepClock:
    """What the host saw of one step in flight (perf_counter times); the engine keeps one per step."""

    dispatch_started: float
    seen_ready_at: float | None = None  # a non-blocking check found it done: an upper bound on its end
    end: float | None = None  # the host was blocked on it until then: its exact end
    waited: float = 0.0  # seconds the host spent fetching its results

    def saw_ready(self, now: float) -> None:
        if self.seen_ready_at is None:
            self.seen_ready_at = now

    def fetched(self, started: float, returned: float, blocked: bool) -> float:
        """The fetch of its results ran from `started` to `returned`; returns the seconds the host waited."""
        if blocked and self.end is None:
            self.end = returned
        self.saw_ready(started)
        self.waited = returned - started
        return self.waited

    @property
    def ready_at(self) -> float:
        return self.end if self.end is not None else self.seen_ready_at


@dataclasses.dataclass(frozen=True, slots=True)
class StepTotals:
    """Running sums since start-up (counters never go back, unlike the window of records). A value: each step
    makes a new one, so a snapshot handed to another thread never changes."""

    steps: int = 0  # executable calls (a decode burst is one)
    tokens: int = 0
    seqs: int = 0
    sampled_tokens: int = 0
    context_tokens: int = 0
    attended_pairs: int = 0
    device_seconds: float = 0.0
    host_gap_seconds: float = 0.0
    passes: int = 0  # forward passes: a decode burst's steps each count
    head_rows: int = 0  # rows the LM head ran over, summed over passes

    def plus(self, record: StepRecord) -> "StepTotals":
        return StepTotals(self.steps + 1, self.tokens + record.num_tokens, self.seqs + record.num_seqs,
                          self.sampled_tokens + record.sampled_tokens, self.context_tokens + record.context_tokens,
                          self.attended_pairs + record.attended_pairs, self.device_seconds + record.device_seconds,
                          self.host_gap_seconds + record.host_gap, self.passes + record.burst,
                          self.head_rows + record.head_rows)

    @staticmethod
    def combine(totals) -> "StepTotals":
        """Several engines' totals (data-parallel replicas), added up."""
        return StepTotals(*(sum(getattr(t, f.name) for t in totals) for f in dataclasses.fields(StepTotals)))


SAMPLE_INTERVAL = 16  # of the steps dispatched to an idle device, the host waits at once for one in this many


@dataclasses.dataclass
class EngineStats:
    window: int = 4096
    steps: collections.deque = dataclasses.field(default_factory=collections.deque)
    num_steps: int = 0
    host_seconds: float = 0.0  # scheduling + input building + dispatch, summed over steps
    totals: StepTotals = dataclasses.field(default_factory=StepTotals)
    work_arrived_at: float = 0.0  # perf_counter when the engine last went from no work to some
    device_free_at: float = 0.0  # (estimated) end of the last recorded step on the device
    device_free_exact: bool = True
    measured: dict = dataclasses.field(default_factory=dict)  # (StepShape, burst) -> last measured seconds
    idle_dispatches: int = 0

    def record(self, record: StepRecord) -> StepRecord:
        """Appends a finished step (in dispatch order), filling in its device time and the idle gap before it."""
        dispatched = record.dispatch_started or record.dispatched_at
        start = max(dispatched, self.device_free_at)
        start_exact = self.device_free_exact or dispatched >= self.device_free_at
        device = max(0.0, record.ready_at - start)
        key = (record.shape, record.burst)
        if record.end_exact and start_exact:
            self.measured[key] = device
        else:
            device = min(device, self.measured.get(key, device))
        record = dataclasses.replace(
            record, device_seconds=device,
            host_gap=max(0.0, dispatched - max(self.device_free_at, self.work_arrived_at)))
        self.device_free_at, self.device_free_exact = start + device, record.end_exact and start_exact
        self.totals = self.totals.plus(record)
        self.steps.append(record)
        if len(self.steps) > self.window:
            self.steps.popleft()
        self.num_steps += 1
        return record

    def work_arrived(self, now: float) -> None:
        self.work_arrived_at = now

    def sample_due(self, shape: StepShape, burst: int = 1) -> bool:
        """For a step just dispatched to an idle device: wait for it now, as a sample of its shape's device time
        (at that burst length)?"""
        self.idle_dispatches += 1
        return (shape, burst) not in self.measured or self.idle_dispatches % SAMPLE_INTERVAL == 0


def attention_work(context_len: int, num_new_tokens: int, sliding_window: int | None = None) -> int:
    """(query, key) pairs of one sequence's chunk: new token i (of n) at position c - n + i attends to the
    c - n + i + 1 tokens up to itself (at most `sliding_window` of them)."""
    first = context_len - num_new_tokens + 1  # keys seen by the chunk's first token
    window = context_len if sliding_window is None else sliding_window
    last_unclipped = min(context_len, window)
    unclipped = max(0, last_unclipped - first + 1) * (first + last_unclipped) // 2
    return unclipped + (context_len - max(first - 1, window)) * window if context_len > window else unclipped


class StepMeter:
    """The engine's measurement hook: it watches a step's life (started, dispatched, fetched, finished) and keeps
    EngineStats. The step loop calls it at those points and knows nothing else about timing; NullMeter is the
    same interface doing nothing."""

    def __init__(self, sliding_window: int | None = None):
        self.stats = EngineStats()
        self._sliding_window = sliding_window
        self._clocks: dict[int, StepClock] = {}  # step id -> what the host saw of it, while it is in flight
        self._started = 0.0
        self._device_idle = True

    def work_arrived(self) -> None:
        self.stats.work_arrived(time.perf_counter())

    def step_started(self, in_flight) -> None:
        """A non-blocking look at the step in flight: has the device finished it?"""
        self._started = now = time.perf_counter()
        self._device_idle = in_flight is None or in_flight.sampled.tokens.is_ready()
        if in_flight is not None and self._device_idle:
            self._clocks[in_flight.plan.step_id].saw_ready(now)

    def dispatching(self, plan) -> None:
        self._clocks[plan.step_id] = StepClock(time.perf_counter())

    def dispatched(self, pending, overlapped: bool) -> None:
        """With the one-step-ahead overlap, a step dispatched to an idle device is sometimes waited for at once:
        an exact sample of its shape's device time (see the module docstring)."""
        self.stats.host_seconds += time.perf_counter() - self._started
        if overlapped and self._device_idle and self.stats.sample_due(pending.shape, pending.plan.burst):
            pending.sampled.tokens.block_until_ready()
            self._clocks[pending.plan.step_id].end = time.perf_counter()

    def fetch_started(self, pending) -> tuple[float, bool]:
        return time.perf_counter(), not pending.sampled.tokens.is_ready()

    def fetch_done(self, pending, started: tuple[float, bool]) -> None:
        start, blocked = started
        self._clocks[pending.plan.step_id].fetched(start, time.perf_counter(), blocked)

    def step_finished(self, pending, generated: int | None = None) -> StepRecord:
        """Records the step whose results were just read; returns its (frozen) record. `generated`: the tokens
        it produced, when rows can produce several (a verify step's accepted proposals); else one per sampling
        row."""
        clock = self._clocks.pop(pending.plan.step_id)
        rows, window = pending.plan.seqs, self._sliding_window
        sampled = context = pairs = 0
        for row in rows:
            sampled += row.sample
            first = row.context_len - row.burst + 1  # a decode burst's steps each read their context
            context += row.burst * first + row.burst * (row.burst - 1) // 2
            if row.num_new_tokens == 1:  # a decode token reads its whole context (or window)
                pairs += row.context_len if window is None else min(row.context_len, window)
            else:
                pairs += attention_work(row.context_len, row.num_new_tokens, window)
        return self.stats.record(StepRecord(
            pending.shape, pending.plan.num_tokens, len(rows), pending.dispatched_at, time.perf_counter(), clock.waited,
            sampled_tokens=sampled if generated is None else generated, context_tokens=context, attended_pairs=pairs,
            dispatch_started=clock.dispatch_started, ready_at=clock.ready_at, end_exact=clock.end is not None,
            page_stall=pending.plan.waiting_for_pages, burst=pending.plan.burst))


class NullMeter:
    """StepMeter's interface, measuring nothing (its stats stay empty)."""

    def __init__(self):
        self.stats = EngineStats()

    def work_arrived(self) -> None:
        pass

    def step_started(self, in_flight) -> None:
        pass

    def dispatching(self, plan) -> None:
        pass

    def dispatched(self, pending, overlapped: bool) -> None:
        pass

    def fetch_started(self, pending) -> None:
        return None

    def fetch_done(self, pending, started) -> None:
        pass

    def step_finished(self, pending, generated: int | None = None) -> None:
        return None
