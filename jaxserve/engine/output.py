"""Per-request output state on the host: detokenization, stop strings, logprobs, streaming deltas."""

from __future__ import annotations

import dataclasses

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import SampledToken
from jaxserve.scheduler.sequence import Sequence


@dataclasses.dataclass
class _Sample:
    """One sample's text: `text` is everything decoded so far, `released` what has been handed out. Until the
    sample ends, the last (longest stop string - 1) characters are held back: they could begin a stop string."""

    detokenizer: object | None
    text: str = ""
    released: int = 0
    token_ids_released: int = 0
    flushed: bool = False

    def flush(self, stopped_by_string: bool) -> None:
        """At the end of the sample: emit bytes the detokenizer still holds (unless a stop string cut the text)."""
        if not self.flushed and self.detokenizer is not None and not stopped_by_string:
            self.text += self.detokenizer.flush()
        self.flushed = True


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], tokenizer, arrival_time: float, stream: bool = True):
        self.stream = stream  # False: the caller wants the final output only
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = seqs
        self.metrics = RequestMetrics(arrival_time)
        self.outputs = [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                        for i in range(params.n)]
        self._samples = [_Sample(_detokenizer(tokenizer, prompt_ids, params)) for _ in range(params.n)]
        self._hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def append_token(self, seq: Sequence, token: SampledToken, now: float) -> str | None:
        """Adds a sampled token; returns the stop string it completed, if any (the caller finishes the sequence)."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        elif now > self.metrics.last_token_time:  # the n samples of a request get their tokens at the same `now`
            self.metrics.inter_token_latencies.append(now - self.metrics.last_token_time)
        self.metrics.last_token_time = now
        out, sample = self.outputs[seq.index], self._samples[seq.index]
        out.token_ids.append(token.token_id)
        if out.logprobs is not None:
            out.logprobs.append(TokenLogprob(token.token_id, token.logprob, list(token.top)))
        if sample.detokenizer is None:
            return None
        start = len(sample.text)
        sample.text += sample.detokenizer.add([token.token_id])
        return self._truncate_at_stop(sample, start)

    def _truncate_at_stop(self, sample: _Sample, start: int) -> str | None:
        for stop in self.params.stop:
            index = sample.text.find(stop, max(0, start - len(stop) + 1))
            if index >= 0:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                sample.text = sample.text[:end]
                return stop
        return None

    def add_prompt_logprobs(self, first_position: int, chosen, top_ids, top_lp) -> None:
        """Scores computed at positions first_position.. predict the prompt tokens one further on."""
        k = self.params.prompt_logprobs or 0
        for j in range(len(chosen)):
            target = first_position + j + 1
            if target < len(self.prompt_ids):
                top = list(zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist()))
                self.prompt_logprobs[target] = TokenLogprob(self.prompt_ids[target], float(chosen[j]), top)

    def finish_all(self, reason: str) -> RequestOutput:
        for seq in self.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
        return self.output(None)

    def output(self, now: float | None) -> RequestOutput:
        """The request's state now, with each sample's delta since the previous call."""
        for seq, out, sample in zip(self.seqs, self.outputs, self._samples):
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
            if out.finished:
                sample.flush(stopped_by_string=isinstance(seq.stop_reason, str))
            releasable = len(sample.text) if out.finished else max(sample.released, len(sample.text) - self._hold_back)
            out.new_text = sample.text[sample.released:releasable]
            out.text = sample.text[:releasable]
            sample.released = releasable
            out.new_token_ids = out.token_ids[sample.token_ids_released:]
            sample.token_ids_released = len(out.token_ids)
        if self.finished and now is not None:
            self.metrics.finished_time = now
        snapshot = [CompletionOutput(o.index, o.text, list(o.token_ids), o.logprobs, o.finish_reason, o.stop_reason,
                                     o.new_text, o.new_token_ids) for o in self.outputs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, snapshot,
                             finished=all(o.finished for o in self.outputs), prompt_logprobs=self.prompt_logprobs,
                             metrics=self.metrics)


def _detokenizer(tokenizer, prompt_ids: list[int], params: SamplingParams):
    if tokenizer is None:
        return None
    from jaxserve.tokenizer import IncrementalDetokenizer
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
