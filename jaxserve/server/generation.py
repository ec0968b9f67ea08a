"""From a parsed request to engine streams, shared by completions and chat: the model check, tokenization (in
a worker thread, off both the event loop and the engine thread), sampling parameters, and admission: the engine's
verdict on the request (400 naming the request's field: ranges, token ids, max_model_len), 429 or 503."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping, Sequence

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from jaxserve.engine.client import EngineDeadError, QueueFullError, RequestStream
from jaxserve.outputs import OutputKind
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError, bad_request, service_unavailable, too_many_requests
from jaxserve.server.protocol import SamplingFields
from jaxserve.server.state import ServerState
from jaxserve.server.streaming import close_all
from jaxserve.validation import InvalidRequestError, unicode_problem


@dataclasses.dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str


async def read_json(request: Request):
    """The body as JSON. Malformed JSON, NaN/Infinity, invalid UTF-8 and strings that are not valid Unicode (a
    lone surrogate escape such as "\\ud800", which JSON allows and nothing downstream can encode) are 400s."""
    body = await request.body()
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    try:
        _check_strings(value, "")
    except RecursionError:
        raise bad_request("the request body nests too deeply", code="invalid_json") from None
    return value


def _check_strings(value: Any, path: str) -> None:
    """Every string of a decoded body, keys too, is valid Unicode; the error names where one is not."""
    if isinstance(value, str):
        problem = unicode_problem(value)
        if problem is not None:
            raise bad_request(f"{path or 'the request body'} {problem}", param=path or None)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, list, dict)):  # a long list of token ids costs one test per id
                _check_strings(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, path)
            _check_strings(item, f"{path}.{key}" if path else key)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def check_model(server: ServerState, model: str | None) -> str | None:
    """The LoRA adapter `model` names (None: the base model); an unknown name is OpenAI's 404 model_not_found."""
    if model is None or model in server.model_names:
        return None
    adapters = [info.name for info in server.engine.loras()]
    if model in adapters:
        return model
    served = ", ".join([*server.model_names, *adapters])
    raise APIError(404, f"The model `{model}` does not exist: this server serves {served}", param="model",
                   code="model_not_found")


async def run_tokenizer(function: Callable, *args, **kwargs):
    """Tokenizer work in a worker thread: a long prompt must not stall every other stream on the event loop."""
    return await run_in_threadpool(function, *args, **kwargs)


def sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, defaults: Mapping[str, Any] | None = None,
                    structured_outputs=None) -> SamplingParams:
    """The engine's parameters for a parsed request; they are validated where the engine takes the request.
    `defaults` (the model's generation_config.json: config.sampling_defaults) replace the built-in defaults of the
    fields the request left unset."""
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    values = dict(
        n=request.n, max_tokens=max_tokens, min_tokens=request.min_tokens, temperature=request.temperature,
        top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, seed=request.seed, stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, logit_bias=request.logit_bias or {},
        skip_special_tokens=request.skip_special_tokens, structured_outputs=structured_outputs)
    given = request.sampling_fields_set()
    values.update({name: value for name, value in (defaults or {}).items() if name not in given})
    return SamplingParams(**values)


def _same_names(index: int) -> Mapping[str, str]:
    return {}


async def submit(server: ServerState, request_id: str, prompts: Sequence[Prompt], params: SamplingParams,
                 stream: bool, field_names: Callable[[int], Mapping[str, str]] = _same_names,
                 lora_name: str | None = None) -> list[RequestStream]:
    """One engine request per prompt, all accepted or none (those already accepted are aborted). A streamed
    response gets deltas, any other only each request's final output. The engine client validates each
    (jaxserve.validation); `field_names(i)` maps its field names to the request's own for prompt i
    ("prompt" -> "messages"), so a 400 names the field the client sent."""
    kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            try:
                streams.append(await server.engine.add_request(f"{request_id}-{i}", prompt.token_ids, params,
                                                               prompt_text=prompt.text, kind=kind,
                                                               lora_name=lora_name))
            except InvalidRequestError as exc:
                raise exc.renamed(field_names(i)) from None
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
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return exc

