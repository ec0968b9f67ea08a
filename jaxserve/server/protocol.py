"""The OpenAI request bodies jaxserve accepts (plus vLLM's common extensions) as pydantic v2 models: they validate a
request (`parse_request`) and describe it in /openapi.json (pydantic's JSON Schema). Numeric bounds come from
jaxserve.validation's table, the one the engine checks against. Fields OpenAI defines that jaxserve cannot honour
are accepted only at their neutral value (suffix, best_of != n). Structured output: OpenAI's `response_format`,
vLLM's `structured_outputs` object and its older `guided_*` fields (jaxserve.server.constraints turns them into
one StructuredOutputsParams).

Conventions (those of the hand-written validator these models replaced): unknown body fields are ignored; an explicit null means "not
given" (the field takes its default, and is not in `model_fields_set`); types are strict (no "5" for 5, no true for
1) except that an integral number (2.0) is accepted as an integer, as JSON Schema counts it; errors are 400s whose
`param` is the path of the field at fault ("messages[0].content", "logit_bias.abc").
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      model_validator)

from jaxserve.server.errors import APIError, bad_request
from jaxserve.validation import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS,
                                 MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID, SAMPLING_RANGES, format_number)


def _integral(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


def _integral_items(value: Any) -> Any:
    if isinstance(value, list) and any(type(item) is float for item in value):
        return [_integral(item) for item in value]
    return value


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1), BeforeValidator(_integral_items)]


def _bounds(name: str, changes: dict[str, Any]) -> dict[str, float]:
    allowed = SAMPLING_RANGES[name]
    return (dataclasses.replace(allowed, **changes) if changes else allowed).bounds()


def int_in(name: str, **changes: Any) -> Any:
    """An integer bounded by SAMPLING_RANGES[name] (`changes` adjust the range for one request field)."""
    return Annotated[int, Field(**_bounds(name, changes)), BeforeValidator(_integral)]


def float_in(name: str, **changes: Any) -> Any:
    """A number bounded by SAMPLING_RANGES[name]."""
    return Annotated[float, Field(**_bounds(name, changes))]


def one_of(description: str, kind: Callable[[Any], str | None], **branches: Any) -> Any:
    """A union whose branch is chosen by `kind(value)` (a branch name, or None: no branch fits), so an error
    is reported against the branch the value resembles, at the value's own path."""
    members = tuple(Annotated[branch, Tag(name)] for name, branch in branches.items())
    return Annotated[Union[members], Discriminator(kind, custom_error_type="invalid_type",
                                                   custom_error_message=f"must be {description}")]


def _text_or_list(value: Any) -> str | None:
    return "<text>" if isinstance(value, str) else "<list>" if isinstance(value, list) else None


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "<text>"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    if isinstance(first, list):
        return "<id lists>"
    return "<ids>" if isinstance(first, (int, float)) and not isinstance(first, bool) else "<texts>"


def _string_or_object(value: Any) -> str | None:
    return "<text>" if isinstance(value, str) else "<object>" if isinstance(value, dict) else None


PromptInput = one_of("a string or an array of strings or an array of integers or an array of arrays of integers",
                     _prompt_kind, **{"<text>": str, "<texts>": Annotated[list[str], Field(min_length=1)],
                                      "<ids>": TokenIds, "<id lists>": Annotated[list[TokenIds], Field(min_length=1)]})
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LENGTH)]
Stop = one_of("a string or an array of strings", _text_or_list, **{
    "<text>": StopString, "<list>": Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]})
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                           Annotated[float, Field(**LOGIT_BIAS_RANGE.bounds())]], Field(max_length=MAX_LOGIT_BIAS)]
UNION_TAGS = frozenset({"<text>", "<texts>", "<ids>", "<id lists>", "<list>", "<object>"})


