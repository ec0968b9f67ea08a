"""What the engine hands back: per request, one CompletionOutput per sample (n of them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TokenLogprob:
    """A token's log-probability and, when asked for, the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (token_id, logprob), best first


@dataclasses.dataclass
class CompletionOutput:
    """One sample. Cumulative fields plus the delta since the previous streamed update."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    new_text: str = ""
    new_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)  # seconds between token steps


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first entry None: nothing predicts token 0
    metrics: RequestMetrics | None = None
    error: str | None = None
