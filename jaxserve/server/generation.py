"""From a validated request to engine streams, shared by completions and chat: the model check, tokenization (in
a worker thread, off both the event loop and the engine thread), sampling parameters, the length check against
max_model_len, and admission (429 / 503)."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from jaxserve.engine.client import EngineDeadError, QueueFullError, RequestStream
from jaxserve.outputs import OutputKind
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import bad_request, service_unavailable, too_many_requests
from jaxserve.server.protocol import SamplingFields
from jaxserve.server.state import ServerState
from jaxserve.server.streaming import close_all


@dataclasses.dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str


async def read_json(request: Request):
    """The body as JSON. Malformed JSON, NaN/Infinity and invalid UTF-8 are 400s."""
    body = await request.body()
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def check_model(server: ServerState, model: str | None) -> None:
    if model is not None and model not in server.model_names:
        raise bad_request(f"model {model!r} is not served here; this server serves {', '.join(server.model_names)}",
                          param="model", code="model_not_found")


async def run_tokenizer(function: Callable, *args, **kwargs):
    """Tokenizer work in a worker thread: a long prompt must not stall every other stream on the event loop."""
    return await run_in_threadpool(function, *args, **kwargs)


def sampling_params(server: ServerState, request: SamplingFields, *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    params = SamplingParams(
        n=request.n, max_tokens=max_tokens, min_tokens=request.min_tokens, temperature=request.temperature,
        top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, seed=request.seed, stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, logit_bias=request.logit_bias or {},
        skip_special_tokens=request.skip_special_tokens)
    try:
        params.validate(server.vocab_size)
    except ValueError as exc:
        raise bad_request(str(exc), param=str(exc).split()[0]) from None
    return params


def check_length(server: ServerState, prompt: Prompt, max_tokens: int | None, *, prompt_param: str,
                 max_tokens_param: str) -> None:
    """What the scheduler would refuse, refused here with the parameter named."""
    limit, length = server.max_model_len, len(prompt.token_ids)
    if length >= limit:
        raise bad_request(f"{prompt_param} has {length} tokens; max_model_len {limit} leaves no room to generate",
                          param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and length + max_tokens > limit:
        raise bad_request(f"{prompt_param} ({length} tokens) + {max_tokens_param} ({max_tokens}) exceeds "
                          f"max_model_len {limit}", param=max_tokens_param, code="context_length_exceeded")


def check_token_ids(server: ServerState, token_ids: Sequence[int], param: str) -> None:
    bad = next((t for t in token_ids if t >= server.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param} holds token id {bad}, outside the vocabulary [0, {server.vocab_size})",
                          param=param)


async def submit(server: ServerState, request_id: str, prompts: Sequence[Prompt], params: SamplingParams,
                 stream: bool) -> list[RequestStream]:
    """One engine request per prompt, all accepted or none (those already accepted are aborted). A streamed
    response gets deltas, any other only each request's final output."""
    kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await server.engine.add_request(f"{request_id}-{i}", prompt.token_ids, params,
                                                           prompt_text=prompt.text, kind=kind))
    except BaseException as exc:
        close_all(streams)
        if isinstance(exc, Exception):
            raise _admission_error(server, exc) from exc
        raise
    return streams


def _admission_error(server: ServerState, exc: Exception) -> Exception:
    if isinstance(exc, QueueFullError):
        server.metrics.observe_rejected("queue_full")
        return too_many_requests(f"the server is at capacity ({exc}); retry later", server.config.retry_after)
    if isinstance(exc, EngineDeadError):
        server.metrics.observe_rejected("engine_dead")
        return service_unavailable(f"the engine is not running: {exc}")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return exc