class RequestModel(BaseModel):
    """Strict types, unknown fields ignored, null = absent."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            return {name: value for name, value in data.items() if value is not None}
        return data


class OpenObject(BaseModel):
    """A nested object whose unknown members are kept (chat messages reach the template whole)."""

    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(OpenObject):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class TextPart(OpenObject):
    type: Literal["text"]  # text only: these models read no images or audio
    text: str


class Message(OpenObject):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: one_of("a string or an array of text parts", _text_or_list,
                    **{"<text>": str, "<list>": list[TextPart]}) | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_input(self) -> dict:
        """The message as the chat template reads it: content a string (null: "", text parts joined)."""
        message = self.model_dump(exclude_unset=True)
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        return {**message, "content": content or ""}


class JsonSchemaFormat(OpenObject):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON Schema the output follows")
    strict: bool | None = None


class ResponseFormat(OpenObject):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema: {name, schema, strict}")


class StructuredOutputsField(BaseModel):
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(strict=True, extra="forbid")  # an option we would silently ignore is a 400

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON Schema")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="Lark (llguidance) or GBNF (llama.cpp) syntax")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(None, description="compact JSON (the default here)")
    whitespace_pattern: str | None = Field(None, description="a regex for the whitespace JSON may have between "
                                                             "tokens (default: none)")
    disable_additional_properties: bool | None = Field(
        None, description="objects without additionalProperties allow no other keys")
    disable_fallback: bool | None = Field(None, description="accepted; there is one grammar engine")


JsonSchemaValue = one_of("an object or a string", _string_or_object, **{"<text>": str, "<object>": dict[str, Any]})


Messages = Annotated[list[Message], Field(min_length=1)]


class SamplingFields(RequestModel):
    """What completions and chat share: the model name, sampling, stopping, streaming."""

    model: str | None = Field(None, description="a served model name; default: the served model")
    n: int_in("n") | None = Field(1, description="samples per prompt")
    temperature: float_in("temperature") | None = Field(1.0, description="0 is greedy")
    top_p: float_in("top_p") | None = 1.0
    top_k: int_in("top_k") | None = Field(0, description="0 or -1 disables")
    min_p: float_in("min_p") | None = 0.0
    presence_penalty: float_in("presence_penalty") | None = 0.0
    frequency_penalty: float_in("frequency_penalty") | None = 0.0
    repetition_penalty: float_in("repetition_penalty") | None = 1.0
    logit_bias: LogitBias | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    seed: int_in("seed") | None = Field(None, description="per-request seed: the same seed, the same sample")
    stop: Stop | None = Field(None, description="strings that end a sample; not included in the text")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = False
    min_tokens: int_in("min_tokens") | None = 0
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="include_usage: a final chunk with usage")
    user: str | None = Field(None, description="accepted and ignored")
    response_format: ResponseFormat | None = Field(
        None, description="json_object, or json_schema {name, schema, strict}: the output is JSON that follows it")
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="vLLM's constraints: one of json, regex, choice, grammar, json_object")
    guided_json: JsonSchemaValue | None = Field(None, description="older vLLM name of structured_outputs.json")
    guided_regex: str | None = Field(None, description="older vLLM name of structured_outputs.regex")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="older vLLM name of structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="older vLLM name of structured_outputs.grammar")
    guided_decoding_backend: str | None = Field(None, description="accepted and ignored: llguidance is used")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_fields_set(self) -> set[str]:
        """The SamplingParams fields this request gave a value (null counts as not given)."""
        return set(self.model_fields_set)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput = Field(description="a string, a list of strings, token ids, or a list of token id lists")
    max_tokens: int_in("max_tokens", low=0) | None = Field(
        16, description="0 only with echo: score the prompt, generate nothing")
    echo: bool | None = Field(False, description="prepend the prompt (and its logprobs) to each choice")
    logprobs: int_in("logprobs") | None = Field(None, description="top alternatives per token")
    best_of: int_in("n") | None = Field(None, description="only best_of == n is supported")
    suffix: str | None = Field(None, description="not supported; only an empty suffix is accepted")
    add_special_tokens: bool | None = Field(True, description="add the tokenizer's BOS to text prompts")

    @property
    def is_batch(self) -> bool:
        """A list of prompts (strings or token id lists), rather than one."""
        return isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Messages
    max_tokens: int_in("max_tokens") | None = Field(
        None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int_in("max_tokens") | None = Field(
        None, description="default: up to the model's length")
    logprobs: bool | None = False
    top_logprobs: int_in("logprobs") | None = Field(None, description="needs logprobs: true")
    tools: list[dict[str, Any]] | None = Field(
        None, description="functions the model may call: [{type: function, function: {name, description, "
                          "parameters}}]; passed to the chat template")
    tool_choice: one_of("a string or an object", _string_or_object, **{"<text>": str, "<object>": dict[str, Any]}
                        ) | None = Field(None, description="none | auto (default with tools) | required | "
                                                           "{type: function, function: {name}}")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call with tool_choice required")
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")

    def sampling_fields_set(self) -> set[str]:
        given = set(self.model_fields_set)
        return given | {"max_tokens"} if "max_completion_tokens" in given else given

    @property
    def max_tokens_field(self) -> str:
        """The field that set the length limit: max_completion_tokens wins over its deprecated alias."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(RequestModel):
    """POST /tokenize: either `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


NonEmptyString = Annotated[str, Field(min_length=1)]


class LoadLoraAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: NonEmptyString
    lora_path: NonEmptyString = Field(description="a PEFT adapter directory on the server's file system")


class UnloadLoraAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and ignored: names identify adapters)."""

    lora_name: NonEmptyString
    lora_int_id: int | None = None


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                  LoadLoraAdapterRequest, UnloadLoraAdapterRequest)


