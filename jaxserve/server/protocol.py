"""The OpenAI request bodies jaxserve accepts (plus vLLM's common extensions), declared once for validation and
for /openapi.json. Ranges match SamplingParams.validate; fields OpenAI defines that jaxserve cannot honour are
accepted only at their neutral value (suffix, best_of != n, response_format other than text)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from jaxserve.server.schema import param

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1

STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
OBJECT = {"type": "object"}
TOKEN_ID = {"type": "integer", "minimum": 0}
TOKEN_IDS = {"type": "array", "items": TOKEN_ID, "minItems": 1}


def integer(minimum: int | None = None, maximum: int | None = None) -> dict:
    schema: dict[str, Any] = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def number(minimum: float | None = None, maximum: float | None = None, *, above: float | None = None) -> dict:
    schema: dict[str, Any] = {"type": "number"}
    if minimum is not None:
        schema["minimum"] = minimum
    if above is not None:
        schema["exclusiveMinimum"] = above
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


PROMPT = {"anyOf": [
    STRING,
    {"type": "array", "items": STRING, "minItems": 1},
    TOKEN_IDS,
    {"type": "array", "items": TOKEN_IDS, "minItems": 1},
]}
STOP = {"anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS}]}
LOGIT_BIAS = {"type": "object", "propertyNames": {"type": "string", "pattern": "^[0-9]{1,9}$"},
              "additionalProperties": number(-100.0, 100.0), "maxProperties": MAX_LOGIT_BIAS}
STREAM_OPTIONS = {"type": "object", "properties": {"include_usage": {"type": ["boolean", "null"]},
                                                   "continuous_usage_stats": {"type": ["boolean", "null"]}}}
CONTENT_PART = {"type": "object", "properties": {"type": {"type": "string", "enum": ["text"]}, "text": STRING},
                "required": ["type", "text"]}  # text only: these models read no images or audio
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool", "function"]},
    "content": {"anyOf": [STRING, {"type": "array", "items": CONTENT_PART}, {"type": "null"}]},
    "name": STRING,
    "tool_calls": {"type": ["array", "null"], "items": OBJECT},
    "tool_call_id": STRING,
}}
RESPONSE_FORMAT = {"type": "object", "required": ["type"],
                   "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}}}


@dataclasses.dataclass(frozen=True)
class SamplingFields:
    """What completions and chat share: the model name, sampling, stopping, streaming."""

    model: str | None = param(STRING, description="a served model name; default: the served model")
    n: int = param(integer(1, MAX_N), 1, description="samples per prompt")
    temperature: float = param(number(0.0, 100.0), 1.0, description="0 is greedy")
    top_p: float = param(number(maximum=1.0, above=0.0), 1.0)
    top_k: int = param(integer(-1), 0, description="0 or -1 disables")
    min_p: float = param(number(0.0, 1.0), 0.0)
    presence_penalty: float = param(number(-2.0, 2.0), 0.0)
    frequency_penalty: float = param(number(-2.0, 2.0), 0.0)
    repetition_penalty: float = param(number(maximum=10.0, above=0.0), 1.0)
    logit_bias: dict | None = param(LOGIT_BIAS, description="token id (as a string) -> bias in [-100, 100]")
    seed: int | None = param(integer(0, MAX_SEED), description="per-request seed: the same seed, the same sample")
    stop: str | list | None = param(STOP, description="strings that end a sample; not included in the text")
    stop_token_ids: list | None = param({"type": "array", "items": TOKEN_ID})
    ignore_eos: bool = param(BOOLEAN, False)
    min_tokens: int = param(integer(0), 0)
    include_stop_str_in_output: bool = param(BOOLEAN, False)
    skip_special_tokens: bool = param(BOOLEAN, True)
    stream: bool = param(BOOLEAN, False)
    stream_options: dict | None = param(STREAM_OPTIONS, description="include_usage: a final chunk with usage")
    user: str | None = param(STRING, description="accepted and ignored")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


@dataclasses.dataclass(frozen=True)
class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list = param(PROMPT, required=True,
                               description="a string, a list of strings, token ids, or a list of token id lists")
    max_tokens: int = param(integer(0), 16, description="0 only with echo: score the prompt, generate nothing")
    echo: bool = param(BOOLEAN, False, description="prepend the prompt (and its logprobs) to each choice")
    logprobs: int | None = param(integer(0, MAX_TOP_LOGPROBS), description="top alternatives per token")
    best_of: int | None = param(integer(1, MAX_N), description="only best_of == n is supported")
    suffix: str | None = param(STRING, description="not supported; only an empty suffix is accepted")
    add_special_tokens: bool = param(BOOLEAN, True, description="add the tokenizer's BOS to text prompts")


@dataclasses.dataclass(frozen=True)
class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list = param({"type": "array", "items": MESSAGE, "minItems": 1}, required=True)
    max_tokens: int | None = param(integer(1), description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = param(integer(1), description="default: up to the model's length")
    logprobs: bool = param(BOOLEAN, False)
    top_logprobs: int | None = param(integer(0, MAX_TOP_LOGPROBS), description="needs logprobs: true")
    response_format: dict | None = param(RESPONSE_FORMAT, description="only {\"type\": \"text\"} is supported")
    tools: list | None = param({"type": "array", "items": OBJECT},
                               description="passed to the chat template; tool calls are not parsed")
    tool_choice: str | dict | None = param({"type": ["string", "object"]}, description="accepted and ignored")
    parallel_tool_calls: bool | None = param(BOOLEAN, description="accepted and ignored")
    add_generation_prompt: bool = param(BOOLEAN, True)
    chat_template_kwargs: dict | None = param(OBJECT, description="extra variables for the chat template")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """POST /tokenize: either `prompt` or `messages`."""

    model: str | None = param(STRING)
    prompt: str | None = param(STRING)
    messages: list | None = param({"type": "array", "items": MESSAGE, "minItems": 1})
    add_special_tokens: bool | None = param(BOOLEAN, description="default: true for prompt, false for messages")
    add_generation_prompt: bool = param(BOOLEAN, True)
    return_token_strs: bool = param(BOOLEAN, False)


@dataclasses.dataclass(frozen=True)
class DetokenizeRequest:
    """POST /detokenize."""

    model: str | None = param(STRING)
    tokens: list = param({"type": "array", "items": TOKEN_ID}, required=True)
