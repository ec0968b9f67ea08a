"""Request validation, in one place: `validate_request(prompt_token_ids, params, limits)`. Pure Python, no jax.

The engine client calls it before a request is queued; nothing downstream checks again. The ranges live in one
table, `SAMPLING_RANGES`, from which the HTTP request models (jaxserve.server.protocol) take their bounds too, so
/openapi.json, the 400s and the engine cannot disagree.

Errors are InvalidRequestError (a ValueError): `param` names the offending SamplingParams field ("prompt" for the
prompt), `str()` is a message fit for a 400, and `code` is "context_length_exceeded" for the length errors. A
front end whose fields have other names rewrites them with `renamed()` (chat: "prompt" -> "messages").
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 512  # characters: the output processor holds back that much text, and scans it per token
MAX_STOP_TOKEN_IDS = 16  # with the EOS ids, they fit the sampler's banned-id row (sampler.MAX_BANNED)
MAX_INT32 = 2**31 - 1  # counts and ids the device holds as int32
MAX_TOKEN_ID = MAX_INT32  # token ids are int32 on the device; the vocabulary bound is checked per model
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclasses.dataclass(frozen=True)
class Range:
    """A closed or half-open numeric interval; None is an open end."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, ...: low itself is refused
    integer: bool = False  # only ints (the engine counts with it, or puts it in an int32)

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if isinstance(value, float) and math.isnan(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {format_number(self.low)}"
        if self.low is None:
            return f"must be <= {format_number(self.high)}"
        return f"must be in {'(' if self.low_open else '['}{format_number(self.low)}, {format_number(self.high)}]"

    def bounds(self) -> dict[str, float]:
        """The pydantic / JSON Schema keywords: ge or gt, le."""
        out: dict[str, float] = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["le"] = self.high
        return out


# SamplingParams field -> its allowed values (None only for OPTIONAL_FIELDS). Every range is
# closed on both sides, in what the device holds (int32 counts, float32 values), so no value can overflow later.
SAMPLING_RANGES: Mapping[str, Range] = {
    "n": Range(1, 128, integer=True),
    "max_tokens": Range(1, MAX_INT32, integer=True),  # and, per model, prompt + max_tokens <= max_model_len
    "min_tokens": Range(0, MAX_INT32, integer=True),  # and <= max_tokens, or what max_model_len leaves
    "temperature": Range(0, 100),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(-1, MAX_INT32, integer=True),  # -1 and 0 disable it; above the vocabulary, it keeps every token
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, 10, low_open=True),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "seed": Range(0, 2**63 - 1, integer=True),
    "logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
}
OPTIONAL_FIELDS = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs"})  # None is a value of these
BOOLEAN_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
LOGIT_BIAS_RANGE = Range(-100, 100)  # each bias value
TOKEN_ID_RANGE = Range(0, MAX_TOKEN_ID)


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against besides the fixed ranges: the model's vocabulary and context length."""

    vocab_size: int
    max_model_len: int
    speculative: bool = False  # the engine speculates (no structured output there yet)


class InvalidRequestError(ValueError):
    """A request the engine refuses. `param`: the SamplingParams field at fault ("prompt" for the prompt), or None.

    The message is kept as a template whose field names are `{placeholders}`, so `renamed()` can speak the
    front end's names ("{prompt} has 300 tokens" -> "messages has 300 tokens").
    """

    def __init__(self, template: str, param: str | None = None, code: str | None = None,
                 names: Mapping[str, str] | None = None):
        self.template = template
        self.param = param
        self.code = code
        self.names = dict(names or {})
        super().__init__(template.format_map(_Names(self.names)))

    def renamed(self, names: Mapping[str, str]) -> "InvalidRequestError":
        """The same error in the request's own vocabulary: `names` maps a field to the request's name for it."""
        return InvalidRequestError(self.template, names.get(self.param, self.param), self.code, names)

    def __reduce__(self):  # crosses process boundaries (multi-host, replicas) with its fields
        return InvalidRequestError, (self.template, self.param, self.code, self.names)


class _Names(dict):
    def __missing__(self, key: str) -> str:
        return key