# ---- responses (documented in /openapi.json) ----------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(None, description="the request field at fault, e.g. temperature or "
                                                "messages[0].content")
    code: str | None = None


class Error(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: str = Field(description="text_completion | chat.completion")
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(BaseModel):
    prompt: str


class Health(BaseModel):
    status: str


RESPONSE_MODELS = (Error, Completion, ModelList, Tokenized, Detokenized, Health)


# ---- parsing ------------------------------------------------------------------------------------------------
def parse_request(model_class: type[RequestModel], body: Any) -> Any:
    """A decoded JSON body as `model_class`; the first problem found is a 400 naming its field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model_class.model_validate(body)
    except ValidationError as exc:
        raise request_error(exc.errors(include_url=False)[0]) from None


def request_error(error: dict) -> APIError:
    path = error_path(error["loc"])
    return bad_request(f"{path or 'the request body'} {error_message(error)}", param=path or None)


def error_path(loc: tuple) -> str:
    """('messages', 0, 'content', '<list>', 1, 'text') -> 'messages[0].content[1].text'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in UNION_TAGS and part != "[key]":
            path = f"{path}.{part}" if path else part
    return path


JSON_TYPE_ERRORS = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
                    "bool_type": "a boolean", "list_type": "an array", "dict_type": "an object",
                    "model_type": "an object", "model_attributes_type": "an object"}


def error_message(error: dict) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind in JSON_TYPE_ERRORS:
        return f"must be {JSON_TYPE_ERRORS[kind]}, not {json_type_name(value)}"
    if kind == "invalid_type":
        return f"{error['msg']}, not {json_type_name(value)}"
    if kind == "missing":
        return "is required"
    bound = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
             "less_than": ("<", "lt")}.get(kind)
    if bound is not None:
        return f"must be {bound[0]} {format_number(ctx[bound[1]])}, got {format_number(value)}"
    if kind in ("too_short", "string_too_short"):
        return "must not be empty" if ctx.get("min_length") == 1 else error["msg"]
    if kind == "too_long":
        unit = "entries" if isinstance(value, dict) else "items"
        return f"may hold at most {ctx['max_length']} {unit}"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx['pattern']}, got {value!r}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, not {value!r}"
    return error["msg"]


def json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    return {float: "a number", str: "a string", list: "an array", dict: "an object"}.get(type(value),
                                                                                       type(value).__name__)
