"""POST /v1/completions: OpenAI's (legacy) completions, streaming and not.

prompt: a string, a list of strings, a list of token ids, or a list of such lists; one engine request each.
echo: each choice's text starts with its prompt's text; with `logprobs`, the prompt's tokens come first in the
  logprobs (the first has token_logprobs None and top_logprobs None: nothing predicts it).
max_tokens 0 (only with echo, as lm-evaluation-harness scores a prompt): the engine always samples at least one
  token, so it runs max_tokens 1 with prompt logprobs and the sampled token is dropped: the choice is exactly the
  prompt (text and logprobs), finish_reason "length", usage.completion_tokens 0. It costs no extra step: the
  token is sampled in the prompt's last prefill step.
"""

from __future__ import annotations

from typing import Any, Mapping

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.constraints import field_names, structured_outputs
from jaxserve.server.errors import bad_request
from jaxserve.server.generation import Prompt, check_model, read_json, run_tokenizer, sampling_params, submit
from jaxserve.server.logprobs import completion_logprobs
from jaxserve.server.protocol import CompletionRequest, parse_request
from jaxserve.server.responses import ResponseView, respond
from jaxserve.server.state import ServerState, server_of
from jaxserve.structured import StructuredOutputsParams


async def create_completion(request: Request) -> Response:
    server = server_of(request)
    body = parse_request(CompletionRequest, await read_json(request))
    check_completion_request(body, server.config.max_prompts_per_request)
    adapter = check_model(server, body.model)
    prompts = await run_tokenizer(completion_prompts, server, body)
    view = CompletionView(server, body, prompts)
    view.model_name = adapter or server.model_name
    constraint, field = structured_outputs(body)
    params = completion_params(body, server.sampling_defaults, constraint)
    streams = await submit(server, view.id, prompts, params, body.stream,
                           lambda i: {"prompt": prompt_param(body, i), **field_names(field)}, lora_name=adapter)
    return await respond(request, view, streams)


def check_completion_request(body: CompletionRequest, max_prompts: int | None = None) -> None:
    if body.is_batch and max_prompts is not None and len(body.prompt) > max_prompts:
        raise bad_request(f"prompt holds {len(body.prompt)} prompts; this server takes at most {max_prompts} per "
                          f"request (--max-prompts-per-request)", param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0 is accepted only with echo, to score the prompt)",
                          param="max_tokens")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported unless it equals n", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")


def completion_prompts(server: ServerState, body: CompletionRequest) -> list[Prompt]:
    """Text prompts are encoded; token-id prompts are decoded (for echo). The engine checks the ids."""
    items = body.prompt if body.is_batch else [body.prompt]
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(server.tokenizer.encode(item, add_special_tokens=body.add_special_tokens), item))
        else:
            prompts.append(Prompt(list(item), server.tokenizer.decode(item, body.skip_special_tokens)))
    return prompts


def prompt_param(body: CompletionRequest, index: int) -> str:
    return f"prompt[{index}]" if body.is_batch else "prompt"


def completion_params(body: CompletionRequest, defaults: Mapping[str, Any] | None = None,
                      constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    scores_prompt = body.echo and body.logprobs is not None
    return sampling_params(body, max_tokens=max(body.max_tokens, 1), logprobs=body.logprobs,
                           prompt_logprobs=body.logprobs if scores_prompt else None, defaults=defaults,
                           structured_outputs=constraint)


class CompletionView(ResponseView):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, server: ServerState, body: CompletionRequest, prompts: list[Prompt]):
        super().__init__(server, body, prompts)
        self.score_only = body.max_tokens == 0
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._prompt_logprobs: dict[int, tuple] = {}  # prompt index -> its scores (they arrive once per request)

    def completion_tokens(self, sample: CompletionOutput) -> int:
        return 0 if self.score_only else sample.num_tokens

    def choice(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> dict:
        return self._piece(prompt_index, output, sample, finished=True)

    def delta_choices(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> list[dict]:
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = output.prompt_logprobs
        if not (sample.token_ids or sample.text or sample.finished):
            return []  # the prompt (and its logprobs) is not complete yet
        if not self._has_news(self.index(prompt_index, sample), sample):
            return []
        return [self._piece(prompt_index, output, sample, finished=sample.finished)]

    def _has_news(self, index: int, sample: CompletionOutput) -> bool:
        echo_pending = self.body.echo and index not in self._echoed
        new_logprobs = self.body.logprobs is not None and bool(sample.token_ids)
        return bool(sample.text) or sample.finished or echo_pending or new_logprobs

    def _piece(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput, finished: bool) -> dict:
        """A choice, or a streamed part of one (`sample` holds a delta then): the echoed prompt first if not yet
        sent, then generated text."""
        index = self.index(prompt_index, sample)
        token_ids, text, entries = sample.token_ids, sample.text, sample.logprobs or ()
        if self.score_only:
            token_ids, text, entries = (), "", ()
        ids, echo_entries, prefix = self._echo(index, prompt_index, output)
        return {"index": index, "text": prefix + text,
                "logprobs": self._logprobs(index, ids + list(token_ids), echo_entries + list(entries)),
                "finish_reason": self._finish_reason(sample) if finished else None,
                "stop_reason": sample.stop_reason if finished and not self.score_only else None}

    def _echo(self, index: int, prompt_index: int, output: RequestOutput) -> tuple[list[int], list, str]:
        if not self.body.echo or index in self._echoed:
            return [], [], ""
        self._echoed.add(index)
        prompt = self.prompts[prompt_index]
        scores = output.prompt_logprobs or self._prompt_logprobs.get(prompt_index)
        return list(prompt.token_ids), list(scores) if scores is not None else [], prompt.text

    def _logprobs(self, index: int, token_ids: list[int], entries: list) -> dict | None:
        if self.body.logprobs is None:
            return None
        logprobs, self._offsets[index] = completion_logprobs(
            token_ids, entries, self.server.token_text, self._offsets.get(index, 0), self.body.skip_special_tokens)
        return logprobs

    def _finish_reason(self, sample: CompletionOutput) -> str | None:
        return "length" if self.score_only else sample.finish_reason
