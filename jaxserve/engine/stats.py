"""Step-level accounting the benchmarks and metrics read: what ran, how long the host waited for the device."""

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


@dataclasses.dataclass
class EngineStats:
    window: int = 4096
    steps: collections.deque = dataclasses.field(default_factory=collections.deque)
    num_steps: int = 0
    host_seconds: float = 0.0  # scheduling + input building + dispatch, summed over steps

    def record(self, record: StepRecord) -> None:
        self.steps.append(record)
        if len(self.steps) > self.window:
            self.steps.popleft()
        self.num_steps += 1
