"""What crosses the engine core's boundary, both ways. Every type is frozen and holds only tuples, strings and
numbers, so a value made on the engine thread can be read on any other thread while the engine goes on.

    front end ── EngineRequest (validated) ────────────────────────────► engine core (scheduler, device)
              ◄── StepOutputs: SampleDelta per sample with news, SchedulerStats, finished request ids,
                                 the StepRecords of the steps read back ──

No jax here: the server imports these types.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.stats import StepRecord, StepTotals
from jaxserve.outputs import TokenLogprob
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request the front end has tokenized and validated (jaxserve.validation); the core trusts it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float  # time.monotonic
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter to run with (a name the engine has loaded); None: the base


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobsChunk:
    """Scores of a chunk of prompt tokens: logprobs[j] and top[j] are for the prompt token at first_position + j
    (positions past the prompt's end are padding; the output processor knows the prompt and skips them)."""

    first_position: int
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]  # per position: (token_id, logprob), best first


@dataclasses.dataclass(frozen=True, slots=True)
class SampleDelta:
    """What one sample of a request gained in one step. A delta with no tokens may still carry news: the first
    time the sample was scheduled, prompt logprobs of a prompt chunk, or the sample's end (abort)."""

    request_id: str
    index: int  # the sample, 0..n-1
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" (EOS or a stop token) | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    prompt_logprobs: PromptLogprobsChunk | None = None
    scheduled_time: float | None = None  # set once: when the sample first got a device slot (time.monotonic)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Speculative decoding since start-up (vLLM's spec_decode counters): verify rows that carried proposals,
    proposed tokens, accepted ones, and accepted ones by position among a row's proposals."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(cls, counts) -> "SpecDecodeStats":
        """From the scheduler's running counts (jaxserve.scheduler.scheduler.SpeculationCounts)."""
        return cls(counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens,
                   tuple(counts.accepted_per_position))

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verify row: accepted proposals + the target's own token (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @staticmethod
    def combine(stats) -> "SpecDecodeStats":
        width = max((len(s.accepted_per_position) for s in stats), default=0)
        per_position = [0] * width
        for s in stats:
            for i, n in enumerate(s.accepted_per_position):
                per_position[i] += n
        return SpecDecodeStats(sum(s.num_drafts for s in stats), sum(s.num_draft_tokens for s in stats),
                               sum(s.num_accepted_tokens for s in stats), tuple(per_position))


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The engine's state after a step, for admission and metrics (counters are totals since start-up)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV pages in use
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0
    totals: StepTotals = StepTotals()  # steps, tokens, generated tokens, device busy and idle seconds
    spec_decode: SpecDecodeStats = SpecDecodeStats()

    @staticmethod
    def combine(replicas: "tuple[SchedulerStats, ...] | list[SchedulerStats]") -> "SchedulerStats":
        """Data-parallel replicas: counts add up; KV usage is the mean of the replicas'."""
        counts = ("num_running", "num_waiting", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
        return SchedulerStats(**{name: sum(getattr(s, name) for s in replicas) for name in counts},
                              kv_cache_usage=sum(s.kv_cache_usage for s in replicas) / max(len(replicas), 1),
                              totals=StepTotals.combine([s.totals for s in replicas]),
                              spec_decode=SpecDecodeStats.combine([s.spec_decode for s in replicas]))


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutputs:
    deltas: tuple[SampleDelta, ...]
    stats: SchedulerStats
    finished_requests: tuple[str, ...] = ()  # every sample of these has ended: the core forgot them
    time: float = 0.0  # time.monotonic when the step's results were read
    records: tuple[StepRecord, ...] = ()  # the device steps whose results were read (for the bottleneck monitor)
    failed: tuple[tuple[str, str], ...] = ()  # (request id, error): requests a step could not run; the core forgot them
