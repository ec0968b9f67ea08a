"""The output processor: the front end's side of the engine boundary. It turns the engine core's frozen deltas
into RequestOutputs and owns everything per request that the core does not need: detokenization, stop strings,
logprob assembly, request metrics.

    engine core ──StepOutputs (frozen)──► OutputProcessor.process ──► RequestOutputs (frozen), stop finishes
                ◄──finish (request, sample, stop string)──┘  the engine frees that sequence's pages

It runs wherever the front end runs: on the event loop for the server (AsyncEngine), in the caller's thread for
the offline LLMEngine. The engine never sees a RequestState, and a RequestOutput never sees a live list.

Cost per step is O(new tokens) for DELTA and FINAL_ONLY requests: text is kept as released pieces plus a short
unreleased tail (at most the longest stop string - 1 characters plus the newest piece), tokens and logprobs are
appended and sliced from where the last output ended.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

from jaxserve.engine.messages import PromptLogprobsChunk, SampleDelta, StepOutputs
from jaxserve.outputs import CompletionOutput, OutputKind, RequestMetrics, RequestOutput, SampleMetrics, TokenLogprob
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class StopFinish:
    """A stop string ended this sample: the engine must finish its sequence."""

    request_id: str
    index: int
    stop: str


class _Sample:
    """One sample's text and tokens. `released` pieces have been decided (no stop string can reach back into
    them); `tail` is held back while a stop string could still begin in it."""

    def __init__(self, detokenizer, hold_back: int):
        self.detokenizer = detokenizer
        self.hold_back = hold_back
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.released: list[str] = []
        self.tail = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.sent_tokens = 0  # tokens (and logprobs) already in a DELTA output
        self.sent_pieces = 0  # released pieces already in a DELTA output
        self.finish_sent = False
        self.times = _SampleTimes()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_text(self, piece: str, stops: tuple[str, ...], include_stop: bool) -> str | None:
        """Adds decoded text; returns the stop string it completed (the text is cut there), if any."""
        start = len(self.tail)
        self.tail += piece
        for stop in stops:
            index = self.tail.find(stop, max(0, start - len(stop) + 1))
            if index >= 0:
                self.tail = self.tail[:index + len(stop) if include_stop else index]
                return stop
        if len(self.tail) > self.hold_back:
            cut = len(self.tail) - self.hold_back
            self.released.append(self.tail[:cut])
            self.tail = self.tail[cut:]
        return None

    def finish(self, reason: str, stop_reason: str | int | None) -> None:
        """Ends the sample: bytes the detokenizer holds are emitted (unless a stop string cut the text), and the
        held-back tail is released."""
        if self.finished:
            return
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.detokenizer is not None and not isinstance(stop_reason, str):
            self.tail += self.detokenizer.flush()
        if self.tail:
            self.released.append(self.tail)
            self.tail = ""

    def delta(self, index: int, with_logprobs: bool, always: bool = False) -> CompletionOutput | None:
        """What this sample gained since its last DELTA output; None if nothing (unless `always`)."""
        news = (len(self.token_ids) > self.sent_tokens or len(self.released) > self.sent_pieces
                or (self.finished and not self.finish_sent))
        if not news and not always:
            return None
        out = CompletionOutput(index, "".join(self.released[self.sent_pieces:]), self.token_ids[self.sent_tokens:],
                               self.logprobs[self.sent_tokens:] if with_logprobs else None,
                               self.finish_reason, self.stop_reason, len(self.token_ids))
        self.sent_tokens, self.sent_pieces = len(self.token_ids), len(self.released)
        self.finish_sent = self.finished
        return out

    def whole(self, index: int, with_logprobs: bool) -> CompletionOutput:
        return CompletionOutput(index, "".join(self.released), list(self.token_ids),
                                list(self.logprobs) if with_logprobs else None, self.finish_reason,
                                self.stop_reason, len(self.token_ids))


class _SampleTimes:
    """One sample's times while it runs."""

    def __init__(self):
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.gaps: list[float] = []

    def token_step(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        elif now > self.last_token:  # the n samples of a request get their tokens at the same `now`
            self.gaps.append(now - self.last_token)
        self.last_token = now

    def frozen(self) -> SampleMetrics:
        return SampleMetrics(self.scheduled, self.first_token, self.last_token, tuple(self.gaps))


class _Times(_SampleTimes):
    """A request's metrics while it runs (the final output gets a frozen RequestMetrics): its samples' steps
    together."""

    def __init__(self, arrival: float):
        super().__init__()
        self.arrival = arrival

    def frozen(self, finished: float | None, samples: tuple[SampleMetrics, ...]) -> RequestMetrics:
        return RequestMetrics(self.arrival, self.scheduled, self.first_token, self.last_token, finished,
                              tuple(self.gaps), samples)


class RequestState:
    """One request on the front end's side. Without `notify`, the processor hands out its outputs as steps
    apply; with it (AsyncEngine), the processor only calls notify() when there is news and the reader pulls
    `output()` when it is ready: however many steps pass in between, the reader gets one output holding all of
    them, and nothing piles up for a reader that stalls."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: tuple[int, ...],
                 params: SamplingParams, tokenizer, arrival_time: float, kind: OutputKind = OutputKind.DELTA,
                 notify=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.kind = kind
        self.notify = notify
        self.error: str | None = None  # why the request failed (it is finished then)
        self.finish_time: float | None = None
        hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.samples = [_Sample(_detokenizer(tokenizer, prompt_token_ids, params), hold_back)
                        for _ in range(params.n)]
        self.times = _Times(arrival_time)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self._prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def apply(self, delta: SampleDelta, now: float) -> StopFinish | None:
        """Takes one delta; returns a StopFinish when a stop string ended the sample."""
        sample = self.samples[delta.index]
        if delta.scheduled_time is not None:
            if self.times.scheduled is None:
                self.times.scheduled = delta.scheduled_time
            if sample.times.scheduled is None:
                sample.times.scheduled = delta.scheduled_time
        if delta.prompt_logprobs is not None:
            self._add_prompt_logprobs(delta.prompt_logprobs)
        if sample.finished:
            return None  # a token computed after a stop string ended it, or a late abort: dropped
        stop = self._add_tokens(sample, delta, now) if delta.token_ids else None
        if stop is not None:
            sample.finish("stop", stop)
            return StopFinish(self.request_id, delta.index, stop)
        if delta.finished:
            sample.finish(delta.finish_reason, delta.stop_reason)
        return None

    def _add_tokens(self, sample: _Sample, delta: SampleDelta, now: float) -> str | None:
        self.times.token_step(now)
        sample.times.token_step(now)
        sample.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            sample.logprobs.extend(delta.logprobs)
        if sample.detokenizer is None:
            return None
        piece = sample.detokenizer.add(delta.token_ids)
        return sample.add_text(piece, self.params.stop, self.params.include_stop_str_in_output)

    def _add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        if self.prompt_logprobs is None:
            return
        last = min(len(chunk.logprobs), len(self.prompt_logprobs) - chunk.first_position)
        for j in range(max(last, 0)):
            position = chunk.first_position + j
            self.prompt_logprobs[position] = TokenLogprob(self.prompt_token_ids[position], chunk.logprobs[j],
                                                          chunk.top[j])

    def finish_all(self, reason: str) -> None:
        for sample in self.samples:
            sample.finish(reason, None)

    def fail(self, error: str) -> None:
        """Ends every sample with "error" (without flushing a detokenizer: it may be what failed)."""
        if self.error is None:
            self.error = error
        for sample in self.samples:
            sample.detokenizer = None
            sample.finish("error", None)

    def output(self, now: float, error: str | None = None) -> RequestOutput | None:
        """This request's output after the deltas applied so far, by its OutputKind; None when there is
        nothing to say (FINAL_ONLY before the end, DELTA without news)."""
        error = error or self.error
        now = self.finish_time if self.finish_time is not None else now
        finished = self.finished
        with_logprobs = self.params.logprobs is not None
        if self.kind is OutputKind.DELTA:  # the final output lists every sample, so it tells how each ended
            outputs = [o for i, s in enumerate(self.samples)
                       if (o := s.delta(i, with_logprobs, always=finished)) is not None]
            if not outputs:
                return None
        elif self.kind is OutputKind.FINAL_ONLY and not finished:
            return None
        else:
            outputs = [s.whole(i, with_logprobs) for i, s in enumerate(self.samples)]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs, finished,
                             self._prompt_logprobs_output(finished),
                             self._metrics(now) if finished else None, error)

    def _metrics(self, now: float) -> RequestMetrics:
        return self.times.frozen(now, tuple(s.times.frozen() for s in self.samples))

    def _prompt_logprobs_output(self, finished: bool) -> list[TokenLogprob | None] | None:
        """Sent once, complete: with the first output after the whole prompt was scored (or the final one)."""
        if self.prompt_logprobs is None:
            return None
        if self.kind is OutputKind.DELTA:
            complete = finished or any(s.token_ids for s in self.samples)
            if self._prompt_logprobs_sent or not complete:
                return None
            self._prompt_logprobs_sent = True
        return list(self.prompt_logprobs)


class OutputProcessor:
    """The RequestStates of one front end. Not thread-safe: use it from one thread."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.failed: list[str] = []  # requests process() failed since the caller last emptied this

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: tuple[int, ...], params: SamplingParams,
            arrival_time: float, kind: OutputKind = OutputKind.DELTA, notify=None) -> RequestState:
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival_time, kind,
                             notify)
        self.states[request_id] = state
        return state

    def drop(self, request_id: str) -> None:
        """The caller is gone (a closed stream): later deltas for the request are ignored."""
        self.states.pop(request_id, None)

    def process(self, step: StepOutputs) -> tuple[list[RequestOutput], list[StopFinish]]:
        """Applies a step's deltas; returns the outputs to hand out and the samples stop strings ended. A delta
        that cannot be applied (detokenizing raised) fails its request alone, which is then in `self.failed`
        for the caller to abort in the engine."""
        touched: dict[str, RequestState] = {}
        finishes = []
        for delta in step.deltas:
            state = self.states.get(delta.request_id)
            if state is None:
                continue
            try:
                finish = state.apply(delta, step.time)
            except Exception as exc:  # noqa: BLE001 - one request's output must not take the others down
                log.exception("request %s: its output could not be processed", delta.request_id)
                state.fail(f"{type(exc).__name__}: {exc}")
                self.failed.append(delta.request_id)
                finish = None
            if finish is not None:
                finishes.append(finish)
            touched[delta.request_id] = state
        return self._outputs(touched.values(), step.time), finishes

    def fail(self, request_ids: Iterable[str], error: str, now: float) -> list[RequestOutput]:
        """The engine failed: these requests end with finish_reason "error"."""
        states = [s for rid in request_ids if (s := self.states.get(rid)) is not None]
        for state in states:
            state.fail(error)
        return self._outputs(states, now)

    def _outputs(self, states: Iterable[RequestState], now: float) -> list[RequestOutput]:
        outputs = []
        for state in list(states):
            if state.finished and state.finish_time is None:
                state.finish_time = now
            if state.notify is not None:
                if state.finished or state.kind is not OutputKind.FINAL_ONLY:
                    state.notify()  # its reader pulls the output
            elif (output := state.output(now)) is not None:
                outputs.append(output)
            if state.finished:
                self.states.pop(state.request_id, None)
        return outputs


def _detokenizer(tokenizer, prompt_ids: tuple[int, ...], params: SamplingParams):
    if tokenizer is None:
        return None
    from jaxserve.tokenizer import IncrementalDetokenizer
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