def validate_request(prompt_token_ids: Sequence[int], params: "SamplingParams", limits: RequestLimits) -> None:
    """Raises InvalidRequestError for the first problem found: sampling ranges, token ids, then lengths."""
    validate_sampling_params(params)
    _check_token_ids("logit_bias", (token for token, _ in params.logit_bias), limits.vocab_size)
    _check_token_ids("stop_token_ids", params.stop_token_ids, limits.vocab_size)
    _check_prompt(prompt_token_ids, params, limits)
    if limits.speculative and params.structured_outputs is not None:
        raise InvalidRequestError("structured output is not available on a server with speculative decoding "
                                  "(--speculative-method) yet: its verify step does not apply the grammar's mask",
                                  "structured_outputs")


def validate_sampling_params(params: "SamplingParams") -> None:
    """The checks that need no model: ranges and shapes of the sampling parameters alone."""
    for name, allowed in SAMPLING_RANGES.items():
        value = getattr(params, name)
        if value is None and name in OPTIONAL_FIELDS:
            continue
        if allowed.integer and isinstance(value, float):
            raise InvalidRequestError(f"{{{name}}} must be an integer, got {value!r}", name)
        if not allowed.contains(value):
            raise InvalidRequestError(f"{{{name}}} {allowed.describe()}, got {format_number(value)}", name)
    for name in BOOLEAN_FIELDS:
        if not isinstance(getattr(params, name), bool):
            raise InvalidRequestError(f"{{{name}}} must be true or false", name)
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise InvalidRequestError(f"{{min_tokens}} ({params.min_tokens}) must not exceed {{max_tokens}} "
                                  f"({params.max_tokens})", "min_tokens")
    _check_stop_strings(params.stop)
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"{{stop_token_ids}} may hold at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"{{logit_bias}} may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    if not all(LOGIT_BIAS_RANGE.contains(bias) for _, bias in params.logit_bias):
        raise InvalidRequestError(f"{{logit_bias}} values {LOGIT_BIAS_RANGE.describe()}", "logit_bias")
    if params.structured_outputs is not None:
        params.structured_outputs.check()  # its shape; whether it compiles is the grammar engine's call


def _check_stop_strings(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"{{stop}} may hold at most {MAX_STOP_STRINGS} strings", "stop")
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError("{stop} must hold non-empty strings", "stop")
    if any(len(s) > MAX_STOP_STRING_LENGTH for s in stop):
        raise InvalidRequestError(f"{{stop}} strings may be at most {MAX_STOP_STRING_LENGTH} characters long",
                                  "stop")
    for s in stop:
        check_text("stop", s)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(param: str, text: str) -> None:
    """Text must be valid Unicode: a lone surrogate ("\\ud800" in JSON) has no UTF-8 form, so no tokenizer or
    response could carry it."""
    problem = unicode_problem(text)
    if problem is not None:
        raise InvalidRequestError(f"{{{param}}} {problem}", param)


def unicode_problem(text: str) -> str | None:
    """What makes `text` invalid Unicode ("is not valid Unicode: ..."), or None."""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return f"is not valid Unicode: it holds a lone surrogate (U+{ord(found.group()):04X}) at character {found.start()}"


def _check_token_ids(param: str, token_ids, vocab_size: int) -> None:
    bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size),
               None)
    if bad is not None:
        raise InvalidRequestError(f"{{{param}}} holds token id {bad}, outside the vocabulary "
                                  f"[0, {vocab_size})", param)


def _check_prompt(prompt_token_ids: Sequence[int], params: "SamplingParams", limits: RequestLimits) -> None:
    length, limit = len(prompt_token_ids), limits.max_model_len
    if length == 0:
        raise InvalidRequestError("{prompt} must contain at least one token", "prompt")
    _check_token_ids("prompt", prompt_token_ids, limits.vocab_size)
    if length >= limit:
        raise InvalidRequestError(f"{{prompt}} has {length} tokens; max_model_len {limit} leaves no room to "
                                  f"generate", "prompt", CONTEXT_LENGTH_EXCEEDED)
    if params.max_tokens is not None and length + params.max_tokens > limit:
        raise InvalidRequestError(f"{{prompt}} ({length} tokens) + {{max_tokens}} ({params.max_tokens}) exceeds "
                                  f"max_model_len {limit}", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
    if params.max_tokens is None and params.min_tokens > limit - length:
        raise InvalidRequestError(f"{{min_tokens}} ({params.min_tokens}) exceeds the {limit - length} tokens "
                                  f"max_model_len {limit} leaves after the {{prompt}} ({length} tokens)",
                                  "min_tokens", CONTEXT_LENGTH_EXCEEDED)


def format_number(value: Any) -> str:
    """2.0 -> '2', 0.5 -> '0.5', 2**63 - 1 -> its digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)
