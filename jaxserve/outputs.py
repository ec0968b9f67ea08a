"""What a caller gets back: per request, one CompletionOutput per sample (n of them). The dataclasses are frozen
and their lists are fresh copies made for that output on the caller's side of the engine boundary (the output
processor): nothing else holds them, so an output never changes after it is handed out.

How much an output holds depends on the request's OutputKind:

    DELTA       (streaming)       text / token_ids / logprobs: only what the sample gained since the last output
    CUMULATIVE                    text / token_ids / logprobs: everything so far (costs O(length) per output)
    FINAL_ONLY  (non-streaming)   one output per request, when every sample has finished, holding everything
"""

from __future__ import annotations

import dataclasses
import enum


class OutputKind(enum.Enum):
    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability and, when asked for, the top alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample. `text`, `token_ids` and `logprobs` are the delta or everything, by the request's OutputKind;
    `num_tokens` always counts every token the sample has generated so far."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids (None: not asked for)
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, slots=True)
class SampleMetrics:
    """Times (time.monotonic) of one of a request's n samples. vLLM runs each sample as a child request, so its
    request metrics count samples; the server's metrics do the same from these (docs/metrics.md)."""

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: tuple[float, ...] = ()  # seconds between the sample's token-bearing steps


@dataclasses.dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Times (time.monotonic) of one request, as its output processor saw them; on its final output. The
    request-level times span its samples (first of the firsts, last of the lasts); `samples` has each one's."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: tuple[float, ...] = ()  # seconds between the request's token-bearing steps
    samples: tuple[SampleMetrics, ...] = ()  # one per sample, in index order


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # DELTA: only the samples with news in this output (the final one: all)
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first None: nothing predicts token 0; sent once
    metrics: RequestMetrics | None = None  # on the final output only
    error: str | None = None  # the engine failed: the request ended with finish_reason "error"
